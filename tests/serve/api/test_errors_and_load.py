"""Bad input (400 naming the field), unknown model (404), overload (503), disconnects and a
bounded 64-client load test ending with every device page free; ``/metrics`` counters."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import openai
import pytest

from tests.serve.api.conftest import start_server, stop_server
from tests.toolcall.conftest import UNGENERABLE_TOOL
from tests.helpers.tool_schemas import LS

ASK = [{"role": "user", "content": "hello"}]


def _post(server, path, body, raw=None):
    return httpx.post(f"{server.url}{path}", json=body if raw is None else None, content=raw,
                      headers={"content-type": "application/json"}, timeout=60)


@pytest.mark.parametrize("body, param", [
    ({"model": "tiny", "messages": ASK, "max_tokens": "ten"}, "max_tokens"),
    ({"model": "tiny", "messages": ASK, "temperature": 3}, "temperature"),
    ({"model": "tiny", "messages": ASK, "top_p": 0}, "top_p"),
    ({"model": "tiny", "messages": ASK, "stream": "yes"}, "stream"),
    ({"model": "tiny", "messages": "hi"}, "messages"),
    ({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"model": "tiny", "messages": ASK, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "format": "date"}}}]}, "tools[0].function.parameters"),
    ({"model": "tiny", "messages": ASK, "tools": [LS], "tool_choice": {"type": "function",
                                                                       "function": {"name": "nope"}}}, "tool_choice"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x " * 9000}], "max_tokens": 4}, "messages"),
    ({"messages": ASK}, "model"),
])
def test_bad_chat_requests_are_400_naming_the_field(server, body, param):
    r = _post(server, "/v1/chat/completions", body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["type"] == "invalid_request_error", r.text
    assert err["param"] == param or err["message"].startswith(param), err


def test_malformed_json_unknown_model_and_bad_prompts(server):
    r = _post(server, "/v1/chat/completions", None, raw=b'{"model": "tiny", "messages": [')
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = _post(server, "/v1/chat/completions", {"model": "gpt-9", "messages": ASK})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": [1, -5]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": list(range(9000))})
    assert r.status_code == 400 and "max_position_embeddings" in r.json()["error"]["message"]
    # a schema in the accepted subset whose grammar llguidance cannot build: 400, the engine unharmed
    r = _post(server, "/v1/chat/completions", {"model": "tiny", "messages": ASK, "tools": [UNGENERABLE_TOOL],
                                               "tool_choice": "required"})
    assert r.status_code == 400 and "does not compile" in r.json()["error"]["message"], r.text
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        server.client().chat.completions.create(model="tiny", messages=ASK, max_tokens=0)
    # the server stays up and serves the next request
    ok = server.client().chat.completions.create(model="tiny", messages=ASK, max_tokens=2)
    assert ok.usage.completion_tokens == 2


async def _one_stream(client, i: int, turns: int) -> list[str]:
    outcomes, msgs = [], [{"role": "user", "content": f"client {i}: count to three"}]
    for _ in range(turns):
        try:
            stream = await client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, stream=True,
                                                          extra_body={"session_id": f"load-{i}", "ignore_eos": True})
            text = ""
            async for c in stream:
                for ch in c.choices:
                    text += ch.delta.content or ""
            outcomes.append("ok")
            msgs = msgs + [{"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
        except openai.APIStatusError as e:
            outcomes.append(str(e.status_code))
    return outcomes


def test_64_concurrent_streaming_clients_end_with_all_pages_free(server):
    async def main():
        client = server.async_client()
        results = await asyncio.gather(*(_one_stream(client, i, 3) for i in range(64)))
        await client.close()
        return results

    before = server.metrics()
    results = asyncio.run(main())
    flat = [o for r in results for o in r]
    assert len(flat) == 64 * 3 and set(flat) <= {"ok", "503"} and flat.count("ok") > 0
    assert server.wait_pages_free() == 0
    after = server.metrics()
    assert after[("kvtier_engine_errors_total",)] == before[("kvtier_engine_errors_total",)]
    assert (after[("kvtier_request_finish_total", ("reason", "length"))]
            - before.get(("kvtier_request_finish_total", ("reason", "length")), 0)) == flat.count("ok")


def test_disconnect_mid_stream_frees_the_pages(server):
    async def main():
        client = server.async_client()
        gone = 0
        for i in range(4):
            stream = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"long answer {i} " * 30}], max_tokens=2000,
                stream=True, extra_body={"ignore_eos": True})
            n = 0
            async for _ in stream:
                n += 1
                if n == 3:
                    break
            await stream.close()  # the connection is dropped mid-stream
            gone += 1
        await client.close()
        return gone

    metrics = server.metrics()
    before = metrics.get(("kvtier_client_disconnects_total",), 0)
    finished = sum(v for k, v in metrics.items() if k[0] == "kvtier_request_finish_total")
    assert asyncio.run(main()) == 4
    deadline = time.monotonic() + 30
    while server.metrics().get(("kvtier_client_disconnects_total",), 0) < before + 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.metrics()[("kvtier_client_disconnects_total",)] == before + 4
    assert server.wait_pages_free() == 0
    # the pages came back because the requests were aborted, not because they ran to the end
    assert sum(v for k, v in server.metrics().items() if k[0] == "kvtier_request_finish_total") == finished
    ok = server.client().chat.completions.create(model="tiny", messages=ASK, max_tokens=2)
    assert ok.choices[0].finish_reason == "length"


def test_metrics_parse_and_counters_move(server):
    before = server.metrics()
    server.client().chat.completions.create(model="tiny", messages=ASK, max_tokens=3)
    time.sleep(0.5)  # the engine counters are published every 0.2 s
    after = server.metrics()
    assert after[("kvtier_generation_tokens_total",)] >= before.get(("kvtier_generation_tokens_total",), 0) + 3
    assert after[("kvtier_time_to_first_token_seconds_count",)] > before.get(
        ("kvtier_time_to_first_token_seconds_count",), 0)
    assert after[("kvtier_prefill_tokens_total",)] >= before[("kvtier_prefill_tokens_total",)]
    assert after[("kvtier_device_pages_total",)] == 1024
    for tier in ("device", "host", "disk"):
        assert ("kvtier_hit_tokens_total", ("tier", tier)) in after and ("kvtier_cached_blocks", ("tier", tier)) in after
    assert after[("kvtier_cached_blocks", ("tier", "device"))] > 0  # the prompts' full pages stay cached


def test_overload_gives_503_and_the_server_recovers(tmp_path):
    s = start_server(tmp_path, "--num-device-pages", "256", "--max-queue", "2")
    try:
        async def main():
            client = s.async_client()
            outs = await asyncio.gather(*(client.chat.completions.create(
                model="tiny", messages=ASK, max_tokens=64, extra_body={"ignore_eos": True}) for _ in range(8)),
                return_exceptions=True)
            await client.close()
            return outs

        outs = asyncio.run(main())
        codes = [getattr(o, "status_code", 200) for o in outs]
        assert set(codes) == {200, 503} and codes.count(200) >= 2, outs
        assert s.client().chat.completions.create(model="tiny", messages=ASK, max_tokens=2).usage.completion_tokens == 2
        # 256 pages of 16 tokens hold less than the context (8192): /v1/models says what a request may
        # have, and an output the pages cannot hold is refused naming max_tokens
        [m] = httpx.get(f"{s.url}/v1/models", timeout=30).json()["data"]
        assert m["max_model_len"] == 256 * 16
        r = httpx.post(f"{s.url}/v1/chat/completions", timeout=30,
                       json={"model": "tiny", "messages": ASK, "max_tokens": 5000})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    finally:
        stop_server(s)


def test_a_non_streaming_client_that_leaves_frees_its_pages(server):
    before = server.metrics().get(("kvtier_client_disconnects_total",), 0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", timeout=1.0,
                   json={"model": "tiny", "messages": ASK, "max_tokens": 5000, "ignore_eos": True})
    deadline = time.monotonic() + 30
    while server.metrics().get(("kvtier_client_disconnects_total",), 0) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.metrics()[("kvtier_client_disconnects_total",)] == before + 1
    assert server.wait_pages_free() == 0


def test_a_client_that_leaves_mid_upload_leaves_no_stack_trace(server):
    """A body cut short (``Content-Length`` 1000, 8 bytes sent, socket closed) is answered as a 400
    nobody reads: no traceback in the server's log, and the next request is served."""
    host, port = server.url.removeprefix("http://").split(":")
    before = len(server.log.read_text(errors="replace"))
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"model\"")
    ok = _post(server, "/v1/chat/completions", {"model": "tiny", "messages": ASK, "max_tokens": 1})
    assert ok.status_code == 200
    time.sleep(0.5)  # the cut request's handler runs beside the one above
    assert "Traceback" not in server.log.read_text(errors="replace")[before:]


