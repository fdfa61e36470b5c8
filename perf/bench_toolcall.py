"""Tool-call constrained decoding cost with the real Kimi vocabulary (163,840 tokens): grammar
compile time per schema, and mask time per token.

Method (CPU, one process; llguidance's own threads for the batched case):

- Schemas: the K2-Vendor-Verifier ``search`` tool and one tool per valid schema of Moonshot's
  validator set (213; non-object schemas wrapped as a required ``value`` property), each as a
  ``tool_choice="required"`` turn grammar.
- Compile: ``GrammarCompiler.compile`` (llguidance lexer/parser construction, no cache), once
  per schema after one warm-up compile; reported p50/p99/max over schemas. A cache hit in the
  engine costs one matcher copy instead (``deep_copy``, timed too).
- Mask, replayed: the 30 tool calls Kimi K2 actually produced for K2-Vendor-Verifier requests
  (``medium_results.jsonl``) re-tokenised and replayed through the ``search`` grammar; at every
  token ``fill_next_token_bitmask`` (one packed int32 row) is timed.
- Mask, random: for each schema a turn of up to ``--tokens`` tokens drawn uniformly from the
  mask (seed 0; noise, as from an untrained model), timing the mask at each token and,
  separately, the constraint's own bookkeeping per token (``plan`` + ``take``), split into
  tokens far from ``max_tokens`` (an occasional completion estimate) and tokens where the
  budget is watched (one completion search per token).
- Batched: ``fill_bitmasks`` over ``--batch`` requests at once (the engine's per-step call),
  time divided by the batch.

Reported: p50/p99 in µs; goal: mask p50 <= 50 µs per token. ``--json PATH`` writes all numbers
with provenance.

Usage: python perf/bench_toolcall.py [--tokenizer DIR] [--tokens 64] [--batch 16] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the sweep's case builders live with the tests

from kvtier.toolcall import (
    GrammarCompiler,
    TokenTable,
    ToolCallConstraint,
    fill_bitmasks,
    normalize_tools,
    turn_grammar,
)

from tests.toolcall.sweep import K2VV_DIR, TOKENIZER_DIR, k2vv_cases, walle_cases


def pct(values, q) -> float:
    return float(np.percentile(np.asarray(values) * 1e6, q))


def summary(values) -> dict:
    if not values:
        return {
            "n": 0,
            "p50_us": float("nan"),
            "p99_us": float("nan"),
            "max_us": float("nan"),
        }
    return {
        "n": len(values),
        "p50_us": pct(values, 50),
        "p99_us": pct(values, 99),
        "max_us": pct(values, 100),
    }


def grammars(cases) -> list[tuple[str, str]]:
    return [(c.name, turn_grammar(normalize_tools(c.tools), "required")) for c in cases]


def bench_compile(compiler, named) -> tuple[list[float], list[float], list[str]]:
    compiler.compile(named[0][1])
    compile_s, copy_s, failed = [], [], []
    for name, lark in named:
        t0 = time.perf_counter()
        try:
            m = compiler.compile(lark)
        except ValueError:
            failed.append(name)
            continue
        compile_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        m.deep_copy()
        copy_s.append(time.perf_counter() - t0)
    return compile_s, copy_s, failed


def replay_k2_outputs(compiler, tok) -> list[float]:
    """Mask time at every token of Kimi K2's own tool-call turns for the search tool."""
    from llguidance.numpy import fill_next_token_bitmask

    lark = turn_grammar(normalize_tools(k2vv_cases()[0].tools), "required")
    row = np.zeros((1, (tok.n_vocab + 31) // 32), dtype=np.int32)
    times = []
    for line in (K2VV_DIR / "medium_results.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["finish_reason"] != "tool_calls":
            continue
        calls = r["response"]["choices"][0]["message"]["tool_calls"]
        text = (
            "<|tool_calls_section_begin|>"
            + "".join(
                f"<|tool_call_begin|>{c['id']}<|tool_call_argument_begin|>{c['function']['arguments']}<|tool_call_end|>"
                for c in calls
            )
            + "<|tool_calls_section_end|><|im_end|>"
        )
        m = compiler.matcher(lark)
        for t in tok.encode(text):
            t0 = time.perf_counter()
            fill_next_token_bitmask(m, row)
            times.append(time.perf_counter() - t0)
            assert m.consume_token(t), m.get_error()
    return times


def random_turns(compiler, table, tok, named, tokens: int, seed: int = 0):
    """Per-token mask time and constraint bookkeeping time over random turns of every schema."""
    from llguidance.numpy import fill_next_token_bitmask

    rng = np.random.default_rng(seed)
    row = np.zeros((1, (tok.n_vocab + 31) // 32), dtype=np.int32)
    mask_s, own_s = [], {False: [], True: []}
    for _, lark in named:
        con = ToolCallConstraint(compiler.matcher(lark), table, tokens)
        while con.num_tokens < tokens and not con.finished:
            watching = con.watching
            t0 = time.perf_counter()
            forced = con.plan()
            t1 = time.perf_counter()
            if forced is None:
                fill_next_token_bitmask(con.matcher, row)
                mask_s.append(time.perf_counter() - t1)
                allowed = np.nonzero(
                    np.unpackbits(row[0].view(np.uint8), bitorder="little")[
                        : tok.n_vocab
                    ]
                )[0]
                token = int(rng.choice(allowed))
            else:
                token = forced
            t2 = time.perf_counter()
            con.take(token)
            own_s[watching or con.watching].append(
                (t1 - t0) + (time.perf_counter() - t2)
            )
    return mask_s, own_s


def batched(
    compiler, table, tok, named, batch: int, tokens: int, seed: int = 1
) -> list[float]:
    """``fill_bitmasks`` over ``batch`` requests per step, per request."""
    import llguidance

    rng = np.random.default_rng(seed)
    executor = llguidance.LLExecutor()
    bitmask = np.zeros((batch, (tok.n_vocab + 31) // 32), dtype=np.int32)
    per_request = []
    for start in range(0, len(named) - batch + 1, batch):
        cons = [
            ToolCallConstraint(compiler.matcher(lark), table, tokens)
            for _, lark in named[start : start + batch]
        ]
        for _ in range(tokens):
            live = [c for c in cons if not c.finished and c.num_tokens < tokens]
            if not live:
                break
            t0 = time.perf_counter()
            fill_bitmasks(live, bitmask[: len(live)], executor)
            per_request.append((time.perf_counter() - t0) / len(live))
            for i, c in enumerate(live):
                bits = np.unpackbits(bitmask[i].view(np.uint8), bitorder="little")[
                    : tok.n_vocab
                ]
                c.take(int(rng.choice(np.nonzero(bits)[0])))
    return per_request


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", type=Path, default=TOKENIZER_DIR)
    ap.add_argument(
        "--tokens", type=int, default=512, help="max_tokens of each random turn"
    )
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from kvtier.tokenize import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    t0 = time.perf_counter()
    compiler = GrammarCompiler(tok, [tok.token_id("<|im_end|>"), tok.token_id("[EOS]")])
    table = TokenTable(tok, compiler.end_of_turn_ids)
    setup_s = time.perf_counter() - t0
    named = grammars(k2vv_cases()[:1] + walle_cases())
    compile_s, copy_s, failed = bench_compile(compiler, named)
    named = [(n, g) for n, g in named if n not in failed]
    results = {
        "tokenizer_setup_s": setup_s,
        "compile": summary(compile_s),
        "matcher_copy": summary(copy_s),
        "compile_failed": failed,
        "mask_k2_replay": summary(replay_k2_outputs(compiler, tok)),
    }
    mask_s, own_s = random_turns(compiler, table, tok, named, args.tokens)
    results["mask_random"] = summary(mask_s)
    results["constraint_overhead_far_from_budget"] = summary(own_s[False])
    results["constraint_overhead_watching_budget"] = summary(own_s[True])
    results[f"mask_batched_{args.batch}_per_request"] = summary(
        batched(compiler, table, tok, named, args.batch, args.tokens)
    )
    print(
        f"llguidance tokenizer + token table setup: {setup_s:.2f} s (once per engine)"
    )
    print(f"{'what':<38} {'n':>7} {'p50_us':>9} {'p99_us':>9} {'max_us':>10}")
    for key, v in results.items():
        if isinstance(v, dict):
            print(
                f"{key:<34} {v['n']:>7} {v['p50_us']:>9.1f} {v['p99_us']:>9.1f} {v['max_us']:>10.1f}"
            )
    print(f"schemas that do not compile: {failed}")
    for key in ("mask_k2_replay", "mask_random"):
        print(f"{key}: p50 {results[key]['p50_us']:.1f} us per token (goal <= 50 us)")
    if args.json:
        from kvtier.provenance import provenance

        args.json.write_text(
            json.dumps(
                {
                    **results,
                    **provenance(
                        bench="toolcall", tokens=args.tokens, batch=args.batch
                    ),
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
