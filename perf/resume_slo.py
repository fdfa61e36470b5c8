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

``--sim SCENARIO`` runs both policies in ``kvtier simulate``'s scenario instead (virtual time:
the scenario's model, node and tier sizes, the real engine, scheduler and pool; its ``tiered``
and ``tiered-tool-aware`` variants) on the built-in workload; resumes are counted in the
scenario's pages (:func:`kvtier.bench.resume.resume_misses`). ``--declared-waits`` tells the pool
each wait's recorded length, as a client sending ``expected_tool_wait_s`` does, instead of the
learned median.

    python perf/resume_slo.py --sim kimi-mi355x-128 --resume-ttft-s 0.3 --declared-waits \
        --schedule-policy cache-aware --repeat 3

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
from kvtier.bench.resume import resume_misses
from kvtier.bench.run import BenchOptions, prepare, warm_up
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


def run_policy(policy: str, prepared, opts: BenchOptions, target_s: float, declared_waits: bool = False) -> dict:
    model, model_id, workload, sizing, base, _ = prepared
    config = BenchConfig(f"tiered-{policy}", host=sizing.host_cache_bytes > 0, cache_policy=policy, tool_aware=True)
    engine = Engine(model, config.engine_config(base, sizing.host_cache_bytes, None, 0), model_id)
    engine.set_resume_target(target_s)
    gc.collect()
    run = replay(engine, workload, config.name, concurrency=opts.concurrency, tool_aware=True, ramp_s=opts.ramp_s,
                 sleep=polling_sleep(engine), declared_waits=declared_waits)
    engine.pool.poll(wait=True)
    got = resume_misses(workload, run.records, target_s, engine.config.pool.page_size, prefill_s=engine.prefill_time_s)
    st = engine.pool.stats()
    got.update(policy=policy, prefetched_blocks=st.prefetched_blocks, device_evictions=st.evictions["device"],
               requests=len(run.records), wall_s=run.wall_s)
    return got


def run_sim(args, seed: int) -> tuple[int, list[dict]]:
    """Both policies in the simulator (``--sim SCENARIO``): its ``tiered`` (LRU) and
    ``tiered-tool-aware`` variants on the built-in workload drawn with ``seed``, the same sizes."""
    from kvtier.sim.run import SimOptions, run_scenario

    opts = SimOptions(scenario=args.sim, configs="tiered,tiered-tool-aware", sessions=args.sessions,
                      concurrency=args.concurrency, max_turns=args.max_turns, seed=seed,
                      resume_ttft_s=args.resume_ttft_s, declared_waits=args.declared_waits,
                      schedule_policy=args.schedule_policy)
    _, workload, sizing, runs, prov = run_scenario(opts)
    rows = []
    for policy, sr in zip(POLICIES, runs):
        got = resume_misses(workload, sr.run.records, args.resume_ttft_s, sizing.page_size)  # TTFTs, where found
        got["misses"] = prov["per_variant"][sr.run.name]["resume"]["misses"]  # with the scenario's own prefill
        got.update(policy=policy, prefetched_blocks=None, device_evictions=sr.run.evictions.get("device", 0),
                   requests=len(sr.run.records), wall_s=sr.end_s)
        rows.append(got)
    print(f"seed {seed}: {args.sim}, device pages {sizing.device_pages} of a working set of "
          f"{sizing.working_set_pages}; target {args.resume_ttft_s} s (virtual time)", flush=True)
    return sizing.device_pages, rows


def summarize_draw(seed: int, device_pages: int, rows: list[dict]) -> dict:
    """One draw's figures for the JSON (prints its ratio)."""
    lru, ta = (sum(r["misses"].values()) for r in rows)
    ratio = ta / lru if lru else float("nan")
    print(f"seed {seed}: tool-aware / lru misses: {ta} / {lru} = {ratio:.3f}", flush=True)
    return {"seed": seed, "device_pages": device_pages, "ratio": ratio,
            "runs": [{k: v for k, v in r.items() if k not in ("ttft_s", "found")} for r in rows]}


