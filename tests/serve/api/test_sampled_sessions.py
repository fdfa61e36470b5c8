"""Sessions keep what they sampled, through the official SDKs against ``kvtier serve tiny`` (K2's
template): each turn sends back what the SDK returned, its tool calls re-serialised (other
spacing and key order; Anthropic's ``input`` objects), and the next turn's cached tokens reach the
previous prompt and output, in whole pages. Another tenant (``cache_salt``) never splices a
session, by id or by content; an over-long session store evicts by its limit, counted in
/metrics."""

from __future__ import annotations

import json

import pytest

from tests.serve.api.conftest import start_server

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

PS = 16
STORE_TOKENS = 1000
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
    "required": ["path"], "additionalProperties": False}}}]
SYSTEM = "You are a coding agent working in a repository. Use the tools when you need a file."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("sampled"), "--page-size", str(PS), "--session-store-tokens",
                       str(STORE_TOKENS), "--max-num-seqs", "2")
    yield srv
    srv.proc.terminate()
    srv.proc.wait(timeout=60)


def bound(prompt: int, output: int) -> int:
    """The previous turn's tokens whose KV exists, in whole pages (the last sampled one never ran)."""
    return (prompt + output - 1) // PS * PS


def redump(args: str) -> str:
    """``args`` as another client would serialise it: keys reversed, spaced out."""
    try:
        value = json.loads(args)
    except ValueError:
        return args
    return json.dumps(dict(reversed(list(value.items()))) if isinstance(value, dict) else value, indent=1)


def chat_turns(client, n: int, *, session_id=None, cache_salt=None, start=None):
    """``n`` chat turns (tool calls forced on every other one); returns [(prompt, output, cached)]
    and the history."""
    history = start or [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Open main.py."}]
    extra = {k: v for k, v in (("session_id", session_id), ("cache_salt", cache_salt)) if v is not None}
    rows = []
    for k in range(n):
        r = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, temperature=0,
                                           tool_choice="required" if k % 2 == 0 else "auto", max_tokens=40,
                                           extra_body=extra)
        u = r.usage
        rows.append((u.prompt_tokens, u.completion_tokens, u.prompt_tokens_details.cached_tokens or 0))
        msg = r.choices[0].message.model_dump(exclude_none=True)
        for c in msg.get("tool_calls") or []:
            c["function"]["arguments"] = redump(c["function"]["arguments"])
        history = history + [msg]
        calls = msg.get("tool_calls") or []
        history += ([{"role": "tool", "tool_call_id": c["id"], "content": f"print({k})"} for c in calls] if calls
                    else [{"role": "user", "content": f"Go on with step {k}."}])
    return rows, history


def test_chat_turns_keep_their_sampled_ids(server):
    rows, _ = chat_turns(server.client(), 3, session_id="kept-chat")
    for (p, o, _), (_, _, cached) in zip(rows, rows[1:]):
        assert cached >= bound(p, o), rows


def test_messages_turns_keep_their_sampled_ids(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    history = [{"role": "user", "content": "Open main.py."}]
    rows = []
    for k in range(3):
        r = client.messages.create(model="tiny", system=SYSTEM, messages=history, tools=tools, max_tokens=40,
                                   tool_choice={"type": "any"} if k % 2 == 0 else {"type": "auto"},
                                   metadata={"user_id": "kept-messages"})
        u = r.usage
        rows.append((u.input_tokens + (u.cache_read_input_tokens or 0), u.output_tokens, u.cache_read_input_tokens or 0))
        blocks = [b.model_dump(exclude_none=True) for b in r.content]
        for b in blocks:  # the SDK's input object, its keys in another order
            if b["type"] == "tool_use":
                b["input"] = dict(reversed(list(b["input"].items())))
        history = history + [{"role": "assistant", "content": blocks or [{"type": "text", "text": ""}]}]
        uses = [b for b in blocks if b["type"] == "tool_use"]
        history.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": b["id"], "content": "ok"}
                                                    for b in uses] or f"Go on with step {k}."})
    for (p, o, _), (_, _, cached) in zip(rows, rows[1:]):
        assert cached >= bound(p, o), rows


def test_no_session_id_finds_its_turn_by_content_within_its_tenant(server):
    client = server.client()
    start = [{"role": "system", "content": SYSTEM + " Tenant test."}, {"role": "user", "content": "List the files."}]
    rows, history = chat_turns(client, 1, cache_salt="tenant-a", start=start)
    (p, o, _), = rows
    # the same conversation from another tenant: no block, no kept id of tenant-a's
    other = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=4,
                                           extra_body={"cache_salt": "tenant-b"})
    assert (other.usage.prompt_tokens_details.cached_tokens or 0) == 0
    same = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=4,
                                          extra_body={"cache_salt": "tenant-a"})
    assert same.usage.prompt_tokens_details.cached_tokens >= bound(p, o)


def test_other_tenants_session_id_never_splices(server):
    client = server.client()
    chat_turns(client, 1, session_id="owned", cache_salt="tenant-a")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"session_id": "owned", "cache_salt": "tenant-b"})
    assert "cache_salt" in str(e.value)


def test_session_store_evicts_by_its_limit(server):
    client = server.client()
    before = server.metrics().get(("kvtier_sessions_evicted_total",), 0.0)
    for i in range(3):  # each session holds about 450 ids: more than the store's limit in all
        chat_turns(client, 1, session_id=f"evict-{i}",
                   start=[{"role": "system", "content": SYSTEM + f" Session {i}. " + "Context. " * 60},
                          {"role": "user", "content": "Open main.py."}])
    assert server.metrics()[("kvtier_sessions_evicted_total",)] > before
