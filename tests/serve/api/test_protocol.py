"""Request bodies parsed without a server: every refusal is an ApiError(400) whose ``param``
names the field as the client wrote it (never pydantic's internal union-member tags)."""

from __future__ import annotations

import pytest

from kvtier.serve.api.protocol import ApiError, ChatRequest, CompletionRequest, parse

ASK = [{"role": "user", "content": "hello"}]


def _refusal(model, **fields) -> ApiError:
    body = {"model": "tiny", **({"messages": ASK} if model is ChatRequest else {"prompt": "hi"}), **fields}
    with pytest.raises(ApiError) as info:
        parse(model, body)
    return info.value


@pytest.mark.parametrize("model, fields, param, says", [
    (ChatRequest, {"stop": 3}, "stop", "valid string"),
    (ChatRequest, {"stop": [1, 2]}, "stop[0]", "valid string"),
    (ChatRequest, {"stop": {"a": 1}}, "stop", "valid list"),
    (ChatRequest, {"tool_choice": 3}, "tool_choice", "'auto', 'none' or 'required'"),
    (ChatRequest, {"tool_choice": "sometimes"}, "tool_choice", "valid dictionary"),
    (CompletionRequest, {"prompt": [True, False]}, "prompt[0]", "valid integer"),
    (CompletionRequest, {"prompt": [1.0]}, "prompt[0]", "valid integer"),
    (CompletionRequest, {"prompt": [[1], [True]]}, "prompt[1][0]", "valid integer"),
    (CompletionRequest, {"prompt": None}, "prompt", "valid string"),
    (CompletionRequest, {"prompt": 5}, "prompt", "valid list"),
])
def test_union_fields_are_named_as_sent(model, fields, param, says):
    e = _refusal(model, **fields)
    assert e.status == 400 and e.param == param, (e.param, e.message)
    assert e.message.startswith(f"{param}: ") and says in e.message, e.message
    assert "[str]" not in e.message and "literal[" not in e.message, e.message


def test_other_fields_still_counted_after_a_union_field():
    e = _refusal(ChatRequest, stop=3, max_tokens="x")
    assert e.param == "max_tokens" and "1 more problem" in e.message, e.message
    e = _refusal(ChatRequest, stream_options={"include_usage": "x"})
    assert e.param == "stream_options.include_usage", e.param


@pytest.mark.parametrize("field", ["temperature", "top_p", "expected_tool_wait_s"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_numbers_are_refused_as_such(field, value):
    # JSON from Python clients may carry NaN/Infinity (and 1e999 decodes to inf): an infinite
    # tool wait would keep a session's blocks forever under the tool-aware policy
    e = _refusal(ChatRequest, **{field: value})
    assert e.status == 400 and e.param == field and "finite" in e.message, e.message


@pytest.mark.parametrize("model", [ChatRequest, CompletionRequest])
def test_stream_options_need_stream(model):
    # as OpenAI and vLLM answer: stream_options only mean something for a streamed response
    body = {"model": "tiny", "messages": ASK, "prompt": "hi", "stream_options": {"include_usage": True}}
    with pytest.raises(ApiError) as info:
        parse(model, body).include_usage()
    assert info.value.status == 400 and info.value.param == "stream_options", info.value.message
    assert "stream" in info.value.message
    assert parse(model, {**body, "stream": True}).include_usage() is True
    assert parse(model, {**body, "stream": True, "stream_options": None}).include_usage() is False
    assert parse(model, {**body, "stream_options": None}).include_usage() is False


@pytest.mark.parametrize("status, kind", [(400, "invalid_request_error"), (405, "invalid_request_error"),
                                          (413, "invalid_request_error"), (422, "invalid_request_error"),
                                          (404, "not_found_error"), (503, "service_unavailable_error"),
                                          (500, "server_error")])
def test_error_types_follow_the_status(status, kind):
    # a client error (GET on a POST route: 405) is not the server's fault
    assert ApiError(status, "x").body()["error"]["type"] == kind
