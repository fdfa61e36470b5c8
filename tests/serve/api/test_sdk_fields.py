"""Every field the installed official SDKs put on what the Messages and Responses APIs return
(content blocks, output items, parts, whole messages) and on what they send (request parameters,
message and item params) is a field kvtier's request models know: a new SDK field fails here, not
as a client's 400. Then the translation on real SDK objects with every field set, and what is
still refused (wrong block types, a ``tool_result`` without its ``tool_use``, bad types).

No server: the models and the pure translations (``to_chat``) only. CI installs the current
SDKs (``scripts/test.sh``); ``WRITTEN_AGAINST`` records the versions these sets were checked with.
"""

from __future__ import annotations

import json
import typing

import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

import anthropic.types as at  # noqa: E402
import openai.types.responses as rt  # noqa: E402
from anthropic.types import message_create_params  # noqa: E402
from openai.types.responses import response_create_params, response_input_item_param  # noqa: E402
from openai.types.responses import response_reasoning_item as reasoning  # noqa: E402

from kvtier.serve.api import messages, responses  # noqa: E402
from kvtier.serve.api.protocol import ApiError  # noqa: E402

# The SDK releases the field sets below were last checked against; a new major release is a
# failure to look at (re-run test_sdk_round_trip.py, then update these).
WRITTEN_AGAINST = {"anthropic": "2.17.0", "openai": "3.63.0"}


def _sdk_names(t) -> set[str]:
    """Field names of an SDK type: a pydantic model's fields (and their aliases, the names on
    the wire), a TypedDict's keys, or those of every member of a union."""
    if typing.get_origin(t) is typing.Union:
        return set().union(*(_sdk_names(m) for m in typing.get_args(t)))
    if hasattr(t, "model_fields"):
        return {n for name, f in t.model_fields.items() for n in (name, f.alias) if n}
    return set(t.__required_keys__) | set(t.__optional_keys__)


def _ours(model) -> set[str]:
    return {n for name, f in model.model_fields.items() for n in (name, f.alias) if n}


def test_sdk_major_versions_are_the_ones_checked():
    for mod in (anthropic, openai):
        want = WRITTEN_AGAINST[mod.__name__]
        assert mod.__version__.split(".")[0] == want.split(".")[0], (
            f"{mod.__name__} {mod.__version__} installed; the field sets were checked with {want}: "
            "run tests/serve/api/test_sdk_round_trip.py and update WRITTEN_AGAINST")


ANTHROPIC = [
    (at.TextBlock, messages.TextBlock), (at.ParsedTextBlock, messages.TextBlock),
    (at.TextBlockParam, messages.TextBlock),
    (at.ToolUseBlock, messages.ToolUseBlock), (at.ToolUseBlockParam, messages.ToolUseBlock),
    (at.ToolResultBlockParam, messages.ToolResultBlock),
    (at.ThinkingBlock, messages.ThinkingBlock), (at.ThinkingBlockParam, messages.ThinkingBlock),
    (at.RedactedThinkingBlock, messages.RedactedThinkingBlock),
    (at.RedactedThinkingBlockParam, messages.RedactedThinkingBlock),
    (at.Message, messages.ReturnedMessage), (at.ParsedMessage, messages.ReturnedMessage),
    (at.MessageParam, messages.Message),
    (at.ToolParam, messages.Tool), (at.MetadataParam, messages.Metadata),
    (at.ToolChoiceAutoParam, messages.ToolChoice), (at.ToolChoiceAnyParam, messages.ToolChoice),
    (at.ToolChoiceToolParam, messages.ToolChoice), (at.ToolChoiceNoneParam, messages.ToolChoice),
]
RESPONSES = [
    (rt.ResponseFunctionToolCall, responses.FunctionCallItem),
    (rt.ParsedResponseFunctionToolCall, responses.FunctionCallItem),
    (rt.ResponseFunctionToolCallParam, responses.FunctionCallItem),
    (response_input_item_param.FunctionCallOutput, responses.FunctionCallOutputItem),
    (rt.ResponseFunctionToolCallOutputItem, responses.FunctionCallOutputItem),
    (rt.ResponseOutputMessage, responses.MessageItem), (rt.ParsedResponseOutputMessage, responses.MessageItem),
    (rt.ResponseOutputMessageParam, responses.MessageItem), (rt.EasyInputMessageParam, responses.MessageItem),
    (response_input_item_param.Message, responses.MessageItem),
    (rt.ResponseOutputText, responses._Part), (rt.ParsedResponseOutputText, responses._Part),
    (rt.ResponseOutputTextParam, responses._Part), (rt.ResponseInputTextParam, responses._Part),
    (rt.ResponseOutputRefusal, responses._Part), (rt.ResponseOutputRefusalParam, responses._Part),
    (reasoning.Summary, responses._Part), (reasoning.Content, responses._Part),
    (rt.ResponseReasoningItem, responses.ReasoningItem), (rt.ResponseReasoningItemParam, responses.ReasoningItem),
]


