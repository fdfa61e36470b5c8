"""Token buffer: per-turn cost of appending a turn's ids (hashing only the pages they complete)
vs hashing the whole session from scratch, over one session growing to ``--tokens`` ids.

Method: one session of random ids (seed 0) split into ``--turns`` turns of equal size (the
last turn takes the remainder). Each turn is timed three ways: ``append`` of the turn's ids as
a Python list (what a tokenizer returns), ``append`` of a uint32 array, and the from-scratch
alternative ``kvtier.cache.block_hashes(all ids so far)`` on an int64 array. Incremental costs
include fetching the new hashes (``block_hashes(start)``). Each measurement is the median of
``--repeats`` runs (the append is rolled back with ``truncate`` between runs). Reported: ns per
new token for the incremental paths, the from-scratch time at the last turn and the speedup.
CPU only; page_size 16 and 64. ``--csv PATH`` appends rows with provenance.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from timing import append_csv

from kvtier.cache import block_hashes
from kvtier.provenance import provenance
from kvtier.tokenize.buffer import TokenBuffer


def time_append(buf: TokenBuffer, ids, repeats: int) -> float:
    """Median seconds of ``append(ids)`` + fetching the new hashes, rolled back between runs."""
    n0, b0 = len(buf), buf.num_blocks
    times = []
    for _ in range(repeats):
        buf.truncate(n0)
        t0 = time.perf_counter()
        buf.append(ids)
        buf.block_hashes(b0)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_scratch(ids: np.ndarray, page_size: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        block_hashes(ids, page_size)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=150_000)
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--csv", metavar="PATH")
    args = parser.parse_args()
    session = np.random.default_rng(0).integers(0, 163840, size=args.tokens, dtype=np.int64)
    per_turn = args.tokens // args.turns
    bounds = [i * per_turn for i in range(args.turns)] + [args.tokens]
    prov = provenance()
    rows = []
    for page_size in (16, 64):
        buf_list, buf_u32 = TokenBuffer(page_size), TokenBuffer(page_size)
        inc_list, inc_u32, scratch = [], [], []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            turn = session[lo:hi]
            inc_list.append(time_append(buf_list, turn.tolist(), args.repeats) / (hi - lo))
            inc_u32.append(time_append(buf_u32, turn.astype(np.uint32), args.repeats) / (hi - lo))
            scratch.append(time_scratch(session[:hi], page_size, args.repeats))
        assert buf_list.block_hashes() == buf_u32.block_hashes() == block_hashes(session, page_size)
        last_turn_tokens = bounds[-1] - bounds[-2]
        row = {
            "op": "token_buffer_append", "tokens": args.tokens, "turns": args.turns, "page_size": page_size,
            "append_list_ns_per_token": statistics.median(inc_list) * 1e9,
            "append_u32_ns_per_token": statistics.median(inc_u32) * 1e9,
            "last_turn_tokens": last_turn_tokens,
            "last_turn_append_list_ms": inc_list[-1] * last_turn_tokens * 1e3,
            "last_turn_scratch_ms": scratch[-1] * 1e3,
            "scratch_ns_per_token": scratch[-1] / args.tokens * 1e9,
            "last_turn_speedup": scratch[-1] / (inc_list[-1] * last_turn_tokens),
            "commit": prov["commit"], "timestamp": prov["timestamp"],
        }
        rows.append(row)
    for r in rows:
        print(f"page_size {r['page_size']:>2}: append {r['append_list_ns_per_token']:.0f} ns/token (list), "
              f"{r['append_u32_ns_per_token']:.0f} ns/token (uint32); last turn ({r['last_turn_tokens']} tokens) "
              f"{r['last_turn_append_list_ms']:.3f} ms vs from scratch over {r['tokens']} tokens "
              f"{r['last_turn_scratch_ms']:.2f} ms ({r['scratch_ns_per_token']:.0f} ns/token): "
              f"{r['last_turn_speedup']:.0f}x faster")
    if args.csv:
        append_csv(args.csv, rows)


if __name__ == "__main__":
    main()
