"""The Responses API's pure parts: request -> chat request translation, its 400s, the kept
responses behind ``previous_response_id``, sessions, and the event stream (no server)."""

from __future__ import annotations

import json

import pytest

from kvtier.serve.api.jobs import Delta, Final
from kvtier.serve.api.protocol import ApiError, parse
from kvtier.serve.api.responses import Kept, ResponsesRequest, ResponseStore, session_for, to_chat
from kvtier.serve.api.responses_stream import ResponsesFormat, prepare

LS = {"type": "function", "name": "ls", "description": "list a directory", "strict": True,
      "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
CALL = {"type": "function_call", "call_id": "functions.ls:0", "name": "ls", "arguments": '{"path":"a"}', "id": "fc_1"}


def _chat(history=(), **body):
    return to_chat(parse(ResponsesRequest, {"model": "tiny", **body}), list(history))


def _error(**body) -> ApiError:
    with pytest.raises(ApiError) as e:
        _chat(**body)
    assert e.value.status == 400
    return e.value


def test_items_become_the_chat_conversation():
    chat, turns = _chat(instructions="be brief", tools=[LS], tool_choice={"type": "function", "name": "ls"},
                        max_output_tokens=32, temperature=0.0, top_p=0.5, parallel_tool_calls=False, input=[
                            {"role": "developer", "content": "no chatter"},
                            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list"}]},
                            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "hm"}]},
                            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                             "content": [{"type": "output_text", "text": "Sure.", "annotations": []}]},
                            CALL, CALL | {"call_id": "functions.ls:1"},
                            {"type": "function_call_output", "call_id": "functions.ls:1", "output": "b.py"},
                            {"type": "function_call_output", "call_id": "functions.ls:0", "output": "a.py"}])
    calls = [{"id": f"functions.ls:{i}", "type": "function", "function": {"name": "ls", "arguments": '{"path":"a"}'}}
             for i in (0, 1)]
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"}, {"role": "system", "content": "no chatter"},
        {"role": "user", "content": "list"},
        {"role": "assistant", "content": "Sure.", "reasoning_content": "hm", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "functions.ls:1", "content": "b.py"},
        {"role": "tool", "tool_call_id": "functions.ls:0", "content": "a.py"}]
    assert turns == chat["messages"][1:]  # kept without the instructions
    assert chat["tools"] == [{"type": "function", "function": {"name": "ls", "description": "list a directory",
                                                               "parameters": LS["parameters"]}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "ls"}}
    assert (chat["max_tokens"], chat["temperature"], chat["top_p"], chat["parallel_tool_calls"]) == (32, 0.0, 0.5, False)


def test_a_kept_conversation_comes_before_the_new_input_and_its_calls_need_outputs():
    history = [{"role": "user", "content": "list"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "functions.ls:0", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]}]
    chat, turns = _chat(history, input=[{"type": "function_call_output", "call_id": "functions.ls:0", "output": "x"}])
    assert turns == history + [{"role": "tool", "tool_call_id": "functions.ls:0", "content": "x"}]
    with pytest.raises(ApiError) as e:
        _chat(history, input="next")
    assert "no function_call_output" in e.value.message and "functions.ls:0" in e.value.message
    assert history[1]["tool_calls"][0]["id"] == "functions.ls:0" and len(history) == 2  # not changed


