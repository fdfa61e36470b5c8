"""What a K3 model writes reaches the client as K3's API shapes it, through the official SDKs: the
think channel as ``reasoning_content`` (chat), thinking blocks (Messages) and reasoning items
(Responses); the tools channel as tool calls, tool_use blocks and function_call items whose
arguments validate against the tool's schema; streamed and not, the same turn; a multi-turn tool
loop sends the reasoning back; ``response_format`` gives a JSON answer of its schema. The model
is ``tiny-k3`` (random weights) served in-process from a checkpoint with K3's tokenizer files."""

from __future__ import annotations

import json

import pytest

from tests.serve.api.conftest import in_process_k3
from tests.toolcall.sweep import check_arguments

MODEL = "k3"
SCHEMA = {"type": "object", "required": ["path", "depth"],
          "properties": {"path": {"type": "string", "maxLength": 16},
                         "depth": {"type": "integer", "minimum": 0, "maximum": 3}}}
LS = {"type": "function", "function": {"name": "ls", "description": "List a directory", "parameters": SCHEMA}}
ASK = [{"role": "user", "content": "list the repository"}]
BUDGET = 120  # tokens: the shortest turn with one call is about 60 (thinking on)


@pytest.fixture(scope="module")
def k3(tok_dir, tmp_path_factory):
    """(openai client, anthropic client)."""
    with in_process_k3(tok_dir, tmp_path_factory, "k3out", num_device_pages=512, max_num_seqs=4) as (_, oa, an, _):
        yield oa, an


def _chat(oa, messages, stream=False, **kw):
    return oa.chat.completions.create(model=MODEL, messages=messages, tools=[LS], tool_choice="required",
                                      max_tokens=BUDGET, temperature=0, stream=stream, **kw)


def test_chat_reasoning_and_calls_streamed_and_not(k3):
    oa, _ = k3
    whole = _chat(oa, ASK)
    msg = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and msg.tool_calls
    assert isinstance(msg.model_extra.get("reasoning_content"), str)
    for call in msg.tool_calls:
        assert call.function.name == "ls" and check_arguments(call.function.arguments, SCHEMA) is None
    reasoning, content, calls = "", "", []
    for chunk in _chat(oa, ASK, stream=True):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
            calls += [(c.function.name, c.function.arguments) for c in choice.delta.tool_calls or []]
    assert reasoning == msg.model_extra["reasoning_content"] and content == (msg.content or "")
    assert calls == [(c.function.name, c.function.arguments) for c in msg.tool_calls]


def test_chat_tool_loop_sends_reasoning_back(k3):
    oa, _ = k3
    messages = list(ASK)
    for turn in range(3):
        out = _chat(oa, messages, extra_body={"thinking": {"type": "enabled" if turn % 2 == 0 else "disabled"}})
        msg = out.choices[0].message
        assert msg.tool_calls and all(check_arguments(c.function.arguments, SCHEMA) is None for c in msg.tool_calls)
        messages.append(msg.model_dump(exclude_none=True))
        messages += [{"role": "tool", "tool_call_id": c.id, "content": f"{turn}: a.py b.py"} for c in msg.tool_calls]
    assert out.usage.prompt_tokens > 0


def test_chat_without_thinking_has_no_reasoning(k3):
    oa, _ = k3
    out = _chat(oa, ASK, extra_body={"thinking": {"type": "disabled"}})
    msg = out.choices[0].message
    assert not (msg.model_extra or {}).get("reasoning_content") and msg.tool_calls


def test_response_format_answer_validates(k3):
    oa, _ = k3
    schema = {"type": "object", "properties": {"files": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                         "maxItems": 3}, "count": {"type": "integer"}},
              "required": ["files", "count"]}
    for thinking in ("enabled", "disabled"):
        out = oa.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=BUDGET, temperature=1.0, seed=4,
            response_format={"type": "json_schema", "json_schema": {"name": "listing", "schema": schema}},
            extra_body={"thinking": {"type": thinking}})
        assert out.choices[0].finish_reason == "stop"
        assert check_arguments(out.choices[0].message.content, schema) is None, out.choices[0].message.content


def test_messages_thinking_and_tool_use_blocks(k3):
    _, an = k3
    tools = [{"name": "ls", "description": "List a directory", "input_schema": SCHEMA}]
    kw = dict(model=MODEL, max_tokens=BUDGET, extra_body={"temperature": 0}, tools=tools, tool_choice={"type": "any"},
              messages=ASK, thinking={"type": "enabled", "budget_tokens": 1024})  # the newest SDKs dropped temperature
    whole = an.messages.create(**kw)
    kinds = [b.type for b in whole.content]
    assert kinds[0] == "thinking" and "tool_use" in kinds and whole.stop_reason == "tool_use"
    uses = [b for b in whole.content if b.type == "tool_use"]
    assert all(check_arguments(json.dumps(b.input), SCHEMA) is None for b in uses)
    with an.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None), getattr(b, "input", None)) for b in final.content] == \
        [(b.type, getattr(b, "thinking", None), getattr(b, "input", None)) for b in whole.content]
    follow = an.messages.create(**{**kw, "messages": ASK + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in whole.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "a.py"} for u in uses]}]})
    assert any(b.type == "tool_use" for b in follow.content)


def test_responses_reasoning_and_function_call_items(k3):
    oa, _ = k3
    tools = [{"type": "function", "name": "ls", "description": "List a directory", "parameters": SCHEMA}]
    kw = dict(model=MODEL, input="list the repository", tools=tools, tool_choice="required",
              max_output_tokens=BUDGET, temperature=0)
    whole = oa.responses.create(**kw)
    kinds = [item.type for item in whole.output]
    assert kinds[0] == "reasoning" and "function_call" in kinds
    calls = [(i.name, i.arguments) for i in whole.output if i.type == "function_call"]
    assert all(check_arguments(args, SCHEMA) is None for _, args in calls)
    events = list(oa.responses.create(**kw, stream=True))
    done = [e for e in events if e.type == "response.completed"][0].response
    assert [(i.name, i.arguments) for i in done.output if i.type == "function_call"] == calls
    assert any(e.type == "response.reasoning_text.delta" for e in events)
