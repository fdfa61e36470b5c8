"""What a request may ask for, against ``kvtier serve tiny`` (context 8192): the nulls OpenAI's
schema allows, presence / frequency penalties in [-2, 2] (NaN refused), a body over
``--max-request-bytes`` refused with a 413 before it is decoded (in each API's error shape),
and ``max_tokens`` past the context refused with a 400 naming both numbers (as vLLM), the same
on chat, completions, Messages and Responses; after each refusal the server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest

from kvtier.serve.api.protocol import DEFAULT_MAX_REQUEST_BYTES, ApiError, read_body

CONTEXT = 8192  # the tiny preset's max_position_embeddings
ASK = [{"role": "user", "content": "hello"}]


def _post(server, path: str, body=None, content=None, headers=None):
    return httpx.post(f"{server.url}{path}", json=body, content=content, timeout=120,
                      headers={"content-type": "application/json", **(headers or {})})


def _still_serving(server) -> None:
    r = _post(server, "/v1/chat/completions", {"model": "tiny", "messages": ASK, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text


# ---- nulls --------------------------------------------------------------------------------------

def test_chat_takes_the_nulls_openai_allows(server):
    """``"logprobs": null`` and the other nullable fields, as clients that send every field
    (LangChain, LiteLLM) write them."""
    nulls = {"logprobs": None, "top_logprobs": None, "stream": None, "n": None, "presence_penalty": None,
             "frequency_penalty": None, "temperature": None, "top_p": None, "seed": None, "stop": None,
             "max_completion_tokens": None, "stream_options": None, "tools": None, "tool_choice": None}
    r = _post(server, "/v1/chat/completions", {"model": "tiny", "messages": ASK, "max_tokens": 3, **nulls})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["logprobs"] is None and r.json()["usage"]["completion_tokens"] >= 1
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 3, "echo": None,
                                          "logprobs": None, "stream": None, "n": None})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None, r.text


# ---- presence / frequency penalties -----------------------------------------------------------

@pytest.mark.parametrize("path, extra", [("/v1/chat/completions", {"messages": ASK}),
                                         ("/v1/completions", {"prompt": "hello"})])
@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
def test_penalties_are_taken_in_range_and_refused_outside(server, path, extra, field):
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0, "ignore_eos": True, **extra}
    for value in (-2.0, 1.5, 2):
        r = _post(server, path, {**body, field: value})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    for value in (2.5, -3, "1", True):
        r = _post(server, path, {**body, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    for raw in ("NaN", "Infinity", "-Infinity"):  # what Python's json writes for them
        r = _post(server, path, content=json.dumps(body)[:-1] + f', "{field}": {raw}}}')
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    _still_serving(server)


def test_a_negative_penalty_makes_greedy_decoding_repeat_itself(server, tok):
    """A negative penalty raises the logits of the tokens already generated: at -2 / -2 greedy
    decoding of the tiny model comes back to them, so the output changes and has fewer distinct
    tokens (same length: ``ignore_eos``)."""
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    plain = _post(server, "/v1/completions", body).json()["choices"][0]["text"]
    looping = _post(server, "/v1/completions", {**body, "presence_penalty": -2.0,
                                                "frequency_penalty": -2.0}).json()["choices"][0]["text"]
    assert looping != plain
    assert len(set(tok.encode(looping))) < len(set(tok.encode(plain))), (plain, looping)


# ---- body size ----------------------------------------------------------------------------------

ENDPOINTS = {"/v1/chat/completions": "openai", "/v1/completions": "openai", "/v1/responses": "openai",
             "/v1/messages": "anthropic"}


def _error(r, shape: str) -> tuple[str, str]:
    """(type, message) of an error body in OpenAI's or Anthropic's shape."""
    body = r.json()
    if shape == "anthropic":
        assert body["type"] == "error", body
    return body["error"]["type"], body["error"]["message"]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_a_body_over_the_limit_is_a_413_in_the_apis_shape(server, path, chunked):
    size = DEFAULT_MAX_REQUEST_BYTES + 1
    payload = b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"x" * size + b'"}]}'
    content = iter([payload[i:i + (1 << 20)] for i in range(0, len(payload), 1 << 20)]) if chunked else payload
    r = _post(server, path, content=content)
    assert r.status_code == 413, r.text[:300]
    kind, message = _error(r, ENDPOINTS[path])
    assert kind == ("request_too_large" if ENDPOINTS[path] == "anthropic" else "invalid_request_error")
    assert str(DEFAULT_MAX_REQUEST_BYTES) in message and "--max-request-bytes" in message
    _still_serving(server)


class _Request:
    """What :func:`read_body` reads of a starlette ``Request``: headers and the body's chunks
    (counting the chunks taken)."""

    def __init__(self, chunks: list[bytes], declared: int | None):
        self.chunks, self.taken = chunks, 0
        self.headers = {} if declared is None else {"content-length": str(declared)}

    async def stream(self):
        for c in self.chunks:
            self.taken += 1
            yield c


@pytest.mark.parametrize("declare", [True, False])
def test_read_body_takes_the_limit_and_refuses_one_byte_more_without_reading_on(declare):
    import asyncio

    limit = 10
    req = _Request([b"12345", b"67890"], 10 if declare else None)
    assert asyncio.run(read_body(req, limit)) == b"1234567890"
    req = _Request([b"12345", b"678901", b"never read"], 11 if declare else None)
    with pytest.raises(ApiError) as e:
        asyncio.run(read_body(req, limit))
    assert e.value.status == 413 and e.value.param == "body"
    assert req.taken == (0 if declare else 2)  # a declared length is refused before any byte is read


# ---- max_tokens past the context ---------------------------------------------------------------

def test_completion_max_tokens_past_the_context_is_a_400_naming_both_numbers(server):
    prompt = list(range(1000, 1000 + CONTEXT - 3))
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 4})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "max_tokens", r.text
    assert f"{CONTEXT - 3} tokens" in err["message"] and "max_tokens is 4" in err["message"]
    assert str(CONTEXT) in err["message"]
    # exactly the context: accepted, and it ends there
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    # no max_tokens: the default (256) stops at the context's end
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": prompt, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": ASK, "max_tokens": CONTEXT}, "max_tokens"),
    ("/v1/chat/completions", {"messages": ASK, "max_completion_tokens": CONTEXT}, "max_tokens"),
    ("/v1/messages", {"messages": ASK, "max_tokens": CONTEXT}, None),
    ("/v1/responses", {"input": "hello", "max_output_tokens": CONTEXT}, "max_output_tokens"),
])
def test_max_tokens_past_the_context_is_the_same_400_on_every_api(server, path, body, param):
    r = _post(server, path, {"model": "tiny", **body})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    name = param or "max_tokens"
    assert message.startswith(f"{name}: the prompt has ") and f"{name} is {CONTEXT}" in message, message
    assert f"max_position_embeddings={CONTEXT}" in message
    if param is not None:
        assert r.json()["error"]["param"] == param
    _still_serving(server)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 9000}]}, "messages"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "x " * 9000}], "max_tokens": 4}, None),
    ("/v1/responses", {"input": "x " * 9000}, "input"),
])
def test_a_prompt_over_the_context_is_a_400_in_the_apis_names(server, path, body, param):
    r = _post(server, path, {"model": "tiny", **body})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith(f"{param or 'messages'}: the prompt has ") and "max_position_embeddings" in message
    if param is not None:
        assert r.json()["error"]["param"] == param
