"""Prefill/decode disaggregation against colocated serving on the built-in workload (a benchmark,
not a timed test).

Method. Two deployments of the same number of engine processes, each started on 127.0.0.1
(free ports) and stopped by PID:

* colocated: 2 ``kvtier serve tiny`` workers (``--role both``) behind ``kvtier router --workers``
  (kv-aware);
* disaggregated: 1 ``--role decode`` and 1 ``--role prefill`` worker behind ``kvtier router
  --prefill-workers ... --decode-workers ...``.

Each replays the same built-in sessions (``kvtier bench``'s generator, seeded) with the same
concurrency and think times, i.e. the same offered load, through
:func:`kvtier.bench.endpoint.replay_http` (streamed; TTFT from when a turn was due, TPOT over the
rest of its output). Reported: bytes each turn sent to the decode worker against what sending
the prompt's whole KV would have moved (``full_prompt_bytes``), and the reduction on returning
turns (a session's turns after its first); transfer time overlapped with prefill against exposed
after it; TTFT and TPOT p50/p99 of both deployments; each role's utilisation (engine busy
seconds / wall seconds, from ``kvtier_engine_busy_seconds``). No warm-up beyond each worker's own
start-up warm-up; one run per deployment; numbers on a shared CPU are noisy, so compare ratios
within one run.

Usage::

    python perf/disagg_bench.py --sessions 8 --concurrency 4 --max-turns 6 --json perf/results/disagg.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvtier.bench.endpoint import replay_http
from kvtier.bench.run import BenchOptions, load_workload
from kvtier.cluster.launch import WorkerProcess, spawn_worker, wait_worker

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT.parent / "shared" / "kimi_tokenizer"


def _busy_seconds(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "kvtier_engine_busy_seconds_total")


def _start(args: list[str], log: Path, model_args: list[str], procs: list[WorkerProcess]) -> WorkerProcess:
    w = wait_worker(spawn_worker("tiny", [*model_args, *args], log), log)
    procs.append(w)
    return w


def _start_router(args: list[str], log: Path, procs: list[WorkerProcess]) -> WorkerProcess:
    cmd = [sys.executable, "-m", "kvtier.cli", "router", "--port", "0", *args]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    w = wait_worker(proc, log, 60)
    procs.append(w)
    return w


def _pcts(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None}
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}


def _latencies(run) -> dict:
    ok = [r for r in run.records if r.error is None and r.first_token_s is not None and r.finish_s is not None]
    ttft = [r.first_token_s - r.arrival_s for r in ok]
    tpot = [(r.finish_s - r.first_token_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {"requests": len(run.records), "errors": sum(r.error is not None for r in run.records),
            "wall_s": run.wall_s, "ttft_s": _pcts(ttft), "tpot_s": _pcts(tpot)}


def _replay(url: str, workload, concurrency: int, ramp_s: float, vocab: int, on_response=None):
    return asyncio.run(replay_http(url, "tiny", workload, url, concurrency=concurrency, ramp_s=ramp_s,
                                   vocab_size=vocab, on_response=on_response))


def _transfer_summary(turns: list[tuple[int, dict | None]]) -> dict:
    def agg(rows):
        sent = sum(t["bytes_sent"] for _, t in rows)
        full = sum(t["full_prompt_bytes"] for _, t in rows)
        return {"turns": len(rows), "bytes_sent": sent, "full_prompt_bytes": full,
                "reduction": 1 - sent / full if full else None,
                "overlapped_s": sum(t["overlapped_s"] for _, t in rows),
                "exposed_s": sum(t["exposed_s"] for _, t in rows),
                "failed": sum(bool(t["failed"]) for _, t in rows)}
    rows = [(k, t) for k, t in turns if t is not None]
    return {"first_turns": agg([r for r in rows if r[0] == 0]), "returning_turns": agg([r for r in rows if r[0] > 0]),
            "missing_reports": sum(t is None for _, t in turns),
            "per_turn": [{"turn": k, "bytes_sent": t["bytes_sent"], "full_prompt_bytes": t["full_prompt_bytes"],
                          "blocks_held": t["blocks_held"], "blocks_sent": t["blocks_sent"]} for k, t in rows]}


def run(opts: argparse.Namespace) -> dict:
    bench = BenchOptions(sessions=opts.sessions, concurrency=opts.concurrency, max_turns=opts.max_turns,
                         seed=opts.seed)
    from kvtier.model.config import preset

    cfg = preset("tiny")
    workload = load_workload(bench, cfg.max_position_embeddings, None)
    model_args = ["--tokenizer", str(opts.tokenizer), "--dtype", "float32", "--page-size", "16",
                  "--num-device-pages", str(opts.num_device_pages), "--max-num-batched-tokens",
                  str(opts.max_num_batched_tokens), "--threads", "1"]
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-disagg-bench-"))
    print(f"logs in {workdir}; {workload.num_requests()} requests in {len(workload.sessions)} sessions", flush=True)
    procs: list[WorkerProcess] = []
    out = {"workload": {"sessions": len(workload.sessions), "requests": workload.num_requests(),
                        "concurrency": opts.concurrency, "max_turns": opts.max_turns, "seed": opts.seed}}
    try:
        a = [_start([], workdir / f"colocated-{i}.log", model_args, procs) for i in range(2)]
        r = _start_router(["--workers", ",".join(w.url for w in a)], workdir / "router-colocated.log", procs)
        busy0, t0 = [_busy_seconds(w.url) for w in a], time.perf_counter()
        colocated = _replay(r.url, workload, opts.concurrency, bench.ramp_s, cfg.vocab_size)
        wall = time.perf_counter() - t0
        out["colocated"] = {**_latencies(colocated), "utilisation": {
            "both": sum(_busy_seconds(w.url) - b for w, b in zip(a, busy0)) / (2 * wall)}}
        for w in reversed(procs):
            w.stop()
        procs.clear()
        d = _start(["--role", "decode"], workdir / "decode.log", model_args, procs)
        p = _start(["--role", "prefill", "--decode-workers", d.url], workdir / "prefill.log", model_args, procs)
        r = _start_router(["--prefill-workers", p.url, "--decode-workers", d.url], workdir / "router-pd.log", procs)
        turns: list[tuple[int, dict | None]] = []
        on_response = lambda rec, h: turns.append(  # noqa: E731
            (rec.turn, json.loads(h["x-kvtier-transfer"]) if h.get("x-kvtier-transfer") else None))
        busy0, t0 = [_busy_seconds(d.url), _busy_seconds(p.url)], time.perf_counter()
        disagg = _replay(r.url, workload, opts.concurrency, bench.ramp_s, cfg.vocab_size, on_response)
        wall = time.perf_counter() - t0
        out["disaggregated"] = {**_latencies(disagg), "utilisation": {
            "decode": (_busy_seconds(d.url) - busy0[0]) / wall, "prefill": (_busy_seconds(p.url) - busy0[1]) / wall},
            "router": httpx.get(f"{r.url}/health", timeout=30).json().get("pd")}
        out["transfer"] = _transfer_summary(turns)
    finally:
        for w in reversed(procs):
            w.stop()
    return out


def _print(out: dict) -> None:
    t = out["transfer"]
    for name in ("first_turns", "returning_turns"):
        g = t[name]
        red = "n/a" if g["reduction"] is None else f"{g['reduction']:.1%}"
        print(f"{name:16s} turns={g['turns']:3d} sent={g['bytes_sent'] / 1e6:8.2f} MB  whole-prompt="
              f"{g['full_prompt_bytes'] / 1e6:8.2f} MB  fewer bytes={red}  overlapped={g['overlapped_s']:.3f}s "
              f"exposed={g['exposed_s']:.3f}s  failed={g['failed']}")
    for name in ("colocated", "disaggregated"):
        o = out[name]
        util = ", ".join(f"{k} {v:.0%}" for k, v in o["utilisation"].items())
        print(f"{name:14s} requests={o['requests']} errors={o['errors']} wall={o['wall_s']:.1f}s  TTFT p50/p99="
              f"{o['ttft_s']['p50']:.3f}/{o['ttft_s']['p99']:.3f}s  TPOT p50/p99={o['tpot_s']['p50'] * 1e3:.1f}/"
              f"{o['tpot_s']['p99'] * 1e3:.1f} ms  utilisation: {util}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-turns", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-device-pages", type=int, default=2048)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--tokenizer", type=Path, default=TOKENIZER)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    opts = ap.parse_args()
    os.environ.setdefault("PYTHONPATH", str(ROOT / "python"))
    from kvtier.provenance import provenance

    out = run(opts)
    out["provenance"] = provenance(command=" ".join(["python", "perf/disagg_bench.py", *sys.argv[1:]]))
    _print(out)
    if opts.json is not None:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
