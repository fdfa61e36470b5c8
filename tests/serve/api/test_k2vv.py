"""Every K2-Vendor-Verifier request of ``samples.jsonl`` through ``kvtier serve`` with the
``openai`` client (streamed and not): every returned tool call is schema-valid (``jsonschema``)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.k2vv import MAX_TOKENS
from tests.toolcall.sweep import K2VV_DIR, check_arguments


def _samples() -> list[dict]:
    path = K2VV_DIR / "samples.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} not present")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _calls(client, i: int, r: dict, stream: bool) -> tuple[str | None, list[dict], dict]:
    """(finish_reason, [{"name", "arguments"}], schemas by tool name) of sample ``i``."""
    msgs = [dict(m, role="system") if m["role"] == "_input" else m for m in r["messages"]]
    schemas = {t["function"]["name"]: t["function"].get("parameters", {}) for t in r["tools"]}
    kw = dict(model="tiny", messages=msgs, tools=r["tools"], tool_choice="required", max_tokens=MAX_TOKENS,
              temperature=1.0, seed=i)
    if not stream:
        resp = client.chat.completions.create(**kw)
        return resp.choices[0].finish_reason, [{"name": c.function.name, "arguments": c.function.arguments}
                                               for c in resp.choices[0].message.tool_calls or []], schemas
    found: dict[int, dict] = {}
    finish = None
    for c in client.chat.completions.create(stream=True, **kw):
        for ch in c.choices:
            finish = ch.finish_reason or finish
            for tc in ch.delta.tool_calls or []:
                found[tc.index] = {"name": tc.function.name, "arguments": tc.function.arguments}
    return finish, [found[k] for k in sorted(found)], schemas


# ~35 s each on 2 busy cores; the streamed variant is slow-marked (streamed calls are checked against the
# non-streamed ones in test_chat.py)
@pytest.mark.parametrize("stream", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_k2vv_samples_give_schema_valid_tool_calls(server, stream):
    from concurrent.futures import ThreadPoolExecutor

    client = server.client()
    samples = _samples()
    with ThreadPoolExecutor(len(samples)) as ex:  # sent together: the engine batches them
        results = list(ex.map(lambda ir: _calls(client, *ir, stream), enumerate(samples)))
    calls = valid = 0
    for i, (finish, got, schemas) in enumerate(results):
        assert finish == "tool_calls" and got, (i, finish)
        for call in got:
            calls += 1
            reason = check_arguments(call["arguments"], schemas[call["name"]])
            assert reason is None, (i, call, reason)
            valid += 1
    assert calls >= len(samples) and valid == calls
