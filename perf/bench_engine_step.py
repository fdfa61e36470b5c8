"""kvtier's engine in-process, without a server: the step times of ``perf/engine_vs_vllm.py``'s
checkpoint (written to a temporary directory), ``--requests`` prompts of ``--prompt-tokens``
random ids, greedy, ``--max-tokens`` with ignore_eos, caches off, one torch thread; prints the
median decode step and the wall time of the batch (after one warm-up batch).

Usage (before and after a change, in turn, under the same load)::

    PYTHONPATH=/path/to/old/python python perf/bench_engine_step.py
    python perf/bench_engine_step.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_vs_vllm import ROOT, write_model  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=384)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--tokenizer", default=str(ROOT.parent / "shared" / "kimi_tokenizer"))
    args = p.parse_args()
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
