"""Where a preemption's cost goes, step by step, on the real engine or in the simulator.

Runs one ``kvtier bench`` configuration (default ``tiered``) through the real scheduler and
pool, real (``--real``, the default) or in the simulator with the CPU fit (``--sim``, as
``perf/sim_tail.py``), and counts, from the scheduler's and pool's own calls (wrapped in this
script, nothing patched in the library):

* preemptions per step, and how many hit a sequence that resumed within ``--thrash-steps``
  steps (thrash);
* the write-back copies (``Writes.evicting``: device pages reused, their blocks copied to the
  host tier and waited for) and the inline prefix waits, each as a share of step time (they run
  inside ``Scheduler.schedule``, before the batch's model step, so every decode in the batch
  waits for them);
* per resume: the pages its prefix and first chunk need against the free pages then;
* which requests make the TPOT p99 (per request ``(finish - first) / (n - 1)``): preempted after
  their first token or not, and how much of their decode time they spent waiting preempted.

    python perf/preemption_anatomy.py --trace ../shared/traces/kv-cache-tester --sessions 16 \\
        --concurrency 8 --preemption-mode swap [--sim] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from collections import Counter, defaultdict

from kvtier.bench.run import BenchOptions, run_all
from kvtier.cache.pool import KVPool
from kvtier.cache.writes import Writes
from kvtier.serve.engine import Engine
from kvtier.serve.queues import Queues
from kvtier.serve.scheduler import Scheduler

HERE = pathlib.Path(__file__).resolve().parent


class Probe:
    """What the wrapped calls saw, per step."""

    def __init__(self) -> None:
        self.step = 0
        self.clock = time.perf_counter
        self.steps: list[dict] = []  # per schedule(): sched_s, evict_s, evict_blocks, inline_s, preempt, batch
        self.preempts: list[dict] = []
        self.resumes: list[dict] = []
        self.last_resume: dict[int, int] = {}
        self.seqs: dict[int, object] = {}
        self.preempted_at: dict[int, float] = {}
        self.waited_after_first: dict[int, float] = defaultdict(float)
        self.cur: dict | None = None

    def install(self) -> None:
        probe = self
        sched_schedule, sched_add = Scheduler.schedule, Scheduler.add
        evicting, wait_prefix = Writes.evicting, KVPool.wait_prefix
        preempt, start_running, start_loading = Queues.preempt, Queues.start_running, Queues.start_loading
        engine_step = Engine.step

        def schedule(self):
            probe.clock = self.clock
            probe.cur = {"step": probe.step, "evict_s": 0.0, "evict_blocks": 0, "inline_s": 0.0, "preempt": 0,
                         "preempt_decodes": 0, "free_before": self.pool.num_free_pages}
            t0 = probe.cur["t0"] = probe.clock()
            batch = sched_schedule(self)
            probe.cur["sched_s"] = probe.clock() - t0
            probe.cur["decodes"] = len(batch.decodes)
            probe.cur["extends"] = len(batch.extends)
            probe.cur["running"] = len(self.queues.running)
            probe.steps.append(probe.cur)
            probe.step += 1
            return batch

        def add(self, seq):
            probe.seqs[seq.seq_id] = seq
            return sched_add(self, seq)

        def step(self):
            t0 = probe.clock()
            n = len(probe.steps)
            out = engine_step(self)
            if len(probe.steps) > n:
                probe.steps[-1]["step_s"] = probe.clock() - t0
            return out

        def timed(name, count=None):
            def wrap(fn):
                def inner(self, *a, **k):
                    t0 = probe.clock()
                    try:
                        return fn(self, *a, **k)
                    finally:
                        if probe.cur is not None:
                            probe.cur[name + "_s"] += probe.clock() - t0
                            if count:
                                probe.cur[count] += len(a[0])
                return inner
            return wrap

        def do_preempt(self, seq, pool, *a, **k):
            decode = bool(seq.output_token_ids)
            probe.preempts.append({"step": probe.step, "seq": seq.seq_id, "decode": decode,
                                   "tokens": seq.num_computed_tokens, "pages": len(seq.page_ids),
                                   "since_resume": probe.step - probe.last_resume.get(seq.seq_id, -10**9)})
            if probe.cur is not None:
                probe.cur["preempt"] += 1
                probe.cur["preempt_decodes"] += decode
            if decode:
                probe.preempted_at[seq.seq_id] = probe.clock()
            return preempt(self, seq, pool, *a, **k)

        def resumed(fn, how):
            def inner(self, seq, clock):
                if seq.seq_id in self.preempted:
                    probe.last_resume[seq.seq_id] = probe.step
                    probe.resumes.append({"step": probe.step, "seq": seq.seq_id, "how": how,
                                          "pages": len(seq.page_ids), "tokens": seq.num_computed_tokens,
                                          "length": seq.num_tokens})
                    t = probe.preempted_at.pop(seq.seq_id, None)
                    if t is not None:
                        probe.waited_after_first[seq.seq_id] += probe.clock() - t
                return fn(self, seq, clock)
            return inner

        Scheduler.schedule, Scheduler.add, Engine.step = schedule, add, step
        Writes.evicting = timed("evict", "evict_blocks")(evicting)
        KVPool.wait_prefix = timed("inline")(wait_prefix)
        Queues.preempt = do_preempt
        Queues.start_running = resumed(start_running, "running")
        Queues.start_loading = resumed(start_loading, "loading")

    def report(self, thrash_steps: int) -> dict:
        for a, b in zip(self.steps, self.steps[1:]):  # the simulator runs no Engine.step: the gap to the next
            a.setdefault("step_s", b["t0"] - a["t0"])
        steps = [s for s in self.steps if "step_s" in s]
        total = sum(s["step_s"] for s in steps) or 1.0
        evict = sum(s["evict_s"] for s in steps)
        inline = sum(s["inline_s"] for s in steps)
        sched = sum(s["sched_s"] for s in steps)
        per_step = Counter(s["preempt"] for s in self.steps)
        thrash = [p for p in self.preempts if p["since_resume"] <= thrash_steps]
        # TPOT per request, and its p99 set
        tpot = {}
        for sid, seq in self.seqs.items():
            m, n = seq.metrics, len(seq.output_token_ids)
            if m.first_token_time is not None and m.finish_time is not None and n >= 2:
                tpot[sid] = (m.finish_time - m.first_token_time) / (n - 1)
        ranked = sorted(tpot, key=tpot.get, reverse=True)
        tail = ranked[:max(1, len(ranked) // 100 + 1)] if ranked else []
        top = ranked[:max(5, len(ranked) // 20)]

        def row(sid):
            seq = self.seqs[sid]
            m, n = seq.metrics, len(seq.output_token_ids)
            decode_s = m.finish_time - m.first_token_time
            return {"seq": sid, "tpot_s": round(tpot[sid], 4), "outputs": n, "prompt": len(seq.prompt_token_ids or []),
                    "preempted_after_first": m.preemptions_after_first_token,
                    "waited_preempted_s": round(self.waited_after_first.get(sid, 0.0), 3),
                    "waited_share": round(self.waited_after_first.get(sid, 0.0) / decode_s, 3) if decode_s else 0.0}

        p99 = sorted(tpot.values())[min(len(tpot) - 1, int(0.99 * len(tpot)))] if tpot else None
        preempted_tpot = [tpot[s] for s in tpot if self.seqs[s].metrics.preemptions_after_first_token]
        clean_tpot = [tpot[s] for s in tpot if not self.seqs[s].metrics.preemptions_after_first_token]
        gaps = [r["pages"] for r in self.resumes]
        evict_steps = [s for s in steps if s["evict_blocks"]]
        return {
            "steps": len(steps), "step_s_total": round(total, 3), "mean_step_s": round(total / max(1, len(steps)), 4),
            "schedule_share": round(sched / total, 4),
            "evict_share": round(evict / total, 4), "evict_blocks": sum(s["evict_blocks"] for s in steps),
            "evict_steps": len(evict_steps),
            "evict_s_per_evict_step": round(evict / max(1, len(evict_steps)), 4),
            "evict_s_per_block_us": round(1e6 * evict / max(1, sum(s["evict_blocks"] for s in steps)), 2),
            "inline_share": round(inline / total, 4),
            "preemptions": len(self.preempts), "preempted_decodes": sum(p["decode"] for p in self.preempts),
            "preemptions_per_step": dict(sorted(per_step.items())),
            "thrash": len(thrash), "thrash_steps": thrash_steps,
            "thrash_decodes": sum(p["decode"] for p in thrash),
            "resumes": len(self.resumes), "resumes_loading": sum(r["how"] == "loading" for r in self.resumes),
            "resume_pages_median": statistics.median(gaps) if gaps else None,
            "tpot_p99_s": p99, "requests_with_tpot": len(tpot),
            "tpot_median_preempted_s": statistics.median(preempted_tpot) if preempted_tpot else None,
            "tpot_median_not_preempted_s": statistics.median(clean_tpot) if clean_tpot else None,
            "preempted_after_first_requests": len(preempted_tpot),
            "p99_set": [row(s) for s in tail], "slowest_tpot": [row(s) for s in top],
            "mean_decodes_per_step": round(statistics.mean(s["decodes"] for s in steps), 2) if steps else None,
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--config", default="tiered")
    ap.add_argument("--preemption-mode", default="swap")
    ap.add_argument("--admission-watermark", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sim", action="store_true", help="in the simulator with perf/results/sim_agreement.json's costs")
    ap.add_argument("--thrash-steps", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    opts = BenchOptions(trace=args.trace, sessions=args.sessions, concurrency=args.concurrency, configs=args.config,
                        preemption_mode=args.preemption_mode, admission_watermark=args.admission_watermark,
                        seed=args.seed)
    probe = Probe()
    probe.install()
    if args.sim:
        sys.path.insert(0, str(HERE))
        from sim_tail import load_costs
        from kvtier.sim.calibrate import simulate_bench
        runs = [r.run for r in simulate_bench(opts, load_costs(str(HERE / "results" / "sim_agreement.json")))]
    else:
        runs = run_all(opts)[2]
    out = probe.report(args.thrash_steps)
    out["throughput_tok_s"] = round(sum(r.output_tokens for r in runs[0].records) / runs[0].wall_s, 1)
    out["options"] = vars(args)
    print(json.dumps({k: v for k, v in out.items() if k not in ("slowest_tpot",)}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