@pytest.mark.parametrize("body, param, words", [
    ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]}, "input[0].call_id",
     "no function_call with call_id 'c9'"),
    ({"input": ["hi", CALL]}, "input[0].type", "not supported"),
    ({"input": [{"role": "user", "content": "x"}, CALL]}, "input", "no function_call_output"),
    ({"input": [{"role": "user", "content": "x"}, CALL, CALL]}, "input[2].call_id", "duplicate"),
    ({"input": [{"role": "user", "content": "x"}, CALL | {"arguments": "[1]"}]}, "input[1].arguments",
     "expected a JSON object"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type", "text-only"),
    ({"input": [{"role": "user", "content": "x", "colour": 1}]}, "input[0].colour", "Extra inputs"),
    ({"input": "x", "seed": 1}, "seed", "Extra inputs"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", "only 'function'"),
    ({"input": "x", "tools": [LS | {"function": {}}]}, "tools[0].function", "unknown parameter"),
    ({"input": "x", "tools": [LS], "tool_choice": {"type": "function", "function": {"name": "ls"}}},
     "tool_choice", "expected"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format", "structured"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "not supported"),
    ({"input": "x", "background": True}, "background", "not supported"),
    ({"input": []}, "input", "empty"),
    ({"input": [{"role": "assistant", "content": "only me"}]}, "input", "no user message"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "greater than or equal"),
])
def test_bad_requests_are_400s_naming_the_field(body, param, words):
    e = _error(**body)
    assert e.param == param and words in e.message, (e.param, e.message)
    assert e.body()["error"]["type"] == "invalid_request_error"


def test_chat_path_errors_are_named_in_this_api():
    store = ResponseStore(600)
    bad = LS | {"parameters": {"type": "object", "properties": {"x": {"type": "strin"}}}}
    with pytest.raises(ApiError) as e:
        prepare({"model": "tiny", "input": "x", "tools": [bad]}, store, None)
    assert e.value.message.startswith("tools[0].parameters"), e.value.message


def test_kept_responses_expire_after_the_ttl_and_chains_keep_their_parents():
    now = [0.0]
    store = ResponseStore(10.0, clock=lambda: now[0])
    a = Kept("s", None, [{"role": "user", "content": "1"}])
    store.put("resp_a", a)
    now[0] = 5.0
    store.put("resp_b", Kept("s", store.get("resp_a"), [{"role": "user", "content": "2"}]))
    now[0] = 12.0
    with pytest.raises(ApiError) as e:
        store.get("resp_a")
    assert e.value.param == "previous_response_id" and "10 s" in e.value.message
    assert [t["content"] for t in store.get("resp_b").history()] == ["1", "2"] and len(store) == 1
    now[0] = 15.5
    with pytest.raises(ApiError):
        store.get("resp_b")


def test_sessions_come_from_header_then_chain_then_prompt_cache_key():
    prev = Kept("chain", None, [])
    assert session_for("h", prev, "k", "resp_1", True) == "h"
    assert session_for(None, prev, "k", "resp_1", True) == "chain"
    assert session_for(None, None, "k", "resp_1", True) == "k"
    assert session_for(None, None, None, "resp_1", True) == "response:resp_1"
    assert session_for(None, None, None, "resp_1", False) is None
    store = ResponseStore(600)
    req, params, sid, fmt = prepare({"model": "tiny", "input": "x", "store": False}, store, None)
    assert sid is None and fmt.store is None and req.messages == [{"role": "user", "content": "x"}]


def _final(**kw) -> Final:
    base = dict(finish_reason="tool_calls", prompt_tokens=40, completion_tokens=9, cached_tokens=32,
                cached_tokens_by_tier={"device": 32}, content="", reasoning="", tool_calls=[],
                tool_call_problems=[], logprobs=None, token_ids=[])
    return Final(**(base | kw))


def _events(chunks: list[bytes]) -> list[dict]:
    out = []
    for raw in b"".join(chunks).decode().strip().split("\n\n"):
        name, data = raw.split("\n")
        out.append(json.loads(data[6:]))
        assert name == f"event: {out[-1]['type']}"
    return out


def test_stream_events_keep_item_ids_and_the_finished_response_is_kept():
    store = ResponseStore(600)
    call = {"index": 0, "id": "functions.ls:0", "name": "ls", "arguments": '{"path":"a"}'}
    fmt = ResponsesFormat("resp_1", parse(ResponsesRequest, {"model": "tiny", "input": "x"}).echo(), store, "s",
                          None, [{"role": "user", "content": "x"}])
    w = fmt.writer("resp_1", 0, "tiny", None, 40)
    chunks = [w.first()] + w.delta(Delta(text="Hi")) + w.delta(Delta(tool_calls=(call,)))
    chunks += w.final(_final(content="Hi", tool_calls=[call]))
    ev = _events(chunks)
    assert [e["type"] for e in ev] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in ev] == list(range(len(ev)))
    done = [e["item"] for e in ev if e["type"] == "response.output_item.done"]
    final = ev[-1]["response"]
    assert final["output"] == done and final["status"] == "completed" and final["id"] == "resp_1"
    assert done[1] == {"type": "function_call", "id": done[1]["id"], "call_id": "functions.ls:0", "name": "ls",
                       "arguments": '{"path":"a"}', "status": "completed"}
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 32
    kept = store.get("resp_1")
    assert kept.session_id == "s" and kept.history() == [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "Hi", "tool_calls": [
            {"id": "functions.ls:0", "type": "function", "function": {"name": "ls", "arguments": '{"path":"a"}'}}]}]


def test_a_length_finish_is_an_incomplete_response():
    fmt = ResponsesFormat("resp_2", {}, None, None, None, [])
    body = fmt.body("resp_2", 0, "tiny", _final(finish_reason="length", content="par"), None)
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["content"][0]["text"] == "par"


def test_an_error_ending_the_stream_is_a_failed_response():
    fmt = ResponsesFormat("resp_3", {}, ResponseStore(600), None, None, [])
    w = fmt.writer("resp_3", 0, "tiny", None, 4)
    ev = _events([w.first(), *w.error(ApiError(500, "engine error: boom"))])
    assert ev[-1]["type"] == "response.failed" and ev[-1]["response"]["status"] == "failed"
    assert ev[-1]["response"]["error"] == {"code": "server_error", "message": "engine error: boom"}
    with pytest.raises(ApiError):
        fmt.store.get("resp_3")  # a failed response is not kept
