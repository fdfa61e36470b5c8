"""Text chat sessions as a bench workload: loading, block ids, replay through the engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvtier.bench.conversations import load_conversations
from kvtier.bench.replay import replay
from kvtier.bench.workload import THINK_AFTER_END_TURN_Q, THINK_AFTER_TOOL_USE_Q, TraceError
from kvtier.cli import main
from kvtier.tokenize import render_chat, render_messages
from tests.conftest import SHARED
from tests.helpers.conversations import CONVERSATION, TOOLS

VERIFIER = SHARED / "toolcalls" / "K2-Vendor-Verifier" / "samples.jsonl"


def _write(path: Path, docs) -> Path:
    path.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    return path


def test_a_conversation_becomes_one_turn_per_response(tok, tmp_path):
    wl = load_conversations(_write(tmp_path / "c.jsonl", [{"messages": CONVERSATION, "tools": TOOLS,
                                                          "max_tokens": 7}]), tok, page_size=8, time_scale=0.5)
    (s,) = wl.sessions
    assert [len(t.chat.messages) for t in s.turns] == [2, 4, 6]  # before each assistant message, then the open end
    for t in s.turns:
        prompt = tok.encode(render_chat(list(t.chat.messages), TOOLS))
        assert t.input_tokens == len(prompt) and len(t.block_ids) == -(-len(prompt) // 8)
    a, b, c = s.turns
    assert a.output_tokens == len(tok.encode(render_messages([CONVERSATION[2]], add_generation_prompt=False)[-1]))
    assert c.output_tokens == 7  # the request's max_tokens
    assert (a.stop, b.stop, c.stop) == ("tool_use", "end_turn", "")
    assert (a.think_time_s, b.think_time_s, c.think_time_s) == (0.0, THINK_AFTER_TOOL_USE_Q[1] * 0.5,
                                                               THINK_AFTER_END_TURN_Q[1] * 0.5)
    # equal prefix pages get equal ids; the first turn's full pages are the second's first pages
    full = a.input_tokens // 8
    assert b.block_ids[:full] == a.block_ids[:full]
    assert len(set(a.block_ids) | set(b.block_ids) | set(c.block_ids)) > len(c.block_ids)


def test_turn_lines_form_sessions_and_share_prefix_blocks_across_sessions(tok, tmp_path):
    lines = [{"session_id": "s1", "messages": CONVERSATION[:2], "output_tokens": 5},
             {"session_id": "s2", "messages": CONVERSATION[:2]},
             {"session_id": "s1", "messages": CONVERSATION[:4], "think_time_s": 3, "tools": TOOLS}]
    wl = load_conversations(_write(tmp_path / "t.jsonl", lines), tok, page_size=4, max_think_s=2.0)
    s1, s2 = wl.sessions
    assert (s1.session_id, len(s1.turns), s2.session_id, len(s2.turns)) == ("s1", 2, "s2", 1)
    assert s1.turns[0].output_tokens == 5 and s2.turns[0].output_tokens == 64
    assert s1.turns[1].think_time_s == 2.0  # 3 s capped
    assert s1.turns[0].block_ids[:-1] == s2.turns[0].block_ids[:-1]  # same text, same full pages
    assert s1.turns[0].block_ids[-1] != s2.turns[0].block_ids[-1] or s1.turns[0].input_tokens % 4 == 0


@pytest.mark.parametrize("line, match", [
    ("{not json", r"c\.jsonl:2: not JSON"),
    ('{"session_id": 3, "messages": [{"role": "user", "content": "x"}]}', r":2: session_id must be"),
    ('{"messages": []}', r":2: messages is empty"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', r"turn 0: .*messages\[0\]\.role"),
    ('{"session_id": "a", "messages": [{"role": "user", "content": "x"}], "output_tokens": 0}', r":2: output_tokens"),
    ('{"session_id": "a", "messages": [{"role": "user", "content": "x"}], "think_time_s": NaN}', r":2: think_time_s"),
    ('[{"role": ["user"], "content": "x"}]', r"turn 0: .*messages\[0\]\.role"),
    ('{"session_id": "c:1", "messages": [{"role": "user", "content": "x"}]}', r":2: session_id 'c:1' is the id"),
])
def test_bad_lines_name_the_file_and_line(tok, tmp_path, line, match):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps([{"role": "user", "content": "fine"}]) + "\n" + line + "\n")
    with pytest.raises(TraceError, match=match):
        load_conversations(path, tok)


def test_undecodable_line_and_oversized_responses(tok, tmp_path):
    path = tmp_path / "u.jsonl"
    path.write_bytes(json.dumps([{"role": "user", "content": "ok"}]).encode() + b"\n\xff\xfe\n")
    with pytest.raises(TraceError, match=r"u\.jsonl:2: not UTF-8"):
        load_conversations(path, tok)
    doc = {"session_id": "s", "messages": [{"role": "user", "content": "hi"}], "output_tokens": 10**8}
    (turn,) = load_conversations(_write(tmp_path / "h.jsonl", [doc]), tok, max_input_tokens=512).sessions[0].turns
    assert turn.input_tokens + turn.output_tokens == 512  # capped at the context, as the engine would stop


def test_replay_encodes_each_turn_and_reuses_the_cache(tok, tmp_path):
    from kvtier.llm import load_for_serving
    from kvtier.cache.config import PoolConfig
    from kvtier.serve import Engine, EngineConfig

    wl = load_conversations(_write(tmp_path / "c.jsonl", [CONVERSATION]), tok, page_size=8, time_scale=0,
                            max_output_tokens=3)
    assert [t.output_tokens for t in wl.sessions[0].turns] == [3, 3, 3]
    net, model_id = load_for_serving("tiny", seed=0)
    engine = Engine(net, EngineConfig(pool=PoolConfig(page_size=8, num_device_pages=256), max_num_batched_tokens=256), model_id)
    with pytest.raises(ValueError, match="tokenizer"):
        replay(engine, wl, "x", concurrency=1)
    run = replay(engine, wl, "device-only", concurrency=1, tokenizer=tok, keep_outputs=True)
    assert [r.error for r in run.records] == [None, None, None]
    assert [r.input_tokens for r in run.records] == [t.input_tokens for t in wl.sessions[0].turns]
    assert run.records[1].cached_tokens >= (wl.sessions[0].turns[0].input_tokens // 8 - 1) * 8


@pytest.mark.skipif(not VERIFIER.is_file(), reason=f"K2-Vendor-Verifier samples not present at {VERIFIER}")
def test_cli_replays_verifier_requests(tok_dir, tmp_path):
    out = tmp_path / "bench.json"
    threads = torch.get_num_threads()
    try:
        rc = main(["bench", "--conversations", str(VERIFIER), "--tokenizer", str(tok_dir), "--configs",
                   "device-only", "--sessions", "2", "--concurrency", "2", "--max-turns", "2", "--page-size", "64",
                   "--max-output-tokens", "4", "--time-scale", "0", "--json", str(out), "--plot", ""])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["provenance"]["workload"]["format"] == "conversations"
    cfg = data["configs"]["device-only"]
    assert cfg["errors"] == 0 and cfg["requests"] == 3  # samples:1 turns 1-2, samples:2


def test_cli_conversations_needs_a_tokenizer_with_a_preset(tmp_path, capsys):
    path = _write(tmp_path / "c.jsonl", [CONVERSATION])
    assert main(["bench", "--conversations", str(path), "--plot", ""]) == 2
    assert "--tokenizer" in capsys.readouterr().err


def test_conversation_options_without_conversations_are_refused(capsys):
    assert main(["bench", "--max-output-tokens", "4", "--page-size", "8", "--plot", ""]) == 2
    assert "--page-size, --max-output-tokens apply to --conversations only" in capsys.readouterr().err
