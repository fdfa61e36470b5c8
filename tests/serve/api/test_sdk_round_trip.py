"""A tool loop as agents write it with today's official SDKs, against ``kvtier serve tiny``: the
first turn's output is sent back as the SDK gave it, and the second turn must be accepted and
read the first turn's prompt from the cache.

The output goes back four ways: ``model_dump()`` dicts (every field of the SDK's type, ``None``
where unset: ``toolset_name``, ``async_``, ``caller``...), ``model_dump(exclude_none=True)``
dicts, the SDK objects themselves (the SDK serialises them), and JSON saved to disk and read
back (by alias: ``async``); each with both turns streamed or not. For the Messages API the
sampling settings go in the body (``extra_body``): the current ``anthropic`` SDK has no
``temperature`` / ``top_p`` arguments.

The field-level checks (every field of the SDK's types accepted) are in
``test_sdk_fields.py``; they run without a server.
"""

from __future__ import annotations

import json

import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

PAGE = 16  # kvtier serve tiny's page size: cached prompt tokens come in whole pages
WAYS = ["model_dump", "exclude_none", "objects", "json"]

ASK = [{"role": "user", "content": "list the repository"}]
SCHEMA = {"type": "object", "properties": {"path": {"type": "string", "maxLength": 12}},
          "required": ["path"], "additionalProperties": False}


def _back(objs: list, way: str, whole, tmp_path, key: str) -> list:
    """``objs`` (SDK models from ``whole``) as a client sends them back."""
    if way == "model_dump":
        return [o.model_dump() for o in objs]
    if way == "exclude_none":
        return [o.model_dump(exclude_none=True) for o in objs]
    if way == "objects":
        return list(objs)
    path = tmp_path / "turn.json"  # saved between runs of an agent, read back later
    path.write_text(whole.to_json())
    return json.loads(path.read_text())[key]


def _cached_at_least(first_prompt: int) -> int:
    """The cached tokens a second turn must report: the first turn's whole prompt pages."""
    return (first_prompt // PAGE) * PAGE


# ---- Anthropic Messages ----------------------------------------------------------------------

LS = {"name": "ls", "description": "list a directory", "input_schema": SCHEMA}


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)


def _message(client, stream: bool, **kw):
    if not stream:
        return client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        return s.get_final_message()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("way", WAYS)
def test_messages_tool_loop_sent_back_as_the_sdk_gives_it(claude, tmp_path, way, stream):
    kw = dict(model="tiny", max_tokens=48, tools=[LS], extra_body={"temperature": 0, "top_p": 1})
    first = _message(claude, stream, messages=ASK, tool_choice={"type": "any"}, **kw)
    uses = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and uses
    history = ASK + [
        {"role": "assistant", "content": _back(first.content, way, first, tmp_path, "content")},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id, "content": "a.py b.py"}
                                     for b in uses]}]
    second = _message(claude, stream, messages=history, tool_choice={"type": "none"}, **kw)
    assert second.content and all(b.type == "text" for b in second.content)
    first_prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens > first_prompt
    assert second.usage.cache_read_input_tokens >= _cached_at_least(first_prompt) > 0


@pytest.mark.parametrize("way", ["model_dump", "json"])
def test_messages_whole_assistant_message_sent_back(claude, tmp_path, way):
    """``messages.append(message.model_dump())``: the id, model, stop reason and usage ride along
    and are ignored."""
    kw = dict(model="tiny", max_tokens=48, tools=[LS], extra_body={"temperature": 0})
    first = claude.messages.create(messages=ASK, tool_choice={"type": "any"}, **kw)
    if way == "model_dump":
        turn = first.model_dump()
    else:
        (tmp_path / "m.json").write_text(first.to_json())
        turn = json.loads((tmp_path / "m.json").read_text())
    assert "usage" in turn and "id" in turn
    results = [{"type": "tool_result", "tool_use_id": b.id, "content": "a.py"}
               for b in first.content if b.type == "tool_use"]
    second = claude.messages.create(messages=ASK + [turn, {"role": "user", "content": results}],
                                    tool_choice={"type": "none"}, **kw)
    first_prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= _cached_at_least(first_prompt) > 0


