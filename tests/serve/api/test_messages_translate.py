"""The Messages API's pure parts: request -> chat request translation, its 400s, Anthropic's
error shape, and the event stream built from chat deltas (no server)."""

from __future__ import annotations

import json

import pytest

from kvtier.serve.api.jobs import Delta, Final
from kvtier.serve.api.messages import MessagesRequest, error_body, rename_fields, to_chat
from kvtier.serve.api.messages_stream import MessagesWriter, message, prepare
from kvtier.serve.api.protocol import ApiError, parse

LS = {"name": "ls", "description": "list a directory",
      "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
CALL = {"type": "tool_use", "id": "functions.ls:0", "name": "ls", "input": {"path": "src", "deep": [1, 2]}}


def _chat(**body) -> dict:
    body = {"model": "tiny", "max_tokens": 16, **body}
    return to_chat(parse(MessagesRequest, body))


def _error(**body) -> ApiError:
    with pytest.raises(ApiError) as e:
        _chat(**body)
    assert e.value.status == 400
    return e.value


def test_a_tool_loop_becomes_the_chat_conversation_the_model_generated():
    chat = _chat(system=[{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}],
                 tools=[LS], tool_choice={"type": "auto", "disable_parallel_tool_use": True},
                 stop_sequences=["END"], temperature=0.5, top_p=0.9,
                 messages=[{"role": "user", "content": "list"},
                           {"role": "assistant", "content": [{"type": "text", "text": "Sure."}, CALL]},
                           {"role": "user", "content": [
                               {"type": "tool_result", "tool_use_id": "functions.ls:0", "content": "a.py"},
                               {"type": "text", "text": "and now?"}]},
                           {"role": "assistant", "content": [CALL | {"id": "functions.ls:1"}]},
                           {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "functions.ls:1",
                                                         "is_error": True,
                                                         "content": [{"type": "text", "text": "denied"}]}]}])
    assert chat["messages"] == [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "list"}]},
        {"role": "assistant", "content": "Sure.", "tool_calls": [
            {"id": "functions.ls:0", "type": "function",
             "function": {"name": "ls", "arguments": '{"path":"src","deep":[1,2]}'}}]},  # compact, as K2 writes
        {"role": "tool", "tool_call_id": "functions.ls:0", "content": "a.py"},
        {"role": "user", "content": [{"type": "text", "text": "and now?"}]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "functions.ls:1", "type": "function",
             "function": {"name": "ls", "arguments": '{"path":"src","deep":[1,2]}'}}]},
        {"role": "tool", "tool_call_id": "functions.ls:1", "content": "Error: denied"}]
    assert chat["tools"] == [{"type": "function", "function": {"name": "ls", "description": "list a directory",
                                                               "parameters": LS["input_schema"]}}]
    assert chat["tool_choice"] == "auto" and chat["parallel_tool_calls"] is False
    assert chat["stop"] == ["END"] and chat["temperature"] == 0.5 and chat["top_p"] == 0.9
    assert chat["max_tokens"] == 16 and chat["stream"] is False


@pytest.mark.parametrize("choice, chat_choice", [
    ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "ls"}, {"type": "function", "function": {"name": "ls"}})])
def test_tool_choice_maps_onto_chat_and_builds_the_grammar(choice, chat_choice):
    body = {"model": "tiny", "max_tokens": 16, "tools": [LS], "tool_choice": choice,
            "messages": [{"role": "user", "content": "x"}]}
    req, params, sid, _ = prepare(body, None)
    assert req.tool_choice == chat_choice and params.tool_choice == chat_choice and sid is None
    assert params.tool_grammar is not None  # constrained exactly as a chat request


def test_session_comes_from_the_header_then_metadata_user_id():
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
            "metadata": {"user_id": "u1"}}
    assert prepare(body, None)[2] == "u1"
    assert prepare(body, "h1")[2] == "h1"
    assert prepare({k: v for k, v in body.items() if k != "metadata"}, None)[2] is None


