"""Replay real agent sessions against ``kvtier serve`` with the public agent benchmarks' clients.

Two clients replay kv-cache-tester traces (``--client``):

- ``kv-cache-tester``: its own ``trace_replay_tester.py``, the client of the InferenceX AgentX,
  ATOM, vLLM and SGLang HiCache agent tables. It is not part of this repository: fetch it at its
  pinned commit first (``bash scripts/fetch_kv_cache_tester.sh DIR``, needs GitHub and PyPI).
- ``agentx``: the AgentX harness (PyPI ``agentx-harness``, built on AIPerf), whose ``aiperf
  profile --custom-dataset-type weka_trace`` loader replays the same trace files
  (``bash scripts/setup_agentx.sh`` makes ``.agentx-venv/``). It is given a bounded copy of the
  traces (:func:`bounded_traces`: token lengths and the hash block size scaled by
  ``--token-scale``, so every prefix the trace shares is still shared; each trace cut before
  its first request over ``--max-context``), since its own context filter drops whole traces.

For each configuration (device-only, host tier) this script:

- writes a tiny random checkpoint (context: twice ``--max-context``, at least 8K);
- builds a local Hugging Face tokenizer directory with the ``tokenizers`` library (the clients
  use a tokenizer only to generate filler text; the server tokenizes with the Kimi tokenizer);
- starts ``kvtier serve`` on 127.0.0.1 with a small device KV budget, runs a bounded replay
  (a few users, ``--max-context``, ``--duration`` seconds), and stops the server by its PID;
- reads the client's results (errors, TTFT, the cache hit rate it reports) and the server's
  ``/metrics`` (prompt tokens served from each tier).

Usage::

    bash scripts/fetch_kv_cache_tester.sh /tmp/kv-cache-tester
    python perf/kv_cache_tester_replay.py --tester /tmp/kv-cache-tester --json out.json
    bash scripts/setup_agentx.sh
    python perf/kv_cache_tester_replay.py --client agentx --json out.json

Exits 1 when any request failed.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import stop_process_group  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
CONFIGS = {"device-only": [], "host": ["--host-cache-bytes", str(2 << 30)]}
CLIENTS = ("kv-cache-tester", "agentx")


def bounded_traces(src: Path, dst: Path, *, token_scale: float, max_context: int, num_traces: int,
                   time_scale: float = 1.0) -> list[Path]:
    """Write ``num_traces`` kv-cache-tester traces of ``src`` (``*.json`` / ``*.json.gz``, in
    name order) to ``dst`` as ``*.json``, scaled and cut to bounded size.

    Every request's ``in`` and ``out`` token counts and the trace's ``block_size``,
    ``tool_tokens`` and ``system_tokens`` are multiplied by ``token_scale`` (rounded up, at
    least 1) and the ``hash_ids`` kept, so a hash block stands for ``block_size * token_scale``
    tokens and the trace's shared prefixes stay shared. A trace stops before its first request
    with more than ``max_context`` scaled input tokens; sub-agent entries are left out (their
    requests have their own timelines); a trace left without requests is skipped. Request times
    (``t``, ``think_time``, ``api_time``, seconds) are multiplied by ``time_scale``.

    Raises:
        ValueError: ``token_scale`` not in (0, 1] with a whole scaled block size, ``max_context``
            or ``num_traces`` < 1, or fewer than ``num_traces`` traces of ``src`` fit.
    """
    if num_traces < 1 or max_context < 1:
        raise ValueError(f"num_traces and max_context must be >= 1, got {num_traces}, {max_context}")
    if not 0 < token_scale <= 1:
        raise ValueError(f"token_scale must be in (0, 1], got {token_scale}")
    if not time_scale > 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    from kvtier.bench.workload.traces import read_json
    dst.mkdir(parents=True, exist_ok=True)
    scaled = lambda n: max(1, math.ceil(n * token_scale))  # noqa: E731
    written = []
    for path in sorted(src.glob("*.json")) + sorted(src.glob("*.json.gz")):
        trace = read_json(path)
        block = trace["block_size"] * token_scale
        if block != int(block):
            raise ValueError(f"token_scale: {token_scale} x block_size {trace['block_size']} of {path.name} "
                             "is not a whole number of tokens")
        requests = []
        for r in trace["requests"]:
            if r.get("type") == "subagent":
                continue
            r = dict(r, **{"in": scaled(r["in"]), "out": scaled(r["out"])})
            for key in ("t", "think_time", "api_time"):
                if r.get(key) is not None:
                    r[key] = r[key] * time_scale
            if r["in"] > max_context:
                break
            requests.append(r)
        if not requests:
            continue
        trace = dict(trace, block_size=int(block), tool_tokens=int(trace.get("tool_tokens", 0) * token_scale),
                     system_tokens=int(trace.get("system_tokens", 0) * token_scale), requests=requests)
        trace.pop("totals", None)  # the original's sums
        out = dst / (path.name.removesuffix(".gz") if path.name.endswith(".gz") else path.name)
        out.write_text(json.dumps(trace))
        written.append(out)
        if len(written) == num_traces:
            return written
    raise ValueError(f"num_traces: only {len(written)} traces of {src} have a first request within "
                     f"max_context={max_context} scaled tokens, asked for {num_traces}")


def write_hf_tokenizer(path: Path) -> Path:
    """A small byte-level BPE tokenizer directory that ``AutoTokenizer.from_pretrained`` loads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["def handler(request):\n    return {'status': 200}\n", "Read the file, then run the tests.",
              "import os\nprint(os.listdir('.'))\n"] * 32
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=512, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1_000_000}))
    return path