def test_messages_temperature_and_top_p_in_the_body_are_honoured(claude):
    """The SDK's ``messages.create`` has no ``temperature``: clients put it in the body. Greedy
    in the body twice gives the same text; a bad value there is a 400 naming it."""
    kw = dict(model="tiny", max_tokens=8, messages=ASK)
    a = claude.messages.create(extra_body={"temperature": 0.0, "top_p": 0.5}, **kw)
    b = claude.messages.create(extra_body={"temperature": 0.0, "top_p": 0.5}, **kw)
    assert [x.text for x in a.content] == [x.text for x in b.content] and a.usage.output_tokens >= 1
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(extra_body={"temperature": 1.5}, **kw)
    assert e.value.body["error"]["message"].startswith("temperature")


# ---- OpenAI Responses ------------------------------------------------------------------------

FN = {"type": "function", "name": "ls", "description": "list a directory", "parameters": SCHEMA, "strict": True}


def _response(client, stream: bool, **kw):
    if not stream:
        return client.responses.create(**kw)
    with client.responses.stream(**kw) as s:
        events = list(s)
    return events[-1].response  # response.completed (or .incomplete)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("way", [*WAYS, "by_alias"])
def test_responses_tool_loop_sent_back_as_the_sdk_gives_it(server, tmp_path, way, stream):
    client = server.client()
    kw = dict(model="tiny", tools=[FN], max_output_tokens=48, temperature=0, store=False)
    first = _response(client, stream, input=ASK, tool_choice="required", **kw)
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and first.status == "completed"
    if way == "by_alias":  # what a JSON encoder of the models writes: "async", not "async_"
        output = [o.model_dump(by_alias=True) for o in first.output]
        assert all("async" in o and "async_" not in o for o in output if o["type"] == "function_call")
    else:
        output = _back(first.output, way, first, tmp_path, "output")
    items = ASK + output + [{"type": "function_call_output", "call_id": c.call_id, "output": "a.py b.py"}
                            for c in calls]
    second = _response(client, stream, input=items, tool_choice="none", **kw)
    assert second.output and all(o.type == "message" for o in second.output)
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= _cached_at_least(first.usage.input_tokens) > 0


# ---- OpenAI chat completions -----------------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "ls", "description": "list a directory", "parameters": SCHEMA}}


def _chat(client, stream: bool, **kw):
    if not stream:
        return client.chat.completions.create(**kw)
    try:
        with client.chat.completions.stream(**kw) as s:
            return s.get_final_completion()
    except openai.LengthFinishReasonError as e:  # the random model's text runs to max_tokens
        assert e.completion.usage.completion_tokens == kw["max_tokens"]
        return e.completion


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("way", WAYS)
def test_chat_tool_loop_sent_back_as_the_sdk_gives_it(server, tmp_path, way, stream):
    client = server.client()
    kw = dict(model="tiny", tools=[TOOL], max_tokens=48, temperature=0)
    if stream:
        kw["stream_options"] = {"include_usage": True}
    first = _chat(client, stream, messages=ASK, tool_choice="required", **kw)
    msg = first.choices[0].message
    assert msg.tool_calls and first.choices[0].finish_reason == "tool_calls"
    [turn] = _back([msg], way, first, tmp_path, "choices")
    if way == "json":
        turn = turn["message"]
    messages = ASK + [turn] + [{"role": "tool", "tool_call_id": c.id, "content": "a.py b.py"}
                               for c in msg.tool_calls]
    second = _chat(client, stream, messages=messages, tool_choice="none", **kw)
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls
    # text the budget cut is reported as such, as it is without tools
    assert second.choices[0].finish_reason == "length"
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= _cached_at_least(first.usage.prompt_tokens) > 0
