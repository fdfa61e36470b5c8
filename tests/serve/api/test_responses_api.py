"""``POST /v1/responses`` through the official ``openai`` client against ``kvtier serve tiny``:
text and function calls, streamed and not, tool loops continued with ``previous_response_id``
or resent whole in a session, each next turn reading the cache, and 400s in OpenAI's shape after
which the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.serve.api.tool_waits import settle, tool_waits
from tests.toolcall.sweep import check_arguments

LS = {"type": "function", "name": "ls", "description": "list a directory", "strict": True,
      "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 12}},
                     "required": ["path"], "additionalProperties": False}}
SEARCH = {"type": "function", "name": "search", "strict": False, "parameters": {
    "type": "object", "properties": {"query": {"type": "string", "maxLength": 12}, "limit": {"type": "integer"}},
    "required": ["query"]}}
SCHEMAS = {"ls": LS["parameters"], "search": SEARCH["parameters"]}
ASK = "list the repository"


def _items(resp) -> list[dict]:
    """Output items without their ids (fresh in every response) and what the SDK adds itself."""
    return [{k: v for k, v in o.model_dump(exclude_none=True).items() if k not in ("id", "parsed_arguments")}
            for o in resp.output]


def _stream(client, **kw):
    """(event types, the response of the last event: ``response.completed`` or, when
    ``max_output_tokens`` ran out, ``response.incomplete``, which the SDK's
    ``get_final_response`` does not take)."""
    with client.responses.stream(**kw) as s:
        events = list(s)
    return [e.type for e in events], events[-1].response


def test_text_streamed_equals_not_streamed(server):
    client = server.client()
    kw = dict(model="tiny", input=ASK, max_output_tokens=6, temperature=0, store=False)
    resp = client.responses.create(**kw)
    assert resp.object == "response" and resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens" and resp.output_text
    assert resp.usage.output_tokens == 6 and resp.usage.input_tokens > 0
    types, streamed = _stream(client, **kw)
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.incomplete"
    assert "response.output_text.delta" in types and streamed.output_text == resp.output_text
    assert _items(streamed)[0]["content"][0]["text"] == resp.output_text
    assert streamed.usage.input_tokens_details.cached_tokens >= 16  # the same prompt again


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "ls"}, "auto"])
def test_function_calls_are_schema_valid_and_stream_to_the_same_output(server, choice):
    client = server.client()
    kw = dict(model="tiny", input=ASK, tools=[SEARCH, LS], tool_choice=choice, max_output_tokens=48,
              temperature=0, store=False)
    resp = client.responses.create(**kw)
    calls = [o for o in resp.output if o.type == "function_call"]
    if choice != "auto":
        assert calls and all(o.type == "function_call" for o in resp.output) and resp.status == "completed"
    names = {"ls"} if isinstance(choice, dict) else {"ls", "search"}
    for c in calls:
        assert c.name in names and c.call_id.startswith(f"functions.{c.name}:") and c.id.startswith("fc_")
        assert check_arguments(c.arguments, SCHEMAS[c.name]) is None, c
    types, streamed = _stream(client, **kw)
    assert _items(streamed) == _items(resp)
    assert types.count("response.function_call_arguments.done") == len(calls)
    assert types.count("response.output_item.added") == types.count("response.output_item.done") == len(resp.output)


def test_previous_response_id_continues_the_tool_loop_in_its_session(server):
    client = server.client()
    before, expired0 = tool_waits(server)
    first = client.responses.create(model="tiny", input=ASK, tools=[LS], tool_choice="required",
                                    max_output_tokens=48, temperature=0)
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and first.store is True
    assert settle(server, before + 1, expired0)  # the chain's session waits on the tool
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "a.py b.py"} for c in calls]
    types, second = _stream(client, model="tiny", previous_response_id=first.id, input=outputs, tools=[LS],
                            tool_choice="none", max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id and all(o.type == "message" for o in second.output)
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= (first.usage.input_tokens // 16) * 16 > 0
    assert settle(server, before, expired0)
    # tools are not kept with a response (as in OpenAI's API): the client declares them again
    third = client.responses.create(model="tiny", previous_response_id=second.id, input="thanks", tools=[LS],
                                    tool_choice="none", max_output_tokens=4, temperature=0)
    assert third.usage.input_tokens_details.cached_tokens >= (second.usage.input_tokens // 16) * 16
    # an unanswered call in the kept conversation is a 400
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", previous_response_id=first.id, input="ignore the tool",
                                max_output_tokens=4)
    assert "no function_call_output" in e.value.body["message"]


def test_a_conversation_resent_whole_in_a_session_reads_the_cache(server):
    client = server.client(default_headers={"X-Session-Id": "responses-whole"})
    items = [{"role": "user", "content": ASK}]
    first = client.responses.create(model="tiny", input=items, tools=[LS], tool_choice="required",
                                    max_output_tokens=48, temperature=0, store=False)
    items += [o.model_dump(exclude_none=True) for o in first.output]
    items += [{"type": "function_call_output", "call_id": o.call_id, "output": "a.py"}
              for o in first.output if o.type == "function_call"]
    second = client.responses.create(model="tiny", input=items, tools=[LS], max_output_tokens=8, temperature=0,
                                     store=False)
    assert second.usage.input_tokens_details.cached_tokens >= (first.usage.input_tokens // 16) * 16 > 0


BAD = [
    dict(input=[{"type": "function_call_output", "call_id": "call_1", "output": "x"}]),
    dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]),
    dict(input=[{"type": "file_search_call", "id": "fs_1"}]),
    dict(input=ASK, tools=[{"type": "web_search"}]),
    dict(input=ASK, extra_body={"frequency_penalty": 0.5}),
    dict(input=ASK, previous_response_id="resp_unknown"),
    dict(input=ASK, tools=[LS], tool_choice={"type": "function", "name": "rm"}),
]


@pytest.mark.parametrize("bad", BAD)
def test_bad_input_is_a_400_in_openai_shape_and_the_server_keeps_serving(server, bad):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", max_output_tokens=4, **bad)
    body = e.value.body
    assert e.value.status_code == 400 and body["type"] == "invalid_request_error" and body["message"] and body["param"]
    ok = client.responses.create(model="tiny", input=ASK, max_output_tokens=2, store=False)
    assert ok.usage.output_tokens >= 1


def test_raw_error_shape(server):
    r = httpx.post(f"{server.url}/v1/responses", json={"model": "tiny"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