@pytest.mark.parametrize("body, param, words", [
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}],
      "tools": [LS]}, "messages[0].content[0].tool_use_id", "unexpected tool_use_id 't1'"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [CALL]},
                   {"role": "user", "content": "no result"}], "tools": [LS]},
     "messages[1]", "without tool_result blocks"),
    ({"messages": [{"role": "user", "content": [CALL]}], "tools": [LS]},
     "messages[0].content[0].type", "user messages take only"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "a", "content": "x"}]}, {"role": "user", "content": "y"}]},
     "messages[1].content[0].type", "assistant messages take only"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].type", "text-only model"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "colour": 1}]}]},
     "messages[0].content[0].colour", "Extra inputs are not permitted"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs", "Extra inputs"),
    ({"messages": [{"role": "developer", "content": "x"}]}, "messages[0].role", "Input should be"),
    ({"messages": [{"role": "user", "content": ""}]}, "messages[0].content", "empty"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "The answer is"}]},
     "messages[1]", "prefill"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [CALL]},
                   {"role": "user", "content": [{"type": "text", "text": "first"}, {
                       "type": "tool_result", "tool_use_id": CALL["id"], "content": "x"}]}], "tools": [LS]},
     "messages[2].content[1]", "must come before any text"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "bash_20250124", "name": "bash"}]},
     "tools[0].type", "server tool"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f", "input_schema": {"type": "string"}}]},
     "tools[0].input_schema.type", "expected 'object'"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [LS], "tool_choice": {"type": "tool"}},
     "tool_choice.name", "required"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "any"}}, "tool_choice", "needs tools"),
    ({"messages": [{"role": "user", "content": "x"}], "top_k": 5}, "top_k", "not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 1.5}, "temperature", "less than or equal"),
    ({"messages": [{"role": "user", "content": "x"}], "stop_sequences": ["a", ""]}, "stop_sequences", "non-empty"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [CALL]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": CALL["id"], "content": "r"}]}]},
     "tools", "must declare tools"),
])
def test_bad_requests_are_400s_naming_the_field(body, param, words):
    e = _error(**body)
    assert e.param == param and words in e.message, (e.param, e.message)
    assert error_body(e) == {"type": "error", "error": {"type": "invalid_request_error", "message": e.message}}


