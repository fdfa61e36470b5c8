"""kvtier's engine in-process, without a server: the step times of ``perf/engine_vs_vllm.py``'s
checkpoint (written to a temporary directory), ``--requests`` prompts of ``--prompt-tokens``
random ids, greedy, ``--max-tokens`` with ignore_eos, caches off, one torch thread; prints the
median decode step and the wall time of the batch (after one warm-up batch).

Usage (before and after a change, in turn, under the same load)::

    PYTHONPATH=/path/to/old/python python perf/bench_engine_step.py
    python perf/bench_engine_step.py --json perf/results/engine_step.json

``--json`` writes the step times with their provenance (commit of the kvtier imported, torch
version, load average before and after). A profile of the step: ``py-spy record --format raw -o
RAW -- python perf/bench_engine_step.py``, then ``python perf/bench_engine_step.py --top-frames
RAW`` prints the top frames (self and inclusive samples) under ``Engine.step``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_vs_vllm import ROOT, top_frames, write_model  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=384)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--tokenizer", default=str(ROOT.parent / "shared" / "kimi_tokenizer"))
    p.add_argument("--json", default="", help="write the step times and their provenance here")
    p.add_argument("--top-frames", default="", metavar="RAW",
                   help="print the top frames of a py-spy raw profile of this script (no run)")
    args = p.parse_args()
    if args.top_frames:
        top = top_frames(Path(args.top_frames), thread_hint="step (kvtier/serve/engine.py", limit=20,
                         by_function=True)
        print(f"{top['samples']} samples under Engine.step")
        for kind in ("self", "inclusive"):
            print(f"-- {kind}")
            for frame, _, pct in top[kind]:
                print(f"{pct:5.1f}%  {frame}")
        return 0
    load_before = os.getloadavg()
    import torch

    from kvtier import LLM
    from kvtier.serve.params import SamplingParams

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="kvtier-engine-step-") as tmp:
        llm = LLM(str(write_model(Path(tmp) / "model")), dtype="bfloat16", tokenizer=args.tokenizer, page_size=64,
                  num_device_pages=512, max_num_seqs=args.requests, max_num_batched_tokens=2048,
                  enable_prefix_caching=False)
    engine, rng = llm.engine, random.Random(0)
    prompts = [[rng.randrange(256, 32000) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0)

    def batch() -> list[float]:
        for prompt in prompts:
            engine.add_request(prompt, params)
        times = []
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        return times

    batch()
    times = batch()
    decode = times[2:]  # the prefill steps first
    print(f"steps {len(times)}, decode step median {1e3 * statistics.median(decode):.1f} ms, "
          f"batch wall {sum(times):.2f} s")
    if args.json:
        import kvtier

        src = Path(kvtier.__file__).resolve().parents[2]
        commit = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        doc = {"args": vars(args), "kvtier": str(src), "commit": commit, "torch": torch.__version__,
               "load_before": load_before, "load_after": os.getloadavg(), "steps": len(times),
               "decode_step_median_ms": 1e3 * statistics.median(decode), "batch_wall_s": sum(times),
               "step_ms": [1e3 * t for t in times]}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
