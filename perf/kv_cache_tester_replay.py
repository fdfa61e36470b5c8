"""Replay real agent sessions against ``kvtier serve`` with kv-cache-tester's ``trace_replay_tester.py``.

kv-cache-tester is the client of the public agent benchmarks (InferenceX AgentX and the ATOM,
vLLM and SGLang HiCache agent tables). It is not part of this repository: fetch it at its pinned
commit first (``bash scripts/fetch_kv_cache_tester.sh DIR``, needs GitHub and PyPI).

For each configuration (device-only, host tier) this script:

- writes a tiny random checkpoint with a 32K context (the traces start at 17-21K tokens);
- builds a local Hugging Face tokenizer directory with the ``tokenizers`` library (the client
  uses a tokenizer only to generate filler text; the server tokenizes with the Kimi tokenizer);
- copies the ``*.json`` traces of ``--traces`` into a temporary directory;
- starts ``kvtier serve`` on 127.0.0.1 with a small device KV budget, runs a bounded replay
  (a few users, ``--max-context``, ``--duration`` seconds), and stops the server by its PID;
- reads the client's ``detailed_results.csv`` (errors, TTFT, its workload cache hit rate) and the
  server's ``/metrics`` (prompt tokens served from each tier).

Usage::

    bash scripts/fetch_kv_cache_tester.sh /tmp/kv-cache-tester
    python perf/kv_cache_tester_replay.py --tester /tmp/kv-cache-tester --json out.json

Exits 1 when any request failed.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
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


def summarize(results_csv: Path, metrics: dict[str, float]) -> dict:
    rows = []
    if results_csv.is_file():
        with open(results_csv) as f:
            rows = list(csv.DictReader(f))
    ok = [r for r in rows if r["success"] == "True"]
    ttft = [float(r["ttft"]) for r in ok]
    hits = sum(int(r["cache_hit_blocks"]) for r in ok)
    misses = sum(int(r["cache_miss_blocks"]) for r in ok)
    prompt = metrics.get("kvtier_prompt_tokens_total", 0.0)
    tiers = {t: metrics.get(f'kvtier_hit_tokens_total{{tier="{t}"}}', 0.0) for t in ("device", "host", "disk")}
    return {
        "requests": len(rows), "errors": len(rows) - len(ok),
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p95_s": percentile(ttft, 0.95),
        "client_cache_hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        "prompt_tokens": prompt, "hit_tokens": tiers,  # hits count again for a re-admitted request
        "http_errors": sum(v for k, v in metrics.items()
                           if k.startswith("kvtier_requests_total") and 'status="200"' not in k),
    }


def run_config(name: str, args, work: Path, model: Path, hf_tok: Path, traces: Path) -> dict:
    server_args = ["--num-device-pages", str(args.num_device_pages), *CONFIGS[name]]
    proc, url = start_server(model, args.tokenizer, server_args, work / f"serve-{name}.log")
    out_dir = work / f"out-{name}"
    try:
        cmd = [args.python, str(args.tester / "trace_replay_tester.py"), "--api-endpoint", url,
               "--trace-directory", str(traces), "--output-dir", str(out_dir), "--tokenizer", str(hf_tok),
               "--start-users", str(args.users), "--max-users", str(args.users),
               "--max-context", str(args.max_context), "--test-duration", str(args.duration),
               "--time-scale", str(args.time_scale), "--max-delay", "5", "--seed", str(args.seed),
               "--skip-graphs", "--no-color"]
        client = subprocess.run(cmd, check=False, cwd=args.tester, capture_output=True, text=True, timeout=args.duration + 600)
        (work / f"client-{name}.log").write_text(client.stdout + client.stderr)
        if client.returncode != 0:
            raise RuntimeError(f"trace_replay_tester.py exited with {client.returncode}; "
                               f"last lines:\n{(client.stdout + client.stderr)[-2000:]}")
        summary = summarize(out_dir / "detailed_results.csv", scrape(url))
    finally:
        stop_process_group(proc)
    summary["server_args"] = server_args
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tester", type=Path, required=True, help="kv-cache-tester checkout (scripts/fetch_kv_cache_tester.sh)")
    p.add_argument("--python", help="python with the client's packages (default: TESTER/.venv/bin/python)")
    p.add_argument("--traces", type=Path, default=SHARED / "traces" / "kv-cache-tester")
    p.add_argument("--tokenizer", type=Path, default=SHARED / "kimi_tokenizer", help="Kimi tokenizer files")
    p.add_argument("--configs", default="device-only,host")
    p.add_argument("--users", type=int, default=2)
    p.add_argument("--max-context", type=int, default=24000, help="client: largest first prompt of a trace")
    p.add_argument("--duration", type=int, default=60, help="client: seconds of replay")
    p.add_argument("--time-scale", type=float, default=0.1, help="client: think-time scale")
    p.add_argument("--num-device-pages", type=int, default=400, help="server: device KV pages (64 tokens each)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path, help="write the summary here")
    args = p.parse_args(argv)
    args.python = args.python or str(args.tester / ".venv" / "bin" / "python")
    if not (args.tester / "trace_replay_tester.py").is_file():
        p.error(f"--tester: no trace_replay_tester.py in {args.tester} (run scripts/fetch_kv_cache_tester.sh)")
    names = args.configs.split(",")
    for n in names:
        if n not in CONFIGS:
            p.error(f"--configs: unknown {n!r}, expected some of {sorted(CONFIGS)}")
    work = Path(tempfile.mkdtemp(prefix="kvct-"))
    try:
        traces = work / "traces"
        traces.mkdir()
        for f in sorted(args.traces.glob("*.json")):
            shutil.copy(f, traces / f.name)
        model = write_checkpoint(work / "model", args.max_context)
        hf_tok = write_hf_tokenizer(work / "hf-tokenizer")
        results = {n: run_config(n, args, work, model, hf_tok, traces) for n in names}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'config':<12} {'requests':>8} {'errors':>6} {'TTFT p50':>9} {'TTFT p95':>9} "
          f"{'client hit':>10} {'device/host/disk hit tokens':>28}")
    for n, r in results.items():
        h = r["hit_tokens"]
        print(f"{n:<12} {r['requests']:>8} {r['errors']:>6} {r['ttft_p50_s']:>8.2f}s {r['ttft_p95_s']:>8.2f}s "
              f"{r['client_cache_hit_rate']:>10.1%} {int(h['device']):>14,}/{int(h['host']):,}/{int(h['disk']):,}")
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "results": results}, indent=1))
    return 1 if any(r["errors"] or r["http_errors"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
