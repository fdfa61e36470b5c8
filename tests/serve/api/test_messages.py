"""``POST /v1/messages`` through the official ``anthropic`` client against ``kvtier serve tiny``:
text and tool use, streamed and not, a tool loop whose next turn reads the cache, the session's
tool wait, stop sequences, and 400s in Anthropic's shape after which the server keeps serving.

``temperature`` goes as an extra body field: the newest SDKs dropped it from their signature."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serve.api.tool_waits import settle, tool_waits
from tests.toolcall.sweep import check_arguments

anthropic = pytest.importorskip("anthropic")

ASK = [{"role": "user", "content": "list the repository"}]
LS = {"name": "ls", "description": "list a directory",
      "input_schema": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 12}},
                       "required": ["path"], "additionalProperties": False}}
SEARCH = {"name": "search", "input_schema": {
    "type": "object", "properties": {"query": {"type": "string", "maxLength": 12}, "limit": {"type": "integer"}},
    "required": ["query"]}}
SCHEMAS = {"ls": LS["input_schema"], "search": SEARCH["input_schema"]}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)


def _blocks(msg) -> list[dict]:
    return [b.model_dump(exclude_none=True) for b in msg.content]


def _stream(client, **kw):
    """(event types, final message) of one streamed request."""
    with client.messages.stream(**kw) as s:
        types = [e.type for e in s]
        return types, s.get_final_message()


def test_text_streamed_equals_not_streamed(client):
    kw = dict(model="tiny", max_tokens=6, messages=ASK, extra_body=GREEDY)
    msg = client.messages.create(**kw)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "tiny"
    assert msg.stop_reason in ("max_tokens", "end_turn") and msg.usage.output_tokens <= 6
    assert msg.content and msg.content[0].type == "text" and msg.content[0].text
    types, streamed = _stream(client, **kw)
    assert types[0] == "message_start" and types[-1] == "message_stop" and "message_delta" in types
    assert _blocks(streamed) == _blocks(msg) and streamed.stop_reason == msg.stop_reason
    assert streamed.usage.output_tokens == msg.usage.output_tokens
    # the same prompt again: its full pages come from the cache; the split adds up to the prompt
    total = msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    assert streamed.usage.cache_read_input_tokens >= 16
    assert streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens == total


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "ls"}, {"type": "auto"}])
def test_tool_use_is_schema_valid_and_streams_to_the_same_message(client, choice):
    kw = dict(model="tiny", max_tokens=48, messages=ASK, tools=[SEARCH, LS], tool_choice=choice, extra_body=GREEDY)
    msg = client.messages.create(**kw)
    uses = [b for b in msg.content if b.type == "tool_use"]
    if choice["type"] != "auto":
        assert msg.stop_reason == "tool_use" and uses and all(b.type == "tool_use" for b in msg.content)
    names = {"ls"} if choice["type"] == "tool" else {"ls", "search"}
    for b in uses:
        assert b.name in names and b.id.startswith(f"functions.{b.name}:")
        assert check_arguments(json.dumps(b.input), SCHEMAS[b.name]) is None, b
    types, streamed = _stream(client, **kw)
    assert _blocks(streamed) == _blocks(msg) and streamed.stop_reason == msg.stop_reason
    n = len(msg.content)
    assert types.count("content_block_start") == types.count("content_block_stop") == n


def test_disable_parallel_tool_use_gives_one_call(client):
    msg = client.messages.create(model="tiny", max_tokens=64, messages=ASK, tools=[LS],
                                 tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY)
    assert msg.stop_reason == "tool_use" and len([b for b in msg.content if b.type == "tool_use"]) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_loop_reads_the_cache_and_the_session_waits_on_the_tool(client, server, stream):
    before, expired0 = tool_waits(server)
    user = f"agent-{stream}"
    kw = dict(model="tiny", max_tokens=48, tools=[LS], metadata={"user_id": user}, extra_body=GREEDY)
    first = client.messages.create(messages=ASK, tool_choice={"type": "any"}, **kw)
    assert first.stop_reason == "tool_use"
    assert settle(server, before + 1, expired0)  # the session now waits on its tool
    history = ASK + [{"role": "assistant", "content": _blocks(first)},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id, "content": "a.py b.py"}
                                                  for b in first.content if b.type == "tool_use"]}]
    if stream:
        _, second = _stream(client, messages=history, tool_choice={"type": "none"}, **kw)
    else:
        second = client.messages.create(messages=history, tool_choice={"type": "none"}, **kw)
    assert all(b.type == "text" for b in second.content) and second.stop_reason in ("end_turn", "max_tokens")
    prompt = second.usage.input_tokens + second.usage.cache_read_input_tokens
    first_prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    # the first turn's prompt pages (at least) are read back
    assert second.usage.cache_read_input_tokens >= (first_prompt // 16) * 16 > 0 and prompt > first_prompt
    assert settle(server, before, expired0)  # the result came back: the wait ended


def test_stop_sequences_end_the_text_and_are_reported(client):
    kw = dict(model="tiny", max_tokens=24, messages=ASK, extra_body=GREEDY)
    text = client.messages.create(**kw).content[0].text
    stop = text[4:6]
    assert len(stop) == 2, text
    msg = client.messages.create(stop_sequences=[stop], **kw)
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    at = text.find(stop)
    assert [b.text for b in msg.content] == ([text[:at]] if at else [])


BAD = [
    dict(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}],
         tools=[LS]),
    dict(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "ls", "input": {}}]}],
         tools=[LS]),
    dict(messages=[{"role": "user", "content": [{"type": "video", "url": "x"}]}]),
    dict(messages=ASK, extra_body={"frequency_penalty": 0.5}),
    dict(messages=ASK, tools=[{"name": "ls", "input_schema": {"type": "object", "properties": {"p": {"type": "nope"}}}}]),
    dict(messages=ASK, tools=[LS], tool_choice={"type": "tool", "name": "rm"}),
]


@pytest.mark.parametrize("bad", BAD)
def test_bad_input_is_a_400_in_anthropic_shape_and_the_server_keeps_serving(client, bad):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=4, **bad)
    assert e.value.status_code == 400
    body = e.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    ok = client.messages.create(model="tiny", max_tokens=2, messages=ASK)
    assert ok.usage.output_tokens >= 1


def test_raw_errors_unknown_model_and_bad_json(server, client):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-x", max_tokens=2, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"
    r = httpx.post(f"{server.url}/v1/messages", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
