"""vLLM alone, vLLM + its OffloadingConnector and vLLM + kvtier's connector (host tier; host and
disk tiers) on the same workloads, side by side (a benchmark, not a timed test).

Method. One random standard-attention Llama checkpoint (``--preset standard``: 12 layers, hidden
768, 12 query and 2 KV heads of 64, fp32; ``tests/integrations/vllm_checkpoint.py``), written
once; vLLM 0.32 CPU prefix-caches it. vLLM's OpenAI server is started once per (workload, repeat,
configuration), one at a time, on 127.0.0.1 and stopped by PID, each with the same device KV
budget (``--num-gpu-blocks-override``), block size and prefix caching on, and the same CPU cores:
``VLLM_CPU_NUM_OF_RESERVED_CPU`` is set to ``--reserved-cpus`` (default 1) for every server. Left
to itself, vLLM-CPU reserves one core for its scheduler process and one more whenever a KV
connector is configured (``vllm/utils/ompmultiprocessing.py``); on a 2-core machine the second
reservation leaves no core to compute on, so vLLM gives up reserving and a connector's worker
computes on both cores while vLLM alone computes on one. That alone made any connector look about
2x faster in p99 TTFT than vLLM alone.

* ``vllm``: vLLM alone (its prefix cache in the device blocks only);
* ``vllm+offloading``: vLLM's own OffloadingConnector (``--kv-offloading-size`` GiB); where vLLM
  refuses it, its exact error is the row (tried once per workload);
* ``vllm+kvtier-host``: ``KvtierConnector`` with a host tier that holds the working set, default
  cost model (its prefill rate probed at start, then learned from vLLM's steps);
* ``vllm+kvtier-disk``: the same with a host tier of a quarter of that and a disk tier (a fresh
  directory per run);
* ``vllm-ideal``: the bound, vLLM alone with device blocks for the whole working set (every block
  the replay ever caches, :func:`kvtier.bench.closed_loop.whole_working_set_pages` of the same
  workload draw at vLLM's block size, and ``VLLM_CPU_KVCACHE_SPACE`` raised to hold them): no
  eviction, no preemption for lack of blocks; the table gives each configuration's distance to it
  (p99 TTFT and throughput / the bound's) beside its ratio to vLLM alone;
* ``vllm+kvtier-recompute-free``: ``vllm+kvtier-host`` with the cost model's prefill rate fixed
  at 10^12 tokens/s (``prefill_tok_s``): recomputing is free, so the connector loads nothing and
  only saves; what the connector costs vLLM when it cannot help (not in the default ``--configs``).

Workloads: ``builtin`` (``kvtier bench``'s generator) and ``trace`` (``--sessions`` sessions
sampled from the kv-cache-tester traces in ``--trace``), each replayed by ``kvtier bench
--endpoint URL --seed r`` for repeats r = 0, 1, 2 (streamed; TTFT from when a turn was due),
sized so that the working set is at least 4x vLLM's device blocks (printed). The figures are that
command's own: p50/p99 TTFT, throughput (prompt + output tokens / wall), hit rate (vLLM's
``prompt_tokens_details.cached_tokens`` / prompt tokens: device prefix hits and connector loads
together); the table gives each figure's median over the repeats with its min-max.

Before the runs, the model is checked against the workload (``calibration`` in the JSON): the
cold prefill of a prompt of the built-in workload's median length on vLLM alone, and the same
prompt served from kvtier's host tier end to end (sent, pushed out of vLLM's device blocks by
other prompts, sent again: lookup, asynchronous load, bookkeeping and the last partial block);
the first should be >= 200 ms and >= 10x the second, or caching cannot show.

Usage::

    python perf/vllm_connector_bench.py --json perf/results/vllm_connector_bench.json

``--python`` (default ``$KVTIER_VLLM_PYTHON``, else ``.vllm-venv/bin/python``) is the interpreter
with vLLM (``KVTIER_WITH_VLLM=1 bash scripts/setup_vllm.sh`` makes it). Long on a 2-core machine:
``--workloads``, ``--repeats`` and ``--configs`` cut it down.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_process import ServerProcess, free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("vllm", "vllm+offloading", "vllm+kvtier-host", "vllm+kvtier-disk", "vllm-ideal")
BOUND = "vllm-ideal"
EXTRA_CONFIGS = ("vllm+kvtier-recompute-free",)
WORKLOADS = ("builtin", "trace")
MODEL_NAME = "bench-llama"
VOCAB = 32000  # kvtier bench's token-id prompts use ids below 32000 (kvtier.bench.endpoint.SAFE_VOCAB)
TRACES = Path("/work/shared/traces/kv-cache-tester")


def workload_args(args, workload: str) -> dict:
    """Per-workload settings: the ``kvtier bench`` flags, device blocks, model length, host bytes."""
    if workload == "builtin":
        return {"flags": ["--sessions", str(args.sessions), "--max-turns", str(args.max_turns),
                          "--token-scale", str(args.token_scale)],
                "device_blocks": args.device_blocks, "max_model_len": args.max_model_len,
                "host_bytes": int(args.host_gib * (1 << 30))}
    return {"flags": ["--trace", str(args.trace), "--sessions", str(args.trace_sessions), "--max-turns",
                      str(args.trace_max_turns), "--token-scale", str(args.trace_token_scale)],
            "device_blocks": args.trace_device_blocks, "max_model_len": args.trace_max_model_len,
            "host_bytes": int(args.trace_host_gib * (1 << 30))}


def whole_working_set_blocks(args, w: dict, seed: int) -> int:
    """vLLM device blocks that hold every block the replay of ``w``'s workload with ``seed`` ever
    caches (the ``vllm-ideal`` bound): the same draw ``kvtier bench --endpoint --seed`` replays
    (its flags parsed by the CLI's own parser), at ``--block-size`` tokens per block."""
    from kvtier.bench.closed_loop import whole_working_set_pages
    from kvtier.bench.run import BenchOptions, load_workload
    from kvtier.cli import build_parser

    a = build_parser().parse_args(["bench", *w["flags"], "--concurrency", str(args.concurrency), "--time-scale",
                                   str(args.time_scale), "--seed", str(seed)])
    opts = BenchOptions(trace=a.trace, sessions=a.sessions, concurrency=a.concurrency, token_scale=a.token_scale,
                        time_scale=a.time_scale, max_think_s=a.max_think_s, max_turns=a.max_turns or None,
                        seed=a.seed, configs="device-only")
    workload = load_workload(opts, w["max_model_len"])
    return whole_working_set_pages(workload, args.block_size, args.concurrency)


def kv_cache_gib(model: Path, blocks: int, block_size: int) -> int:
    """GiB of ``VLLM_CPU_KVCACHE_SPACE`` for ``blocks`` blocks of ``model`` (K and V of every
    layer and KV head, fp32, as the servers here run it), rounded up, plus 1, at least 2."""
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    block_bytes = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * block_size * 4
    return max(2, -(-blocks * block_bytes // (1 << 30)) + 1)


def server_args(args, config: str, model: Path, port: int, stats_path: Path, w: dict, disk_dir: Path) -> list[str]:
    """The vLLM command line of ``config`` (see the module docstring)."""
    cmd = [args.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--block-size", str(args.block_size), "--num-gpu-blocks-override", str(w["device_blocks"]),
           "--max-model-len", str(w["max_model_len"]), "--enable-prefix-caching", "--enable-prompt-tokens-details",
           "--enforce-eager", "--seed", "0"]
    if config == "vllm+offloading":
        cmd += ["--kv-offloading-size", str(w["host_bytes"] / (1 << 30))]
    elif config.startswith("vllm+kvtier"):
        extra = {"host_cache_bytes": w["host_bytes"], "stats_path": str(stats_path)}
        if config == "vllm+kvtier-recompute-free":
            extra["prefill_tok_s"] = 1e12
        if config == "vllm+kvtier-disk":
            extra |= {"host_cache_bytes": w["host_bytes"] // 4, "disk_cache_dir": str(disk_dir),
                      "disk_cache_bytes": 4 * w["host_bytes"]}
        cmd += ["--kv-transfer-config", json.dumps({
            "kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra})]
    return cmd


def bench_args(args, url: str, json_path: Path, w: dict, seed: int) -> list[str]:
    """The ``kvtier bench --endpoint`` command line (the same for every configuration)."""
    return [sys.executable, "-m", "kvtier.cli", "bench", "--endpoint", url, "--model", MODEL_NAME, *w["flags"],
            "--concurrency", str(args.concurrency), "--time-scale", str(args.time_scale), "--ramp-s",
            str(args.ramp_s), "--seed", str(seed), "--json", str(json_path), "--json-records", "--plot", ""]


class Server(ServerProcess):
    """One vLLM server of ``config`` for the ``with`` block."""

    def __init__(self, args, config: str, model: Path, work: Path, w: dict, tag: str):
        port = free_port()
        self.stats = work / f"{tag}.stats.json"
        disk = work / f"{tag}.disk"
        self.args = args
        self.kv_gib = kv_cache_gib(model, w["device_blocks"], args.block_size)
        env = {**os.environ, "PYTHONPATH": str(ROOT / "python"), "VLLM_CPU_KVCACHE_SPACE": str(self.kv_gib),
               "VLLM_CPU_NUM_OF_RESERVED_CPU": str(args.reserved_cpus)}
        super().__init__(server_args(args, config, model, port, self.stats, w, disk), port, work / f"{tag}.log", env,
                         args.start_timeout_s)

    def counters(self) -> dict | None:
        return json.loads(self.stats.read_text()) if self.stats.exists() else None


def run_once(args, config: str, model: Path, work: Path, workload: str, seed: int) -> dict:
    """Start vLLM as ``config`` says, replay ``workload`` with ``seed`` against it, stop it; the summary."""
    w = workload_args(args, workload)
    if config == BOUND:
        w = {**w, "device_blocks": whole_working_set_blocks(args, w, seed)}
    tag = f"{workload}-{seed}-{config}"
    out = work / f"{tag}.json"
    with Server(args, config, model, work, w, tag) as server:
        print(f"[{tag}] vLLM ready in {server.start_s:.0f} s; replaying", flush=True)
        r = subprocess.run(bench_args(args, server.url, out, w, seed), capture_output=True, text=True,
                           timeout=args.bench_timeout_s, env={**os.environ, "PYTHONPATH": str(ROOT / "python")},
                           check=False)
        if r.returncode != 0 or not out.exists():
            raise RuntimeError(f"kvtier bench exited with {r.returncode}:\n{(r.stdout + r.stderr)[-2000:]}")
        time.sleep(1.0)  # the worker writes its counters after its last step
        counters = server.counters()
    doc = json.loads(out.read_text())
    (summary,) = doc["configs"].values()
    records = summary.get("records", [])
    prompts = sorted(rec["input_tokens"] for rec in records)
    peaks: dict = {}  # each session's longest turn (prompt + output): what keeping it all needs
    for rec in records:
        peaks[rec["session_id"]] = max(peaks.get(rec["session_id"], 0), rec["input_tokens"] + rec.get("output_tokens", 0))
    row = {"server": " ".join(server.cmd[1:]), "start_s": round(server.start_s, 1),
           "workload": doc["provenance"]["workload"], "seed": seed,
           "ttft_p50_s": summary["ttft_s"]["p50"], "ttft_p99_s": summary["ttft_s"]["p99"],
           "throughput_tok_s": summary["throughput_tok_s"], "hit_rate": summary["hit_rate"]["total"],
           "requests": summary["requests"], "errors": summary["errors"], "input_tokens": summary["input_tokens"],
           "wall_s": summary["wall_s"], "median_prompt_tokens": prompts[len(prompts) // 2] if prompts else None,
           "working_set_blocks": sum(-(-p // args.block_size) for p in peaks.values()),
           "device_blocks": w["device_blocks"]}
    if counters is not None:
        row["kvtier_counters"] = counters
    return row


def _complete(url: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds until a 1-token completion of ``prompt`` (token ids) returns, and its cached tokens."""
    import httpx

    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1,
                                                   "temperature": 0}, timeout=600.0)
    r.raise_for_status()
    seconds = time.perf_counter() - t0
    details = (r.json().get("usage") or {}).get("prompt_tokens_details") or {}
    return seconds, int(details.get("cached_tokens") or 0)


def calibrate(args, model: Path, work: Path, prompt_tokens: int) -> dict:
    """Cold prefill of a ``prompt_tokens`` prompt on vLLM alone vs the same prompt served from
    kvtier's host tier end to end (median of 3 prompts each); see the module docstring."""
    import random

    w = workload_args(args, "builtin")
    rng = random.Random(1234)
    fresh = lambda: [rng.randrange(3, VOCAB) for _ in range(prompt_tokens)]  # noqa: E731
    flush_tokens = (w["device_blocks"] + 4) * args.block_size
    with Server(args, "vllm", model, work, w, "calibrate-vllm") as server:
        _complete(server.url, fresh())  # warm-up
        cold = [_complete(server.url, fresh())[0] for _ in range(3)]
    hits, cached = [], []
    with Server(args, "vllm+kvtier-host", model, work, w, "calibrate-kvtier") as server:
        _complete(server.url, fresh())
        for _ in range(3):
            prompt = fresh()
            _complete(server.url, prompt)
            left = flush_tokens
            while left > 0:  # other prompts push it out of vLLM's device blocks
                n = min(left, w["max_model_len"] - 8)
                _complete(server.url, [rng.randrange(3, VOCAB) for _ in range(n)])
                left -= n
            seconds, got = _complete(server.url, prompt)
            hits.append(seconds)
            cached.append(got)
        counters = server.counters()
    cold_s, host_s = statistics.median(cold), statistics.median(hits)
    jobs = (counters or {}).get("load_jobs") or 0
    load_s = counters["load_s"] / jobs if jobs else None  # the connector's own load of one prompt
    return {"prompt_tokens": prompt_tokens, "cold_prefill_s": cold, "host_served_s": hits, "cached_tokens": cached,
            "cold_prefill_median_s": cold_s, "host_served_median_s": host_s, "ratio_request": cold_s / host_s,
            "connector_load_s": load_s, "ratio": cold_s / load_s if load_s else None,
            "ok_200ms": cold_s >= 0.2, "ok_10x": bool(load_s) and cold_s >= 10 * load_s, "kvtier_counters": counters}


FIGURES = (("ttft_p50_s", 1e3, "{:.0f}"), ("ttft_p99_s", 1e3, "{:.0f}"), ("throughput_tok_s", 1.0, "{:.0f}"),
           ("hit_rate", 100.0, "{:.1f}"))


def summarize(runs: list[dict]) -> dict:
    """Median and min-max over the repeats of each figure (:func:`kvtier.bench.repeat.spread`)."""
    from kvtier.bench.repeat import spread

    ok = [r for r in runs if "error" not in r]
    return {f: spread([r[f] for r in ok]) for f, _, _ in FIGURES} | {"repeats": len(ok)}


def _bound_ratio(summary: dict, bound: dict, figure: str) -> str:
    """Median of ``figure`` over the bound's median, as ``0.00x``; '' when either is missing."""
    a, b = summary.get(figure), bound.get(figure)
    return f"{a['median'] / b['median']:.2f}x" if a and b and b["median"] else ""


def table(results: dict) -> str:
    from kvtier.bench.repeat import format_spread

    lines = ["| workload | config | p50 TTFT (ms) | p99 TTFT (ms) | throughput (tok/s) | hit rate (%) | p99 vs vLLM "
             "| p99 / bound | throughput / bound |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for workload, rows in results.items():
        base = rows.get("vllm", {}).get("summary", {}).get("ttft_p99_s")
        bound = rows.get(BOUND, {}).get("summary", {})
        for config, r in rows.items():
            if not r["runs"]:
                lines.append(f"| {workload} | {config} | failed: {(r.get('error') or 'no run').splitlines()[0][:140]} "
                         "| | | | | | |")
                continue
            cells = [format_spread(r["summary"][f], scale, fmt) for f, scale, fmt in FIGURES]
            p99 = r["summary"]["ttft_p99_s"]
            ratio = f"{p99['median'] / base['median']:.2f}x" if base and p99 and config != "vllm" else ""
            to_bound = [_bound_ratio(r["summary"], bound, f) if config != BOUND else ""
                        for f in ("ttft_p99_s", "throughput_tok_s")]
            lines.append(f"| {workload} | {config} | " + " | ".join(cells) + f" | {ratio} | " + " | ".join(to_bound) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", default=os.environ.get("KVTIER_VLLM_PYTHON", str(ROOT / ".vllm-venv" / "bin" / "python")),
                   help="interpreter with vLLM 0.32")
    p.add_argument("--preset", default="standard", help="the checkpoint (tests/integrations/vllm_checkpoint.py PRESETS)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {CONFIGS + EXTRA_CONFIGS}")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {WORKLOADS}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-calibrate", action="store_true", help="skip the cold-prefill vs host-load check")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--reserved-cpus", type=int, default=1,
                   help="VLLM_CPU_NUM_OF_RESERVED_CPU for every server, so that each computes on the same cores")
    p.add_argument("--time-scale", type=float, default=0.05)
    p.add_argument("--ramp-s", type=float, default=1.0)
    p.add_argument("--block-size", type=int, default=32,
                   help="vLLM's KV block size (tokens; vLLM's CPU attention needs a multiple of 32)")
    p.add_argument("--sessions", type=int, default=16, help="builtin: sessions")
    p.add_argument("--max-turns", type=int, default=6, help="builtin: turns per session")
    p.add_argument("--token-scale", type=float, default=1 / 64, help="builtin: token scale")
    p.add_argument("--device-blocks", type=int, default=56,
                   help="builtin: device KV blocks (--num-gpu-blocks-override): a quarter of the working set or less")
    p.add_argument("--max-model-len", type=int, default=1024, help="builtin: vLLM's --max-model-len")
    p.add_argument("--host-gib", type=float, default=0.25, help="builtin: kvtier's host tier (and offloading size)")
    p.add_argument("--trace", default=str(TRACES), help="trace: kv-cache-tester folder")
    p.add_argument("--trace-sessions", type=int, default=32)
    p.add_argument("--trace-max-turns", type=int, default=4)
    p.add_argument("--trace-token-scale", type=float, default=1 / 64)
    p.add_argument("--trace-device-blocks", type=int, default=160)
    p.add_argument("--trace-max-model-len", type=int, default=4608,
                   help="trace: vLLM's --max-model-len (below the device blocks' tokens: vLLM needs one block more)")
    p.add_argument("--trace-host-gib", type=float, default=1.0)
    p.add_argument("--start-timeout-s", type=float, default=900.0)
    p.add_argument("--bench-timeout-s", type=float, default=2400.0)
    p.add_argument("--json", default=str(ROOT / "perf" / "results" / "vllm_connector_bench.json"))
    args = p.parse_args()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    workloads = [c.strip() for c in args.workloads.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS + EXTRA_CONFIGS] + [w for w in workloads if w not in WORKLOADS]
    if bad or not configs or not workloads:
        p.error(f"unknown {bad}; --configs takes a subset of {CONFIGS + EXTRA_CONFIGS}, --workloads of {WORKLOADS}")
    if not Path(args.python).exists():
        p.error(f"--python {args.python!r} does not exist (KVTIER_WITH_VLLM=1 bash scripts/setup_vllm.sh makes it)")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the running server on the way out
    doc = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "options": vars(args), "results": {},
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def save() -> None:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")

    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-bench-") as tmp:
        work = Path(tmp)
        model = work / "model"
        subprocess.run([args.python, str(ROOT / "tests" / "integrations" / "vllm_checkpoint.py"), str(model),
                        str(VOCAB), args.preset], check=True, capture_output=True, timeout=600)
        for workload in workloads:
            rows: dict = {c: {"runs": []} for c in configs}
            doc["results"][workload] = rows
            for seed in range(args.repeats):
                for config in configs:
                    if config == "vllm+offloading" and seed > 0 and "error" in rows[config]:
                        continue
                    try:
                        rows[config]["runs"].append(run_once(args, config, model, work, workload, seed))
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        rows[config]["error"] = str(e)
                        print(f"[{workload}-{seed}-{config}] FAILED: {str(e)[-1500:]}", flush=True)
                    rows[config]["summary"] = summarize(rows[config]["runs"])
                    save()
            first = next((r["runs"][0] for r in rows.values() if r["runs"]), None)
            if first is not None:
                ws = first["working_set_blocks"]
                print(f"{workload}: {first['requests']} requests, median prompt {first['median_prompt_tokens']} tokens, "
                      f"working set {ws} blocks vs {first['device_blocks']} device blocks "
                      f"({(ws or 0) / first['device_blocks']:.1f}x)", flush=True)
            if workload != "builtin" or args.no_calibrate:
                continue
            runs = [r for c in rows.values() for r in c["runs"]]
            prompt = int(statistics.median([r["median_prompt_tokens"] for r in runs if r.get("median_prompt_tokens")]))
            try:
                doc["calibration"] = cal = calibrate(args, model, work, prompt)
                load = cal["connector_load_s"]
                print(f"calibration: cold prefill of a {prompt}-token prompt {1e3 * cal['cold_prefill_median_s']:.0f} ms "
                      f"(>= 200 ms: {cal['ok_200ms']}); the connector's own load of it from host memory "
                      f"{'n/a' if load is None else f'{1e3 * load:.1f} ms'} (>= 10x: {cal['ok_10x']}); the whole request "
                      f"served from the host tier {1e3 * cal['host_served_median_s']:.0f} ms "
                      f"({cal['ratio_request']:.1f}x)", flush=True)
            except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
                doc["calibration"] = {"error": str(e)}
                print(f"calibration FAILED: {e}", flush=True)
            save()
    doc["table"] = table(doc["results"])
    save()
    print(doc["table"])
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