def print_run(r: dict) -> None:
    med = statistics.median(r["ttft_s"]) if r["ttft_s"] else float("nan")
    for kind in ("device", "lower", "evicted"):  # where the shared prefix was found
        ts = sorted(t for k, t in r.get("found", []) if k == kind)
        if ts:
            print(f"   shared prefix {kind:>7}: {len(ts):3d} resumes, TTFT p10/p50/p90 "
                  f"{ts[len(ts) // 10] * 1e3:.0f}/{ts[len(ts) // 2] * 1e3:.0f}/{ts[len(ts) * 9 // 10] * 1e3:.0f} ms")
    print(f"{r['policy']:>10}: resumes {r['resumes']:3d}  misses {sum(r['misses'].values()):3d}  "
          + "  ".join(f"{k} {v}" for k, v in r["misses"].items())
          + f"  median resume TTFT {med * 1e3:.1f} ms  prefetched blocks {r['prefetched_blocks'] or '-'}"
          f"  device evictions {r['device_evictions']}  wall {r['wall_s']:.1f} s", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, help="sessions (default 12; with --sim: the scenario's)")
    ap.add_argument("--concurrency", type=int, help="sessions at once (default 6; with --sim: the scenario's)")
    ap.add_argument("--sim", metavar="SCENARIO", help="run both policies in `kvtier simulate`'s SCENARIO (virtual "
                    "time, the scenario's model, node and tier sizes) on the built-in workload instead of in process")
    ap.add_argument("--declared-waits", action="store_true", help="the pool hears each tool wait's recorded length "
                    "(a client sending expected_tool_wait_s) instead of the learned median")
    ap.add_argument("--schedule-policy", help="with --sim: the engines' admission order (default: the scenario's)")
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
    opts = BenchOptions(sessions=args.sessions or 12, concurrency=args.concurrency or 6, max_turns=args.max_turns,
                        device_fraction=args.device_fraction, host_fraction=args.host_fraction,
                        time_scale=args.time_scale, max_think_s=args.max_think_s, ramp_s=args.ramp_s,
                        seed=args.seed, configs="tiered")
    torch.set_num_threads(opts.threads)
    repeats = []
    for seed in repeat_seeds(opts, args.repeat):
        if args.sim:
            device_pages, rows = run_sim(args, seed)
            for r in rows:
                print_run(r)
            repeats.append(summarize_draw(seed, device_pages, rows))
            continue
        prepared = prepare(replace(opts, workload_seed=seed))
        warm_up(prepared[0], prepared[4])
        sizing = prepared[3]
        print(f"seed {seed}: device pages {sizing.device_pages} of a working set of {sizing.working_set_pages} "
              f"(floor applied: {sizing.device_floor_applied}); host {sizing.host_cache_bytes} bytes; "
              f"target {args.resume_ttft_s} s", flush=True)
        rows = [run_policy(policy, prepared, opts, args.resume_ttft_s, args.declared_waits) for policy in POLICIES]
        for r in rows:
            print_run(r)
        repeats.append(summarize_draw(seed, sizing.device_pages, rows))
    misses = {p: [sum(rep["runs"][i]["misses"].values()) for rep in repeats] for i, p in enumerate(POLICIES)}
    resumes = [rep["runs"][0]["resumes"] for rep in repeats]
    ratios = [rep["ratio"] for rep in repeats if rep["ratio"] == rep["ratio"]]
    print(f"{len(repeats)} draws, resumes {format_spread(spread(resumes))}; misses lru "
          f"{format_spread(spread(misses['lru']))}, tool-aware {format_spread(spread(misses['tool-aware']))}")
    pooled = sum(misses["tool-aware"]) / sum(misses["lru"]) if sum(misses["lru"]) else float("nan")
    print(f"tool-aware / lru misses: per draw {format_spread(spread(ratios), fmt='{:.3g}')}, "
          f"over all draws {sum(misses['tool-aware'])} / {sum(misses['lru'])} = {pooled:.3f} (goal <= 0.25)")
    acts = {p: sum(rep["runs"][i]["misses"]["evicted"] + rep["runs"][i]["misses"]["prefetch_late"] for rep in repeats)
            for i, p in enumerate(POLICIES)}
    print(f"misses the pool can act on (evicted + prefetch_late), all draws: lru {acts['lru']}, "
          f"tool-aware {acts['tool-aware']}")
    meetable = {p: sum(sum(rep["runs"][i]["misses"].values()) - rep["runs"][i]["misses"]["prefill"] for rep in repeats)
                for i, p in enumerate(POLICIES)}
    met_ratio = meetable["tool-aware"] / meetable["lru"] if meetable["lru"] else float("nan")
    print(f"misses but prefill (the turn's own new tokens take over the target), all draws: lru {meetable['lru']}, "
          f"tool-aware {meetable['tool-aware']} = {met_ratio:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"options": vars(args), "repeats": repeats, "pooled_ratio": pooled,
                       "pooled_ratio_but_prefill": met_ratio}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
