"""vLLM alone, vLLM + its OffloadingConnector and vLLM + kvtier's connector on the same workload (a
benchmark, not a timed test).

Method. One tiny random Llama checkpoint (2 layers, hidden 64, 2 KV heads of 32, fp32, a
32000-word vocabulary; ``tests/integrations/vllm_checkpoint.py``), written once. vLLM's OpenAI
server is started three ways, one at a time, on 127.0.0.1 (a free port) and stopped by PID, each
with the same device KV budget (``--num-gpu-blocks-override``: vLLM 0.32's CPU worker honours it
after sizing its cache from ``VLLM_CPU_KVCACHE_SPACE``), block size, prefix caching on:

* ``vllm``: vLLM alone (its prefix cache in the device blocks only);
* ``vllm+offloading``: vLLM's own OffloadingConnector, ``--kv-offloading-size`` GiB of host memory;
* ``vllm+kvtier``: ``KvtierConnector`` with a host tier of the same size (``host_cache_bytes``),
  no disk or remote tier, the default cost model settings.

Each replays the same built-in sessions (``kvtier bench --endpoint URL``: seeded generator,
streamed, TTFT from when a turn was due) and the figures are that command's own
(``kvtier bench --json``): p50/p99 TTFT, throughput (prompt + output tokens / wall), hit rate
(vLLM's ``prompt_tokens_details.cached_tokens`` / prompt tokens: device prefix-cache hits and
connector loads together). kvtier's worker counters (blocks loaded from its host tier) are added
for its configuration. One run per configuration on a shared CPU: compare within one run.

Usage::

    python perf/vllm_connector_bench.py --json perf/results/vllm_connector_bench.json

``--python`` (default ``$KVTIER_VLLM_PYTHON``, else ``.vllm-venv/bin/python``) is the interpreter
with vLLM (``KVTIER_WITH_VLLM=1 scripts/setup.sh`` makes it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import stop_process_group  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("vllm", "vllm+offloading", "vllm+kvtier")
MODEL_NAME = "tiny-llama"
VOCAB = 32000  # kvtier bench's token-id prompts use ids below 32000 (kvtier.bench.endpoint.SAFE_VOCAB)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_args(args, config: str, model: Path, port: int, stats_path: Path) -> list[str]:
    """The vLLM command line of ``config`` (see the module docstring)."""
    cmd = [args.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--block-size", str(args.block_size), "--num-gpu-blocks-override", str(args.device_blocks),
           "--max-model-len", str(args.max_model_len), "--enable-prefix-caching", "--enable-prompt-tokens-details",
           "--enforce-eager", "--seed", "0"]
    host_bytes = int(args.host_gib * (1 << 30))
    if config == "vllm+offloading":
        cmd += ["--kv-offloading-size", str(args.host_gib)]
    elif config == "vllm+kvtier":
        extra = {"host_cache_bytes": host_bytes, "stats_path": str(stats_path)}
        cmd += ["--kv-transfer-config", json.dumps({
            "kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra})]
    return cmd


def bench_args(args, url: str, json_path: Path) -> list[str]:
    """The ``kvtier bench --endpoint`` command line (the same for every configuration)."""
    return [sys.executable, "-m", "kvtier.cli", "bench", "--endpoint", url, "--model", MODEL_NAME,
            "--sessions", str(args.sessions), "--concurrency", str(args.concurrency), "--max-turns", str(args.max_turns),
            "--token-scale", str(args.token_scale), "--time-scale", str(args.time_scale), "--ramp-s", str(args.ramp_s),
            "--seed", "0", "--json", str(json_path), "--plot", ""]


def failure_reason(log: Path) -> str:
    """The root cause vLLM logged (a worker's or the engine's error), else its last lines."""
    text = log.read_text(errors="replace")
    found = re.findall(r"Worker failed with error '([^']+)'", text)
    if found:
        return found[-1]
    errors = [m for m in re.findall(r"\b(\w+(?:Error|Exception): .+)", text)
              if "Engine core initialization failed" not in m]
    return errors[-1].strip() if errors else text[-500:]


def wait_ready(proc: subprocess.Popen, port: int, log: Path, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}: {failure_reason(log)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"vLLM not ready after {timeout_s} s:\n{log.read_text()[-2000:]}")


def run_config(args, config: str, model: Path, work: Path) -> dict:
    """Start vLLM as ``config`` says, replay the workload against it, stop it; the summary."""
    port = _free_port()
    log, out, stats = work / f"{config}.log", work / f"{config}.json", work / f"{config}.stats.json"
    cmd = server_args(args, config, model, port, stats)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python"), "VLLM_CPU_KVCACHE_SPACE": "1"}
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_ready(proc, port, log, args.start_timeout_s)
        started = time.monotonic() - t0
        print(f"[{config}] vLLM ready in {started:.0f} s; replaying", flush=True)
        bench = bench_args(args, f"http://127.0.0.1:{port}", out)
        r = subprocess.run(bench, capture_output=True, text=True, timeout=args.bench_timeout_s,
                           env={**os.environ, "PYTHONPATH": str(ROOT / "python")}, check=False)
        if r.returncode != 0 or not out.exists():
            raise RuntimeError(f"kvtier bench exited with {r.returncode}:\n{(r.stdout + r.stderr)[-2000:]}")
    finally:
        stop_process_group(proc)
    doc = json.loads(out.read_text())
    (summary,) = doc["configs"].values()
    row = {"server": " ".join(cmd[1:]), "start_s": round(started, 1), "workload": doc["provenance"]["workload"],
           "ttft_p50_s": summary["ttft_s"]["p50"], "ttft_p99_s": summary["ttft_s"]["p99"],
           "throughput_tok_s": summary["throughput_tok_s"], "hit_rate": summary["hit_rate"]["total"],
           "requests": summary["requests"], "errors": summary["errors"], "input_tokens": summary["input_tokens"],
           "wall_s": summary["wall_s"]}
    if stats.exists():
        row["kvtier_counters"] = json.loads(stats.read_text())
    return row


def table(rows: dict) -> str:
    lines = ["| config | p50 TTFT (ms) | p99 TTFT (ms) | throughput (tok/s) | hit rate |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'].splitlines()[0][:100]} | | | |")
            continue
        lines.append(f"| {name} | {1e3 * r['ttft_p50_s']:.0f} | {1e3 * r['ttft_p99_s']:.0f} | "
                     f"{r['throughput_tok_s']:.0f} | {r['hit_rate']:.1%} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", default=os.environ.get("KVTIER_VLLM_PYTHON", str(ROOT / ".vllm-venv" / "bin" / "python")),
                   help="interpreter with vLLM 0.32")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {CONFIGS}")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--token-scale", type=float, default=1 / 64)
    p.add_argument("--time-scale", type=float, default=0.05)
    p.add_argument("--ramp-s", type=float, default=1.0)
    p.add_argument("--block-size", type=int, default=32,
                   help="vLLM's KV block size (tokens; vLLM's CPU attention needs a multiple of 32)")
    p.add_argument("--device-blocks", type=int, default=32,
                   help="device KV blocks (--num-gpu-blocks-override): below the sessions' working set")
    p.add_argument("--max-model-len", type=int, default=896)
    p.add_argument("--host-gib", type=float, default=0.0625,
                   help="host memory of the OffloadingConnector (--kv-offloading-size) and of kvtier's host tier")
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument("--bench-timeout-s", type=float, default=900.0)
    p.add_argument("--json", default=str(ROOT / "perf" / "results" / "vllm_connector_bench.json"))
    args = p.parse_args()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or not configs:
        p.error(f"--configs: unknown {bad}; expected a comma-separated subset of {CONFIGS}")
    if not Path(args.python).exists():
        p.error(f"--python {args.python!r} does not exist (KVTIER_WITH_VLLM=1 scripts/setup.sh makes .vllm-venv)")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the running server on the way out
    rows: dict = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-bench-") as tmp:
        work = Path(tmp)
        model = work / "model"
        subprocess.run([args.python, str(ROOT / "tests" / "integrations" / "vllm_checkpoint.py"), str(model),
                        str(VOCAB)], check=True, capture_output=True, timeout=600)
        for config in configs:
            try:
                rows[config] = run_config(args, config, model, work)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                rows[config] = {"error": str(e)}
                print(f"[{config}] FAILED: {str(e)[-1500:]}", flush=True)
    workload = next((r["workload"] for r in rows.values() if "workload" in r), None)
    doc = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
           "workload": workload, "options": vars(args), "device_blocks": args.device_blocks,
           "block_size": args.block_size, "host_bytes": int(args.host_gib * (1 << 30)), "configs": rows,
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    if workload:
        print(f"workload: built-in, {workload['sessions']} sessions, {workload['requests']} requests, "
              f"concurrency {args.concurrency}, token scale {args.token_scale:g}; device budget "
              f"{args.device_blocks} blocks of {args.block_size} tokens; host {args.host_gib:g} GiB")
    print(table(rows))
    print(f"wrote {args.json}")
    return 0 if all("error" not in r for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
