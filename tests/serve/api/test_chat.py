"""``kvtier serve`` through the official ``openai`` client: chat with and without tools,
streaming and not, tool choices, the order of streamed tool calls."""

from __future__ import annotations

import json
import uuid

import pytest

from tests.toolcall.sweep import check_arguments
from tests.helpers.tool_schemas import LS, SEARCH

ASK = [{"role": "user", "content": "list the repository"}]
# A tool without arguments: its calls close at once, so the random model writes several in a turn.
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                       "additionalProperties": False}}}
SCHEMAS = {"search": SEARCH["function"]["parameters"], "ls": LS["function"]["parameters"]}


def _stream(client, **kw):
    """(chunks, reassembled message dict, finish_reason, usage) of one streamed chat request."""
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    content, calls, finish, usage = "", {}, None, None
    for c in chunks:
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += tc.id or ""
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return chunks, {"content": content, "tool_calls": [calls[i] for i in sorted(calls)]}, finish, usage


def _message(resp):
    m = resp.choices[0].message
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls or []]
    return {"content": m.content or "", "tool_calls": calls}


def test_models_and_health(server):
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["tiny"]
    import httpx

    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_chat_without_tools_streamed_equals_non_streamed(server):
    client = server.client()
    kw = dict(model="tiny", messages=ASK, max_tokens=6, temperature=0)
    resp = client.chat.completions.create(**kw)
    assert resp.choices[0].finish_reason in ("length", "stop") and resp.usage.completion_tokens <= 6
    assert resp.usage.prompt_tokens > 0 and resp.choices[0].message.content
    chunks, streamed, finish, usage = _stream(client, **kw)
    assert streamed == _message(resp) and finish == resp.choices[0].finish_reason
    assert usage.completion_tokens == resp.usage.completion_tokens
    # the second identical prompt reuses the first one's full pages
    assert usage.prompt_tokens_details.cached_tokens >= 16
    assert usage.model_extra["cached_tokens_by_tier"]["device"] == usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "ls"}}, "auto"])
def test_tool_calls_stream_and_reassemble_to_the_non_streamed_result(server, choice):
    client = server.client()
    kw = dict(model="tiny", messages=ASK, tools=[SEARCH, LS], tool_choice=choice, max_tokens=48, temperature=0,
              seed=3)
    resp = client.chat.completions.create(**kw)
    msg = _message(resp)
    if choice != "auto":
        assert resp.choices[0].finish_reason == "tool_calls" and msg["tool_calls"] and msg["content"] == ""
    names = {"ls"} if isinstance(choice, dict) else {"search", "ls"}
    for call in msg["tool_calls"]:
        assert call["name"] in names and call["id"].startswith(f"functions.{call['name']}:")
        assert check_arguments(call["arguments"], SCHEMAS[call["name"]]) is None, call
    _, streamed, finish, _ = _stream(client, **kw)
    assert streamed == msg and finish == resp.choices[0].finish_reason


def test_tool_choice_none_gives_text(server):
    resp = server.client().chat.completions.create(model="tiny", messages=ASK, tools=[SEARCH, LS],
                                                   tool_choice="none", max_tokens=8, seed=3)
    assert not resp.choices[0].message.tool_calls and resp.choices[0].finish_reason in ("length", "stop")


def _call_order(client, seed):
    """Events of one streamed turn: ("tokens", n) per chunk carrying tokens, ("call", index)."""
    events, usage = [], None
    for c in client.chat.completions.create(
            model="tiny", messages=ASK, tools=[NOW], tool_choice="required", max_tokens=48,
            temperature=1.0, seed=seed, logprobs=True, stream=True, stream_options={"include_usage": True}):
        usage = c.usage or usage
        for ch in c.choices:
            if ch.logprobs is not None and ch.logprobs.content:
                events.append(("tokens", len(ch.logprobs.content)))
            for tc in ch.delta.tool_calls or []:
                events.append(("call", tc.index))
    return events, usage