@pytest.mark.parametrize("sdk, ours", ANTHROPIC + RESPONSES, ids=lambda t: getattr(t, "__name__", "Union"))
def test_every_sdk_field_is_known(sdk, ours):
    missing = _sdk_names(sdk) - _ours(ours)
    assert not missing, f"{sdk.__module__}.{sdk.__name__} has fields {sorted(missing)} that {ours.__name__} rejects"


def test_every_request_parameter_is_known():
    """Each top-level parameter of the SDKs' create calls is a field of the request model
    (accepted, ignored or refused with its own message), never an 'Extra inputs' 400."""
    sent = _sdk_names(message_create_params.MessageCreateParamsBase) | {"stream"}
    assert not sent - _ours(messages.MessagesRequest), sorted(sent - _ours(messages.MessagesRequest))
    sent = _sdk_names(response_create_params.ResponseCreateParamsBase) | {"stream"}
    assert not sent - _ours(responses.ResponsesRequest), sorted(sent - _ours(responses.ResponsesRequest))
    function_tool = _sdk_names(rt.FunctionToolParam)
    assert function_tool <= responses.TOOL_FIELDS, sorted(function_tool - responses.TOOL_FIELDS)


# ---- the translation, on SDK objects with every field set ----------------------------------

LS = {"name": "ls", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}


def _claude_turn(*, toolset_name="files", exclude_none=False) -> tuple[dict, list]:
    """A returned message with a tool_use block whose optional fields are all set, as a
    ``model_dump()``, and the history sending it back."""
    block = at.ToolUseBlock(type="tool_use", id="functions.ls:0", name="ls", input={"path": "."},
                            toolset_name=toolset_name, caller=at.DirectCaller(type="direct"))
    text = at.TextBlock(type="text", text="listing", citations=None)
    msg = at.Message(id="msg_1", type="message", role="assistant", model="tiny", content=[text, block],
                     stop_reason="tool_use", stop_sequence=None,
                     usage=at.Usage(input_tokens=3, output_tokens=5, cache_read_input_tokens=16))
    dumped = msg.model_dump(exclude_none=exclude_none)
    result = {"type": "tool_result", "tool_use_id": "functions.ls:0", "content": "a.py", "toolset_name": "files"}
    return dumped, [{"role": "user", "content": "ls"}, dumped, {"role": "user", "content": [result]}]


def _to_chat(history: list, **kw) -> dict:
    return messages.to_chat(messages.MessagesRequest(model="tiny", max_tokens=8, messages=history,
                                                     tools=[LS], **kw))


@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize("exclude_none", [False, True])
def test_messages_blocks_with_every_field_translate_as_without(whole, exclude_none):
    dumped, history = _claude_turn(exclude_none=exclude_none)
    if not whole:
        history[1] = {"role": "assistant", "content": dumped["content"]}
    got = _to_chat(history)["messages"]
    plain = [{"role": "user", "content": "ls"},
             {"role": "assistant", "content": [{"type": "text", "text": "listing"},
                                               {"type": "tool_use", "id": "functions.ls:0", "name": "ls",
                                                "input": {"path": "."}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "functions.ls:0",
                                           "content": "a.py"}]}]
    assert got == _to_chat(plain)["messages"]
    assert got[1]["tool_calls"][0]["function"] == {"name": "ls", "arguments": json.dumps({"path": "."},
                                                                                           separators=(",", ":"))}


