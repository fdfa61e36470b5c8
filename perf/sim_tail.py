"""Re-enact a CPU ``kvtier bench`` run in the simulator, to try admission policies in about a
minute per configuration instead of a real run's several.

The simulator runs the real scheduler and pool (``Engine.begin_step``/``end_step``) with a step
timer and copy links fitted on this CPU: the ``costs`` of a ``perf/sim_agreement.py --out`` file
(default ``perf/results/sim_agreement.json``, whose run put simulated / real p99 TTFT at 1.14
for device-only and 1.01 for tiered). It leaves out what the fit does not see, e.g. the copy
threads' share of the cores, so a policy it favours still needs a real run to confirm. Prints
what ``perf/tail_report.py`` prints for a real run.

    python perf/sim_tail.py --trace ../shared/traces/kv-cache-tester --sessions 32 --concurrency 16
    python perf/sim_tail.py --sessions 16 --configs tiered --schedule-policy fcfs --json out.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from kvtier.sim.calibrate import CpuCosts, LinearTimer, simulate_bench
from kvtier.bench.report import bench_json
from kvtier.bench.run import BenchOptions
from kvtier.sim.hardware import Link
from kvtier.provenance import provenance
from kvtier.serve.config import ADMISSION_WATERMARK

HERE = pathlib.Path(__file__).resolve().parent


def load_costs(path: str) -> CpuCosts:
    """The ``costs`` of a ``perf/sim_agreement.py --out`` file.

    Raises:
        SystemExit: the file has no ``costs`` table.
    """
    with open(path) as f:
        doc = json.load(f)
    if "costs" not in doc:
        raise SystemExit(f"--costs {path}: no 'costs' table; expected a file written by perf/sim_agreement.py --out")
    c = doc["costs"]
    return CpuCosts(LinearTimer(c["coefficients"], source=path), Link(**c["host"]), Link(**c["disk"]),
                    c["steps"], c["fit_rel_error"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--costs", default=str(HERE / "results" / "sim_agreement.json"))
    ap.add_argument("--trace", help="a trace directory (default: the built-in workload)")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--configs", default="device-only,tiered")
    ap.add_argument("--schedule-policy", default="cache-aware")
    ap.add_argument("--preemption-mode", default="swap", help="swap or recompute (EngineConfig.preemption_mode)")
    ap.add_argument("--admission-watermark", type=float, default=ADMISSION_WATERMARK,
                    help="share of device pages a new request leaves free (EngineConfig.admission_watermark)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slowest", type=int, default=5)
    ap.add_argument("--json", help="write the run here, records included (perf/tail_report.py reads it)")
    args = ap.parse_args()
    opts = BenchOptions(trace=args.trace, sessions=args.sessions, concurrency=args.concurrency,
                        configs=args.configs, schedule_policy=args.schedule_policy, seed=args.seed,
                        preemption_mode=args.preemption_mode, admission_watermark=args.admission_watermark)
    runs = [r.run for r in simulate_bench(opts, load_costs(args.costs))]
    doc = bench_json(runs, provenance(simulated=True, options=vars(args)), records=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    sys.path.insert(0, str(HERE))
    from tail_report import report
    report(doc, args.slowest)


if __name__ == "__main__":
    main()
