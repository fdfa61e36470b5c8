"""K2-Vendor-Verifier requests through ``/v1/messages`` (``anthropic`` client) and
``/v1/responses`` (``openai`` client): every tool call is schema-valid (``jsonschema``).

Each request is rewritten in the API's own terms (system turns after the first message become
user text for Messages; tool calls become ``tool_use`` blocks / ``function_call`` items, tool
results ``tool_result`` blocks / ``function_call_output`` items) with ``tool_choice`` any /
required. By default the 3 requests of ``samples.jsonl`` go through each API (streamed and not,
alternately); the whole set (samples and medium, 102 requests, both ways) is slow-marked."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.k2vv import MAX_TOKENS
from tests.toolcall.sweep import K2VV_DIR, Case, check_arguments, k2vv_cases

anthropic = pytest.importorskip("anthropic")


def to_messages(case: Case) -> dict:
    """``case`` as a Messages request body (without model / max_tokens)."""
    system, turns = [], []  # turns: [role, blocks]
    for m in case.messages:
        role, blocks = m["role"], []
        if role == "system" and not turns:
            system.append(m["content"])
            continue
        if role in ("system", "user"):
            role, blocks = "user", [{"type": "text", "text": m["content"]}]
        elif role == "tool":
            role, blocks = "user", [{"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}]
        else:
            blocks = [{"type": "text", "text": m["content"]}] if m.get("content") else []
            blocks += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                        "input": json.loads(c["function"]["arguments"])} for c in m.get("tool_calls") or []]
        if not blocks:
            continue
        if turns and turns[-1][0] == role:
            turns[-1][1].extend(blocks)
        else:
            turns.append([role, blocks])
    tools = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
              "input_schema": t["function"].get("parameters") or {"type": "object"}} for t in case.tools]
    return {"system": "\n".join(system), "messages": [{"role": r, "content": b} for r, b in turns],
            "tools": tools, "tool_choice": {"type": "any"}}


def to_responses(case: Case) -> dict:
    """``case`` as a Responses request body (without model / max_output_tokens)."""
    items = []
    for m in case.messages:
        if m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]})
            continue
        if m.get("content"):
            items.append({"type": "message", "role": m["role"], "content": m["content"]})
        items += [{"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
                   "arguments": c["function"]["arguments"]} for c in m.get("tool_calls") or []]
    tools = [{"type": "function", "name": t["function"]["name"], "description": t["function"].get("description"),
              "parameters": t["function"].get("parameters") or {"type": "object"}, "strict": False}
             for t in case.tools]
    return {"input": items, "tools": tools, "tool_choice": "required"}


def _via_messages(server, case: Case, stream: bool) -> tuple[str, list[dict]]:
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=600)
    kw = dict(model="tiny", max_tokens=MAX_TOKENS, extra_body={"temperature": 1.0}, **to_messages(case))
    if stream:
        with client.messages.stream(**kw) as s:
            msg = s.get_final_message()
    else:
        msg = client.messages.create(**kw)
    return msg.stop_reason, [{"name": b.name, "arguments": json.dumps(b.input)} for b in msg.content
                             if b.type == "tool_use"]


def _via_responses(server, case: Case, stream: bool) -> tuple[str, list[dict]]:
    client = server.client().with_options(timeout=600)
    kw = dict(model="tiny", max_output_tokens=MAX_TOKENS, temperature=1.0, store=False, **to_responses(case))
    if stream:
        with client.responses.stream(**kw) as s:
            resp = s.get_final_response()
    else:
        resp = client.responses.create(**kw)
    return resp.status, [{"name": o.name, "arguments": o.arguments} for o in resp.output if o.type == "function_call"]


APIS = {"messages": (_via_messages, "tool_use"), "responses": (_via_responses, "completed")}


def _sweep(server, api: str, cases: list[Case], streams: list[bool]) -> None:
    call, done = APIS[api]
    with ThreadPoolExecutor(min(len(cases), 16)) as ex:  # sent together: the engine batches them
        results = list(ex.map(lambda cs: call(server, *cs), zip(cases, streams)))
    calls = 0
    for case, stream, (end, got) in zip(cases, streams, results):
        assert end == done and got, (case.name, stream, end)
        for c in got:
            calls += 1
            reason = check_arguments(c["arguments"], case.schemas[c["name"]])
            assert reason is None, (case.name, stream, c, reason)
    assert calls >= len(cases)


def _samples() -> list[Case]:
    if not (K2VV_DIR / "samples.jsonl").is_file():
        pytest.skip(f"{K2VV_DIR} not present")
    return [c for c in k2vv_cases() if c.name.startswith("samples.jsonl")]


@pytest.mark.parametrize("api", sorted(APIS))
def test_k2vv_samples_give_schema_valid_calls(server, api):
    cases = _samples()
    _sweep(server, api, cases, [i % 2 == 1 for i in range(len(cases))])


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", sorted(APIS))
def test_every_k2vv_request_gives_schema_valid_calls(server, api, stream):
    _samples()
    cases = k2vv_cases()
    _sweep(server, api, cases, [stream] * len(cases))
