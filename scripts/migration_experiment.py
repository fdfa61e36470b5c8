"""The migration experiment with real processes: ``kvtier cluster`` (2 workers, tiny model) under
``sticky`` and ``kv-aware`` routing, with the Redis remote tier off and on, each replayed by
``kvtier bench --endpoint ROUTER_URL``; prints p99 TTFT and throughput per setup, the sessions
the router moved between workers and the machine's 1-minute load average (start and end of the
replay, averaged: on a shared machine it explains more of the spread than the setups do).

Usage: python scripts/migration_experiment.py --tokenizer DIR [--out DIR] [bench args...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx


def start_cluster(tokenizer: str, policy: str, store: str, log: Path, cluster_args: list[str]):
    cmd = [sys.executable, "-m", "kvtier.cli", "cluster", "tiny", "--tokenizer", tokenizer, "--workers", "2",
           "--store", store, "--policy", policy, "--port", "0", *cluster_args]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        m = re.search(rb"router: listening on (http://127\.0\.0\.1:\d+)", log.read_bytes())
        if m:
            return proc, m.group(1).decode()
        time.sleep(0.2)
    raise RuntimeError(f"cluster did not start: {log.read_text(errors='replace')[-2000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", default="migration-experiment")
    ap.add_argument("--cluster-args", default="--num-device-pages 400 --max-num-seqs 4 --host-cache-bytes 8388608",
                    help="kvtier cluster options for both workers")
    args, bench_args = ap.parse_known_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for policy in ("sticky", "kv-aware"):
        for store in ("none", "redis"):
            name = f"{policy}-remote-{'on' if store != 'none' else 'off'}"
            proc, url = start_cluster(args.tokenizer, policy, store, out / f"{name}.log", args.cluster_args.split())
            load0 = os.getloadavg()[0]
            try:
                subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "--endpoint", url, "--model", "tiny",
                                "--json", str(out / f"{name}.json"), "--plot", "", *bench_args], check=True)
                moves = httpx.get(f"{url}/health", timeout=30).json().get("session_moves")
            finally:
                os.kill(proc.pid, signal.SIGTERM)
                proc.wait(60)
            load = (load0 + os.getloadavg()[0]) / 2
            s = json.loads((out / f"{name}.json").read_text())
            summary = next(iter(s["configs"].values()))
            rows.append((policy, store != "none", summary["ttft_s"]["p99"], summary["ttft_s"]["p50"],
                         summary["throughput_tok_s"], summary["hit_rate"]["total"], summary["errors"], moves, load))
    print("| routing | remote tier | p99 TTFT (s) | p50 TTFT (s) | throughput (tok/s) | hit rate | errors "
          "| session moves | load average |")
    print("|---|---|---|---|---|---|---|---|---|")
    for policy, remote, p99, p50, tput, hit, errors, moves, load in rows:
        print(f"| {policy} | {'on' if remote else 'off'} | {p99:.3f} | {p50:.3f} | {tput:.1f} | {hit:.1%} | {errors} "
              f"| {moves} | {load:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