def test_session_header_is_checked_like_the_body_field(server):
    # the X-Session-Id header is the body's session_id by another way: the same 1-256 characters
    body = {"model": "tiny", "messages": ASK, "max_tokens": 1}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"X-Session-Id": "s" * 257}, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "session_id" and "X-Session-Id" in err["message"], r.text
    assert httpx.delete(f"{server.url}/v1/sessions/{'s' * 257}", timeout=60).status_code == 404  # none was made
    ok = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"X-Session-Id": "s" * 256}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_a_refused_first_turn_leaves_no_session(server):
    # a refused request must not start the session: its cache_salt would bind the session id
    bad = {"model": "tiny", "messages": [{"role": "robot", "content": "x"}], "max_tokens": 1,
           "session_id": "refused-first", "cache_salt": "tenant-a"}
    assert _post(server, "/v1/chat/completions", bad).status_code == 400
    assert httpx.delete(f"{server.url}/v1/sessions/refused-first", timeout=60).status_code == 404
    good = {**bad, "messages": ASK, "cache_salt": "tenant-b"}
    r = _post(server, "/v1/chat/completions", good)
    assert r.status_code == 200, r.text
    # a refused later turn keeps the session and its salt
    assert _post(server, "/v1/chat/completions", {**bad, "cache_salt": "tenant-b"}).status_code == 400
    r = _post(server, "/v1/chat/completions", {**good, "cache_salt": "tenant-a"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
    assert httpx.delete(f"{server.url}/v1/sessions/refused-first", timeout=60).status_code == 200