def test_first_tool_call_arrives_before_the_turn_ends(server):
    """In a turn with two or more calls, the first call's delta comes before the turn's last token."""
    client = server.client()
    for seed in range(16):  # the random model writes several calls for some seeds
        events, usage = _call_order(client, seed)
        calls = [i for kind, i in events if kind == "call"]
        if len(calls) >= 2:
            break
    else:
        pytest.fail("no seed in range(16) gave a turn with two tool calls")
    assert sum(n for kind, n in events if kind == "tokens") == usage.completion_tokens  # every token streamed
    first_call = events.index(("call", 0))
    last_tokens = max(i for i, (kind, _) in enumerate(events) if kind == "tokens")
    assert calls == sorted(calls) and first_call < last_tokens, events


def _waiting(server) -> float:
    """Sessions waiting on a tool, once the engine thread has published (every 0.2 s)."""
    import time

    time.sleep(0.5)
    return server.metrics()[("kvtier_sessions_waiting_on_tools",)]


def test_session_keeps_its_encoder_and_reuses_the_cache(server):
    import httpx

    client = server.client()
    msgs = [{"role": "user", "content": "Summarise:\n" + "def f(x):\n    return x * 2\n" * 20}]
    waiting = _waiting(server)
    r1 = client.chat.completions.create(model="tiny", messages=msgs, tools=[LS], tool_choice="required",
                                        max_tokens=40, temperature=0, extra_body={"session_id": "s-keep"})
    assert r1.choices[0].finish_reason == "tool_calls"
    assert _waiting(server) == waiting + 1  # the turn ended in a tool call: the pool was told the session waits
    call = r1.choices[0].message.tool_calls[0]
    msgs += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": "README.md\nsrc/"}]
    r2 = client.chat.completions.create(model="tiny", messages=msgs, tools=[LS], max_tokens=4, temperature=0,
                                        extra_headers={"X-Session-Id": "s-keep"})
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens // 16 * 16 - 16
    assert _waiting(server) == waiting  # the tool result arrived: the wait is over
    assert httpx.delete(f"{server.url}/v1/sessions/s-keep").json()["deleted"] is True
    gone = httpx.delete(f"{server.url}/v1/sessions/s-keep")
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "session_id"


def test_stop_string_cuts_the_answer(server):
    client = server.client()
    full = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=12, temperature=0)
    text = full.choices[0].message.content
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == text[:text.index(stop)]
    _, streamed, finish, _ = _stream(client, model="tiny", messages=ASK, max_tokens=12, temperature=0, stop=[stop])
    assert streamed["content"] == text[:text.index(stop)] and finish == "stop"


def test_completions_text_and_token_ids(server):
    client = server.client()
    ids = list(range(1000, 1040))
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == 40 and r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    t = client.completions.create(model="tiny", prompt="def main():", max_tokens=3, temperature=0)
    assert t.usage.prompt_tokens >= 3 and t.choices[0].text is not None
    assert json.loads(r.model_dump_json())["usage"]["cached_tokens_by_tier"].keys() == {"device", "host", "disk"}


def test_cache_salt_isolates_requests(server):
    client = server.client()
    # Salts no other test sends: the session-wide server keeps every earlier test's pages, and a
    # salt another test used for a prompt with the same template opening shares that first page.
    salt_a, salt_b = (f"{t}-{uuid.uuid4().hex}" for t in ("tenant-a", "tenant-b"))
    msgs = [{"role": "user", "content": "salted prompt " * 20}]

    def cached(salt=None, **kw):
        body = {"cache_salt": salt} if salt is not None else {}
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1, extra_body=body, **kw)
        return r.usage.prompt_tokens_details.cached_tokens

    cached(salt_a)
    same = cached(salt_a)
    assert same >= 64  # same salt: the prompt's pages are reused
    assert cached(salt_b) == 0  # a new salt shares nothing
    # unsalted requests of earlier tests share the template's first page at most, never tenant-a's pages
    assert cached() <= 16 < same
    client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1,
                                   extra_body={"cache_salt": salt_a, "session_id": "salted"})
    with pytest.raises(Exception, match="cache_salt"):
        client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1,
                                       extra_body={"cache_salt": salt_b, "session_id": "salted"})
