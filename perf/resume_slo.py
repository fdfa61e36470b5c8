"""Resume-target misses under ``tool-aware`` and ``lru`` at the same tier sizes.

The built-in workload (coding-agent sessions whose turns stop on ``tool_use``) is replayed in
process through a fresh engine per policy, as ``kvtier bench`` does, with a host tier and a device
tier sized tight (``--device-fraction`` of the sessions' working set), and the pool given the
resume target (``KVPool.set_resume_target``, what ``kvtier serve --resume-ttft-s`` sets). Both
runs tell the pool of every tool wait with the learned median wait (the closed loop's estimate;
``lru`` ignores it). A resume is a turn after a ``tool_use`` turn; it misses when its TTFT is
over the target, classified as the server does (:func:`kvtier.serve.api.resume.miss_reason`:
evicted, prefetch_late, queued) from the blocks it shares with the previous turn. The pool is
polled while the replay sleeps, as the server's engine thread does when idle, so prefetches
start while every session thinks.

Prints resumes and misses by reason per policy and the ratio ``tool-aware / lru`` (the goal:
at most 0.25). Timings depend on the machine: the ratio is the figure, not the seconds.

    python perf/resume_slo.py --sessions 12 --concurrency 4 --host-fraction 0 --device-fraction 0.5 \
        --resume-ttft-s 0.2 --time-scale 0.1 --max-think-s 3
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import replace

import torch

from kvtier.bench.configs import BenchConfig
from kvtier.bench.repeat import format_spread, repeat_seeds, spread
from kvtier.bench.replay import replay
from kvtier.bench.run import BenchOptions, prepare, warm_up
from kvtier.serve.api.resume import REASONS, miss_reason
from kvtier.serve.engine import Engine


POLICIES = ("lru", "tool-aware")


def polling_sleep(engine: Engine, slice_s: float = 0.002):
    """A sleep that polls the pool every ``slice_s`` (due prefetches start, ended ones land)."""

    def sleep(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while True:
            engine.pool.poll()
            left = end - time.perf_counter()
            if left <= 0:
                return
            time.sleep(min(slice_s, left))

    return sleep


def resume_misses(workload, records, target_s: float) -> dict:
    """Resumes (turns after a ``tool_use`` turn) of ``records`` and their misses of
    ``target_s`` by reason, plus their TTFTs (seconds)."""
    by_turn = {(r.session_id, r.turn): r for r in records}
    out = {"resumes": 0, "misses": dict.fromkeys(REASONS, 0), "ttft_s": []}
    bs = workload.block_size
    for s in workload.sessions:
        for k in range(1, len(s.turns)):
            prev, turn, r = s.turns[k - 1], s.turns[k], by_turn.get((s.session_id, k))
            if prev.stop != "tool_use" or r is None or r.error is not None:
                continue
            shared = 0
            for a, b in zip(prev.block_ids[:prev.input_tokens // bs], turn.block_ids):
                if a != b:
                    break
                shared += 1
            out["resumes"] += 1
            out["ttft_s"].append(r.ttft_s)
            findable = min(shared * bs, (r.input_tokens - 1) // bs * bs)
            found = "evicted" if r.cached_tokens < findable else \
                "device" if r.cached_tokens_by_tier.get("device", 0) >= findable else "lower"
            out.setdefault("found", []).append((found, r.ttft_s))
            why = miss_reason(r.ttft_s, target_s, shared * bs, r.input_tokens, r.cached_tokens,
                              r.cached_tokens_by_tier, bs)
            if why is not None:
                out["misses"][why] += 1
    return out


def run_policy(policy: str, prepared, opts: BenchOptions, target_s: float) -> dict:
    model, model_id, workload, sizing, base, _ = prepared
    config = BenchConfig(f"tiered-{policy}", host=sizing.host_cache_bytes > 0, cache_policy=policy, tool_aware=True)
    engine = Engine(model, config.engine_config(base, sizing.host_cache_bytes, None, 0), model_id)
    engine.pool.set_resume_target(target_s)
    gc.collect()
    run = replay(engine, workload, config.name, concurrency=opts.concurrency, tool_aware=True, ramp_s=opts.ramp_s,
                 sleep=polling_sleep(engine))
    engine.pool.poll(wait=True)
    got = resume_misses(workload, run.records, target_s)
    st = engine.pool.stats()
    got.update(policy=policy, prefetched_blocks=st.prefetched_blocks, device_evictions=st.evictions["device"],
               requests=len(run.records), wall_s=run.wall_s)
    return got


def print_run(r: dict) -> None:
    med = statistics.median(r["ttft_s"]) if r["ttft_s"] else float("nan")
    for kind in ("device", "lower", "evicted"):  # where the shared prefix was found
        ts = sorted(t for k, t in r.get("found", []) if k == kind)
        if ts:
            print(f"   shared prefix {kind:>7}: {len(ts):3d} resumes, TTFT p10/p50/p90 "
                  f"{ts[len(ts) // 10] * 1e3:.0f}/{ts[len(ts) // 2] * 1e3:.0f}/{ts[len(ts) * 9 // 10] * 1e3:.0f} ms")
    print(f"{r['policy']:>10}: resumes {r['resumes']:3d}  misses {sum(r['misses'].values()):3d}  "
          + "  ".join(f"{k} {v}" for k, v in r["misses"].items())
          + f"  median resume TTFT {med * 1e3:.1f} ms  prefetched blocks {r['prefetched_blocks']}"
          f"  device evictions {r['device_evictions']}  wall {r['wall_s']:.1f} s", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--max-turns", type=int, default=8)
    ap.add_argument("--device-fraction", type=float, default=0.25,
                    help="device pages as a fraction of the working set (tight: the policy matters)")
    ap.add_argument("--host-fraction", type=float, default=1.0,
                    help="host tier as a fraction of the working set's KV bytes (0: no host tier)")
    ap.add_argument("--resume-ttft-s", type=float, default=0.05, help="the resume target S in seconds")
    ap.add_argument("--time-scale", type=float, default=0.01)
    ap.add_argument("--max-think-s", type=float, default=1.0, help="cap on a scaled think time (s)")
    ap.add_argument("--ramp-s", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="workload draws (seeds SEED..SEED+N-1); prints the median [min-max] of each figure")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    opts = BenchOptions(sessions=args.sessions, concurrency=args.concurrency, max_turns=args.max_turns,
                        device_fraction=args.device_fraction, host_fraction=args.host_fraction,
                        time_scale=args.time_scale, max_think_s=args.max_think_s, ramp_s=args.ramp_s,
                        seed=args.seed, configs="tiered")
    torch.set_num_threads(opts.threads)
    repeats = []
    for seed in repeat_seeds(opts, args.repeat):
        prepared = prepare(replace(opts, workload_seed=seed))
        warm_up(prepared[0], prepared[4])
        sizing = prepared[3]
        print(f"seed {seed}: device pages {sizing.device_pages} of a working set of {sizing.working_set_pages} "
              f"(floor applied: {sizing.device_floor_applied}); host {sizing.host_cache_bytes} bytes; "
              f"target {args.resume_ttft_s} s", flush=True)
        rows = [run_policy(policy, prepared, opts, args.resume_ttft_s) for policy in POLICIES]
        for r in rows:
            print_run(r)
        lru, ta = (sum(r["misses"].values()) for r in rows)
        ratio = ta / lru if lru else float("nan")
        print(f"seed {seed}: tool-aware / lru misses: {ta} / {lru} = {ratio:.3f}", flush=True)
        repeats.append({"seed": seed, "device_pages": sizing.device_pages, "ratio": ratio,
                        "runs": [{k: v for k, v in r.items() if k not in ("ttft_s", "found")} for r in rows]})
    misses = {p: [sum(rep["runs"][i]["misses"].values()) for rep in repeats] for i, p in enumerate(POLICIES)}
    resumes = [rep["runs"][0]["resumes"] for rep in repeats]
    ratios = [rep["ratio"] for rep in repeats if rep["ratio"] == rep["ratio"]]
    print(f"{len(repeats)} draws, resumes {format_spread(spread(resumes))}; misses lru "
          f"{format_spread(spread(misses['lru']))}, tool-aware {format_spread(spread(misses['tool-aware']))}")
    pooled = sum(misses["tool-aware"]) / sum(misses["lru"]) if sum(misses["lru"]) else float("nan")
    print(f"tool-aware / lru misses: per draw {format_spread(spread(ratios), fmt='{:.3g}')}, "
          f"over all draws {sum(misses['tool-aware'])} / {sum(misses['lru'])} = {pooled:.3f} (goal <= 0.25)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"options": vars(args), "repeats": repeats, "pooled_ratio": pooled}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
