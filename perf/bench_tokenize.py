"""Per-turn encode time of a growing agent session: incremental vs full re-encode vs new text alone.

Method: a deterministic 200-turn coding-agent session (seed 0) built from realistic parts —
user requests, assistant tool calls with JSON arguments, tool results with source code, logs,
JSON, CJK and emoji, one minified file longer than 25,000 characters — grows to >= 150K tokens
with a tool declaration. At every turn, on one CPU thread:

- ``incremental``: ``SessionEncoder.append(messages, tools)`` (canonical mode) — renders the
  whole conversation, finds the first difference, encodes from the last special token;
- ``full``: ``tokenizer.encode(render_chat(messages, tools))``;
- ``new_only``: ``tokenizer.encode(text added this turn)`` (the lower bound).

Each is timed ``--repeats`` times in a row per turn (101 at the last turn) (median, so warm caches for all three; the
incremental repeat replays the turn on an encoder restored to the previous turn's state). Right
after a full re-encode of the session (cold caches) the incremental turn costs more: it walks
every message once to detect edits in place. No warm-up beyond one tokenizer load. The
incremental ids are checked against the full encode every turn. Prints the last turn's
full/incremental ratio (goal >= 50x) and incremental/new_only (goal <= 1.3x) at the last turn,
over the last 10 turns (median) and over the whole session (sum over sum); ``--json PATH``
writes every row with provenance.

Usage: python perf/bench_tokenize.py [--tokenizer DIR] [--turns 200] [--json PATH]
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time
from pathlib import Path

from timing import median_s

from kvtier.tokenize import SessionEncoder, load_tokenizer, render_chat, render_messages

DEFAULT_TOKENIZER = Path(__file__).resolve().parents[1].parent / "shared" / "kimi_tokenizer"
TOOLS = [{"type": "function", "function": {"name": n, "description": d, "parameters": {
    "type": "object", "properties": {"arg": {"type": "string"}}, "required": ["arg"]}}}
    for n, d in [("bash", "Run a shell command"), ("read_file", "Read a file"), ("edit", "Apply an edit"),
                 ("search", "Search the repository")]]
CODE = '''def handle(request):\n    """Route one request."""\n    if request.method == "GET":\n        return cache.get(request.path) or fetch(request)\n    raise ValueError(f"bad method {request.method!r}")\n\n'''
LOG = "2026-11-30T00:00:{:02d}Z INFO worker-3 step={} loss=0.{:04d} tokens/s=18234\n"
CJK = "修复了缓存淘汰策略中的竞争条件；日本語のログも確認しました。✅🚀\n"


def _tool_output(rng: random.Random, turn: int) -> str:
    kind = rng.choice(["code", "log", "json", "cjk"])
    if turn == 120:  # a minified bundle: one run longer than 25,000 characters
        return "!function(e){var t={};function n(r){return t[r]}}" * 600
    if kind == "code":
        return CODE * rng.randint(6, 15)
    if kind == "log":
        return "".join(LOG.format(i % 60, i, rng.randint(0, 9999)) for i in range(rng.randint(30, 75)))
    if kind == "json":
        return json.dumps([{"path": f"src/mod_{i}.py", "line": rng.randint(1, 900), "match": "cache.get("}
                           for i in range(rng.randint(15, 45))])
    return CJK * rng.randint(8, 30)


def session(turns: int, seed: int = 0) -> list[list[dict]]:
    """The conversation after each turn (``turns`` snapshots)."""
    rng, msgs, snaps, calls = random.Random(seed), [{"role": "system", "content": "You are a coding agent."}], [], 0
    for turn in range(turns):
        if turn % 10 == 0:
            msgs.append({"role": "user", "content": f"Task {turn // 10}: fix the failing test in src/mod_{turn}.py "
                                                    "and explain the change. 谢谢!"})
        else:
            name = rng.choice(TOOLS)["function"]["name"]
            cid = f"functions.{name}:{calls}"
            calls += 1
            msgs.append({"role": "assistant", "content": "Let me check." if rng.random() < 0.5 else "",
                         "tool_calls": [{"id": cid, "type": "function", "function": {
                             "name": name, "arguments": json.dumps({"arg": f"src/mod_{turn}.py"})}}]})
            msgs.append({"role": "tool", "tool_call_id": cid, "name": name, "content": _tool_output(rng, turn)})
        snaps.append(copy.deepcopy(msgs))
    return snaps


LAST_TURN_REPEATS = 101  # the last turn's medians carry the goals: more samples against machine noise


def run(tokenizer_dir: Path, turns: int, repeats: int) -> list[dict]:
    tok = load_tokenizer(tokenizer_dir)
    enc, rows, prev_len = SessionEncoder(tok), [], 0
    for turn, msgs in enumerate(session(turns)):
        parts = render_messages(msgs, TOOLS)
        text = "".join(parts)
        new_text = text[max(0, prev_len - len(parts[-1])):]  # from the previous generation prompt on
        state = {k: v for k, v in vars(enc).items() if k != "_store"}
        n_ids = len(enc)
        t_inc = []
        n = max(repeats, LAST_TURN_REPEATS) if turn == turns - 1 else repeats  # the goals are read here
        for _ in range(n):  # replay the turn from the previous state
            vars(enc).update({k: list(v) if isinstance(v, list) else v for k, v in state.items()})
            enc._store.truncate(n_ids)
            t0 = time.perf_counter()
            enc.append(msgs, TOOLS)
            t_inc.append(time.perf_counter() - t0)
        t_full = median_s(lambda: tok.encode(render_chat(msgs, TOOLS)), n)
        t_new = median_s(lambda: tok.encode(new_text), n)
        assert list(enc.ids) == tok.encode(text), f"turn {turn}: incremental ids differ from the full encode"
        rows.append({"turn": turn, "tokens": len(enc), "new_chars": len(new_text),
                     "incremental_us": statistics.median(t_inc) * 1e6, "full_us": t_full * 1e6,
                     "new_only_us": t_new * 1e6})
        prev_len = len(text)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rows = run(args.tokenizer, args.turns, args.repeats)
    print(f"{'turn':>5} {'tokens':>8} {'new_chars':>9} {'incr_us':>9} {'full_us':>10} {'new_us':>9} {'full/incr':>9} {'incr/new':>8}")
    for r in rows[:: max(1, len(rows) // 20)] + [rows[-1]]:
        print(f"{r['turn']:>5} {r['tokens']:>8} {r['new_chars']:>9} {r['incremental_us']:>9.0f} {r['full_us']:>10.0f} "
              f"{r['new_only_us']:>9.0f} {r['full_us'] / r['incremental_us']:>9.1f} "
              f"{r['incremental_us'] / r['new_only_us']:>8.2f}")
    last, tail = rows[-1], rows[-10:]
    speedup = last["full_us"] / last["incremental_us"]
    overhead = last["incremental_us"] / last["new_only_us"]
    tail_over = statistics.median(r["incremental_us"] / r["new_only_us"] for r in tail)
    session_over = sum(r["incremental_us"] for r in rows) / sum(r["new_only_us"] for r in rows)
    print(f"last turn ({last['tokens']} tokens): incremental {last['incremental_us']:.0f} us, full {last['full_us']:.0f} us "
          f"-> {speedup:.1f}x faster (goal >= 50x); incremental / new text alone = {overhead:.2f}x "
          f"(median of last 10 turns {tail_over:.2f}x; whole session {session_over:.2f}x; goal <= 1.3x)")
    if args.json:
        from kvtier.provenance import provenance

        args.json.write_text(json.dumps({"rows": rows, "speedup_last": speedup, "overhead_last": overhead,
                                         "overhead_session": session_over,
                                         **provenance(bench="tokenize")}, indent=1))


if __name__ == "__main__":
    main()