def test_missing_max_tokens_and_the_error_shape_by_status():
    with pytest.raises(ApiError) as e:
        parse(MessagesRequest, {"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    assert e.value.param == "max_tokens" and "Field required" in e.value.message
    assert error_body(ApiError(404, "m"))["error"]["type"] == "not_found_error"
    assert error_body(ApiError(503, "m"))["error"]["type"] == "overloaded_error"
    assert error_body(ApiError(500, "m"))["error"]["type"] == "api_error"


def test_schema_errors_of_the_chat_path_name_input_schema():
    bad = {"name": "f", "input_schema": {"type": "object", "properties": {"x": {"type": "strin"}}}}
    body = {"model": "tiny", "max_tokens": 4, "tools": [bad], "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(ApiError) as e:
        prepare(body, None)
    assert e.value.message.startswith("tools[0].input_schema"), e.value.message
    assert rename_fields(ApiError(400, "tools[1].function.name: bad", "tools[1].function.name")).param == "tools[1].name"


def _final(**kw) -> Final:
    base = dict(finish_reason="tool_calls", prompt_tokens=40, completion_tokens=9, cached_tokens=32,
                cached_tokens_by_tier={"device": 32}, content="Hi", reasoning="", tool_calls=[],
                tool_call_problems=[], logprobs=None, token_ids=[])
    return Final(**(base | kw))


def _events(chunks: list[bytes]) -> list[tuple[str, dict]]:
    out = []
    for raw in b"".join(chunks).decode().strip().split("\n\n"):
        name, data = raw.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        out.append((name[7:], json.loads(data[6:])))
    return out


def test_stream_events_come_in_anthropic_order_and_each_tool_use_is_whole():
    call = {"index": 0, "id": "functions.ls:0", "name": "ls", "arguments": '{"path":"a"}'}
    w = MessagesWriter("msg_1", "tiny", 40)
    chunks = [w.first()] + w.delta(Delta(text="H")) + w.delta(Delta(text="i")) + w.delta(Delta(tool_calls=(call,)))
    chunks += w.final(_final(tool_calls=[call]))
    ev = _events(chunks)
    assert [n for n, _ in ev] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                  "content_block_delta", "content_block_stop", "content_block_start",
                                  "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert all(d["type"] == n for n, d in ev)
    assert ev[0][1]["message"]["usage"]["input_tokens"] == 40 and ev[0][1]["message"]["content"] == []
    assert [d["index"] for n, d in ev if n.startswith("content_block")] == [0, 0, 0, 0, 1, 1, 1]
    assert ev[6][1]["content_block"] == {"type": "tool_use", "id": "functions.ls:0", "name": "ls", "input": {}}
    assert ev[7][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"path":"a"}'}
    assert ev[9][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert ev[9][1]["usage"] == {"input_tokens": 8, "cache_creation_input_tokens": 0,
                                 "cache_read_input_tokens": 32, "output_tokens": 9}


def test_message_body_stop_reasons():
    assert message("m", "tiny", _final(finish_reason="length"))["stop_reason"] == "max_tokens"
    assert message("m", "tiny", _final(finish_reason="stop"))["stop_reason"] == "end_turn"
    body = message("m", "tiny", _final(finish_reason="stop", stop_sequence="END"))
    assert body["stop_reason"] == "stop_sequence" and body["stop_sequence"] == "END"
    call = {"index": 0, "id": "functions.ls:0", "name": "ls", "arguments": '{"path":"a"}'}
    body = message("m", "tiny", _final(content="", reasoning="hmm", tool_calls=[call]))
    assert body["content"] == [{"type": "thinking", "thinking": "hmm", "signature": ""},
                               {"type": "tool_use", "id": "functions.ls:0", "name": "ls", "input": {"path": "a"}}]


def test_the_stop_filter_records_the_earliest_stop_string():
    from kvtier.serve.api.jobs import StopFilter

    f = StopFilter(["xyz", "b"])
    assert f.push("a") == "" and f.push("bxyz") == "a" and f.hit and f.matched == "b"


def test_an_error_ending_the_stream_is_an_anthropic_error_event():
    w = MessagesWriter("msg_1", "tiny", 4)
    ev = _events([w.first(), *w.delta(Delta(text="x")), *w.error(ApiError(500, "engine error: boom"))])
    assert ev[-1] == ("error", {"type": "error", "error": {"type": "api_error", "message": "engine error: boom"}})
    assert w.end() == b""


def test_a_claude_code_shaped_request_is_accepted():
    """System and text blocks with cache_control, a draft-07 ``$schema`` in input_schema,
    thinking (ignored), thinking blocks with signatures, tool results as text blocks."""
    bash = {"name": "Bash", "description": "run a command", "cache_control": {"type": "ephemeral"}, "input_schema": {
        "$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "additionalProperties": False,
        "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}}, "required": ["command"]}}
    body = {"model": "tiny", "max_tokens": 512, "stream": True, "temperature": 1,
            "metadata": {"user_id": "user_1_account_2_session_3"}, "thinking": {"type": "enabled", "budget_tokens": 1024},
            "system": [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
            "tools": [bash], "messages": [
                {"role": "user", "content": [{"type": "text", "text": "<reminder>x</reminder>"},
                                             {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "sig"},
                                                  {"type": "tool_use", "id": "toolu_01", "name": "Bash",
                                                   "input": {"command": "ls"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01",
                                              "content": [{"type": "text", "text": "a.py"}]}]}]}
    req, params, sid, _ = prepare(body, None)
    assert sid == "user_1_account_2_session_3" and params.tool_grammar is not None and req.stream
    assert "$schema" not in req.tools[0]["function"]["parameters"]
    assert req.messages[2] == {"role": "assistant", "content": "", "reasoning_content": "hmm", "tool_calls": [
        {"id": "toolu_01", "type": "function", "function": {"name": "Bash", "arguments": '{"command":"ls"}'}}]}