def write_checkpoint(path: Path, max_context: int) -> Path:
    from kvtier.model import create_random_checkpoint
    from kvtier.model.config import preset

    cfg = dataclasses.replace(preset("tiny"), max_position_embeddings=max(8192, 2 * max_context))
    return Path(create_random_checkpoint(path, cfg, seed=0))


def start_server(model: Path, tokenizer: Path, extra: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """``kvtier serve`` on a free 127.0.0.1 port; returns the process and its base URL."""
    cmd = [sys.executable, "-m", "kvtier.cli", "serve", str(model), "--tokenizer", str(tokenizer),
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", "0", *extra]
    with open(log, "w") as err:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                raise RuntimeError(f"kvtier serve exited with {proc.returncode}; see {log}")
            continue
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            return proc, m.group(1)
    stop_process_group(proc)
    raise RuntimeError(f"kvtier serve did not start within 300 s; see {log}")


def scrape(url: str) -> dict[str, float]:
    """The server's /metrics samples (name{labels} -> value), without the ``_created`` series."""
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "_created" not in line:
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def server_figures(metrics: dict[str, float]) -> dict:
    """From the server's /metrics samples: prompt tokens, prompt tokens served from each tier
    (hits count again for a re-admitted request) and responses other than HTTP 200."""
    return {
        "prompt_tokens": metrics.get("kvtier_prompt_tokens_total", 0.0),
        "hit_tokens": {t: metrics.get(f'kvtier_hit_tokens_total{{tier="{t}"}}', 0.0) for t in ("device", "host", "disk")},
        "http_errors": sum(v for k, v in metrics.items()
                           if k.startswith("kvtier_requests_total") and 'status="200"' not in k),
    }


def summarize(results_csv: Path, metrics: dict[str, float]) -> dict:
    """trace_replay_tester.py's ``detailed_results.csv``: requests, errors, TTFT and the hit
    rate it computes from the trace, with :func:`server_figures`."""
    rows = []
    if results_csv.is_file():
        with open(results_csv) as f:
            rows = list(csv.DictReader(f))
    ok = [r for r in rows if r["success"] == "True"]
    ttft = [float(r["ttft"]) for r in ok]
    hits = sum(int(r["cache_hit_blocks"]) for r in ok)
    misses = sum(int(r["cache_miss_blocks"]) for r in ok)
    return {
        "requests": len(rows), "errors": len(rows) - len(ok),
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p95_s": percentile(ttft, 0.95),
        "client_cache_hit_rate": hits / (hits + misses) if hits + misses else 0.0, **server_figures(metrics),
    }


def summarize_agentx(export: Path, metrics: dict[str, float]) -> dict:
    """The AIPerf export's requests, errors, TTFT and the cache hit rate it reports (the usage's
    cached prompt tokens over its prompt tokens), with :func:`server_figures`."""
    d = json.loads(export.read_text()) if export.is_file() else {}
    stat = lambda key, field="avg": (d.get(key) or {}).get(field, 0.0)  # noqa: E731
    ok = int(stat("request_count"))
    errors = int(stat("error_request_count"))
    read, prompt = stat("usage_prompt_cache_read_tokens", "sum"), stat("usage_prompt_tokens", "sum")
    return {
        "requests": ok + errors, "errors": errors,
        "ttft_p50_s": stat("time_to_first_token", "p50") / 1e3, "ttft_p95_s": stat("time_to_first_token", "p95") / 1e3,
        "client_cache_hit_rate": read / prompt if prompt else 0.0, **server_figures(metrics),
    }


def agentx_command(args, url: str, traces: Path, hf_tok: Path, out_dir: Path) -> list[str]:
    """``aiperf profile`` replaying ``traces`` with the weka_trace loader, streamed, ``--users``
    at a time for ``--duration`` seconds, counting tokens as the server reports them."""
    return [args.aiperf, "profile", "--model", "tiny", "--url", url, "--endpoint-type", "chat", "--streaming",
            "--custom-dataset-type", "weka_trace", "--input-file", str(traces), "--tokenizer", str(hf_tok),
            "--concurrency", str(args.users), "--benchmark-duration", str(args.duration),
            "--extra-inputs", "ignore_eos:true", "--use-server-token-count", "--random-seed", str(args.seed),
            "--no-gpu-telemetry", "--ui-type", "none", "--output-artifact-dir", str(out_dir)]


def run_config(name: str, args, work: Path, model: Path, hf_tok: Path, traces: Path) -> dict:
    server_args = ["--num-device-pages", str(args.num_device_pages), *CONFIGS[name]]
    proc, url = start_server(model, args.tokenizer, server_args, work / f"serve-{name}.log")
    out_dir = work / f"out-{name}"
    if args.client == "agentx":
        cmd, cwd, results = agentx_command(args, url, traces, hf_tok, out_dir), work, out_dir / "profile_export_aiperf.json"
        label, summarize_results = "aiperf profile", summarize_agentx
    else:
        cmd = [args.python, str(args.tester / "trace_replay_tester.py"), "--api-endpoint", url,
               "--trace-directory", str(traces), "--output-dir", str(out_dir), "--tokenizer", str(hf_tok),
               "--start-users", str(args.users), "--max-users", str(args.users),
               "--max-context", str(args.max_context), "--test-duration", str(args.duration),
               "--time-scale", str(args.time_scale), "--max-delay", "5", "--seed", str(args.seed),
               "--skip-graphs", "--no-color"]
        cwd, results, label, summarize_results = args.tester, out_dir / "detailed_results.csv", "trace_replay_tester.py", summarize
    try:
        client = subprocess.run(cmd, check=False, cwd=cwd, capture_output=True, text=True, timeout=args.duration + 600)
        (work / f"client-{name}.log").write_text(client.stdout + client.stderr)
        if client.returncode != 0:
            raise RuntimeError(f"{label} exited with {client.returncode}; "
                               f"last lines:\n{(client.stdout + client.stderr)[-2000:]}")
        summary = summarize_results(results, scrape(url))
    finally:
        stop_process_group(proc)
    summary["server_args"] = server_args
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--client", choices=CLIENTS, default="kv-cache-tester")
    p.add_argument("--tester", type=Path, help="kv-cache-tester checkout (scripts/fetch_kv_cache_tester.sh)")
    p.add_argument("--python", help="python with kv-cache-tester's packages (default: TESTER/.venv/bin/python)")
    p.add_argument("--aiperf", default=str(ROOT / ".agentx-venv" / "bin" / "aiperf"),
                   help="agentx: the harness's aiperf command (scripts/setup_agentx.sh)")
    p.add_argument("--traces", type=Path, default=SHARED / "traces" / "kv-cache-tester")
    p.add_argument("--tokenizer", type=Path, default=SHARED / "kimi_tokenizer", help="Kimi tokenizer files")
    p.add_argument("--configs", default="device-only,host")
    p.add_argument("--users", type=int, help="sessions at a time (default 2; agentx 4)")
    p.add_argument("--max-context", type=int,
                   help="largest first prompt of a trace (kv-cache-tester, default 24000), or the largest "
                        "scaled prompt a bounded trace keeps (agentx, default 3072)")
    p.add_argument("--duration", type=int, default=60, help="client: seconds of replay")
    p.add_argument("--time-scale", type=float, default=0.1, help="think-time (agentx: every time) scale")
    p.add_argument("--token-scale", type=float, default=1 / 8, help="agentx: token-length scale of the bounded traces")
    p.add_argument("--num-traces", type=int, default=8, help="agentx: traces in the bounded copy")
    p.add_argument("--num-device-pages", type=int,
                   help="server: device KV pages of 16 tokens (default 400; agentx 224)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path, help="write the summary here")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, client outputs)")
    args = p.parse_args(argv)
    agentx = args.client == "agentx"
    args.max_context = args.max_context or (3072 if agentx else 24000)
    args.num_device_pages = args.num_device_pages or (224 if agentx else 400)
    args.users = args.users or (4 if agentx else 2)
    if agentx:
        if not Path(args.aiperf).is_file():
            p.error(f"--aiperf: {args.aiperf} not found (run scripts/setup_agentx.sh)")
    else:
        if args.tester is None or not (args.tester / "trace_replay_tester.py").is_file():
            p.error(f"--tester: no trace_replay_tester.py in {args.tester} (run scripts/fetch_kv_cache_tester.sh)")
        args.python = args.python or str(args.tester / ".venv" / "bin" / "python")
    names = args.configs.split(",")
    for n in names:
        if n not in CONFIGS:
            p.error(f"--configs: unknown {n!r}, expected some of {sorted(CONFIGS)}")
    work = Path(tempfile.mkdtemp(prefix="kvct-"))
    try:
        traces = work / "traces"
        if agentx:
            bounded_traces(args.traces, traces, token_scale=args.token_scale, max_context=args.max_context,
                           num_traces=args.num_traces, time_scale=args.time_scale)
        else:
            traces.mkdir()
            for f in sorted(args.traces.glob("*.json")):
                shutil.copy(f, traces / f.name)
        model = write_checkpoint(work / "model", args.max_context)
        hf_tok = write_hf_tokenizer(work / "hf-tokenizer")
        results = {n: run_config(n, args, work, model, hf_tok, traces) for n in names}
    finally:
        if args.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{'config':<12} {'requests':>8} {'errors':>6} {'TTFT p50':>9} {'TTFT p95':>9} "
          f"{'client hit':>10} {'device/host/disk hit tokens':>28}")
    for n, r in results.items():
        h = r["hit_tokens"]
        print(f"{n:<12} {r['requests']:>8} {r['errors']:>6} {r['ttft_p50_s']:>8.2f}s {r['ttft_p95_s']:>8.2f}s "
              f"{r['client_cache_hit_rate']:>10.1%} {int(h['device']):>14,}/{int(h['host']):,}/{int(h['disk']):,}")
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "client": args.client, "results": results},
                                        indent=1))
    return 1 if any(r["errors"] or r["http_errors"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