REFUSED_MESSAGES = [
    # a bad type in a field the SDK added
    (lambda h: h[1]["content"][1].__setitem__("toolset_name", 5), "messages[1].content[1].toolset_name"),
    # a field no SDK has
    (lambda h: h[1]["content"][1].__setitem__("toolset", "x"), "messages[1].content[1].toolset"),
    # the returned message's fields on a user turn
    (lambda h: h[2].__setitem__("usage", {}), "messages[2].usage"),
    (lambda h: h[1].__setitem__("type", "note"), "messages[1].type"),
    # a tool_result whose tool_use is gone, a tool_use in a user message
    (lambda h: h[1].__setitem__("content", [h[1]["content"][0]]), "messages[2].content[0].tool_use_id"),
    (lambda h: h[0].__setitem__("content", [h[1]["content"][1]]), "messages[0].content[0].type"),
]


@pytest.mark.parametrize("spoil, param", REFUSED_MESSAGES)
def test_messages_still_refuses_what_the_reference_refuses(spoil, param):
    _, history = _claude_turn()
    spoil(history)
    with pytest.raises(ApiError) as e:
        _to_chat(history)
    assert e.value.status == 400 and e.value.param == param, e.value.message


FN = {"type": "function", "name": "ls", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}


def _responses_items(**dump) -> list:
    call = rt.ResponseFunctionToolCall(type="function_call", id="fc_1", call_id="functions.ls:0", name="ls",
                                       arguments='{"path":"."}', status="completed", namespace="files",
                                       caller={"type": "direct"}, **{"async": False})
    text = rt.ResponseOutputText(type="output_text", text="listing", annotations=[], logprobs=[])
    msg = rt.ResponseOutputMessage(type="message", id="msg_1", role="assistant", status="completed",
                                   content=[text], phase="commentary")
    out = {"type": "function_call_output", "call_id": "functions.ls:0", "output": "a.py"}
    return [{"role": "user", "content": "ls"}, msg.model_dump(**dump), call.model_dump(**dump), out]


def _responses_chat(items: list) -> list:
    req = responses.ResponsesRequest(model="tiny", input=items, tools=[FN])
    return responses.to_chat(req, [])[0]["messages"]


@pytest.mark.parametrize("dump", [{}, {"exclude_none": True}, {"by_alias": True}, {"mode": "json", "by_alias": True}])
def test_responses_items_with_every_field_translate_as_without(dump):
    items = _responses_items(**dump)
    key = "async" if dump.get("by_alias") else "async_"
    assert key in items[2]
    bare = [items[0], {"role": "assistant", "content": "listing"},
            {"type": "function_call", "call_id": "functions.ls:0", "name": "ls", "arguments": '{"path":"."}'},
            items[3]]
    assert _responses_chat(items) == _responses_chat(bare)


REFUSED_ITEMS = [
    (lambda i: i[2].__setitem__("async_", "yes"), "input[2].async_"),
    (lambda i: i[2].update({"async": True, "async_": True}), "input[2].async_"),  # one spelling, not both
    (lambda i: i[2].__setitem__("caller", "me"), "input[2].caller"),
    (lambda i: i[2].__setitem__("handler", "x"), "input[2].handler"),
    (lambda i: i.pop(2), "input[2].call_id"),  # the output without its call
    (lambda i: i[1].__setitem__("type", "web_search_call"), "input[1].type"),
]


@pytest.mark.parametrize("spoil, param", REFUSED_ITEMS)
def test_responses_still_refuses_what_the_reference_refuses(spoil, param):
    items = _responses_items()
    spoil(items)
    with pytest.raises(ApiError) as e:
        _responses_chat(items)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_messages_system_role_messages_are_system_turns_where_they_stand():
    """The SDK's ``MessageParam`` includes ``SystemMessageParam`` (role ``system``, text only)."""
    _, history = _claude_turn()
    note = {"role": "system", "content": [{"type": "text", "text": "be brief"}]}
    got = _to_chat([history[0], note] + history[1:] + [{"role": "system", "content": "now answer"}])["messages"]
    assert [t["role"] for t in got] == ["user", "system", "assistant", "tool", "system"]
    assert got[1]["content"] == [{"type": "text", "text": "be brief"}]
    with pytest.raises(ApiError) as e:  # not between a tool_use and its tool_result
        _to_chat(history[:2] + [note] + history[2:])
    assert e.value.param == "messages[1]"
    with pytest.raises(ApiError) as e:  # text only
        _to_chat([history[0], {"role": "system", "content": [history[1]["content"][1]]}])
    assert e.value.param == "messages[1].content[0].type"
