"""The CPU paged MLA extend (:mod:`kvtier.ops._cpu_mla`) against the fp32 reference it replaced
on CPU tensors (:func:`kvtier.reference.mla_extend`): median time of each over the same inputs,
and their ratio, measured in one run.

Shapes: the ``tiny`` preset's attention (4 heads, kv_lora_rank 64 + rope 16, one layer's call),
page size 16, pages shuffled; one sequence per call, ``new`` query tokens at the end of ``context``
cached tokens (a prefill chunk: ``new == context`` is a fresh prompt), as ``kvtier bench`` runs
them with its 1,024-token step budget. Inputs are fp32.

Usage: python perf/bench_cpu_mla.py [--repeats 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvtier import reference
from kvtier.ops import _cpu_mla

SHAPES = [(1024, 1024), (1024, 3072), (1024, 6144), (512, 6144), (128, 6144), (1, 6144)]  # (new, context)
HEADS, RANK, ROPE, PAGE = 4, 64, 16, 16


def _inputs(new: int, context: int, gen: torch.Generator):
    pages = -(-context // PAGE)
    kv_cache = torch.randn(pages + 3, PAGE, RANK + ROPE, generator=gen)
    block_table = torch.randperm(pages + 3, generator=gen)[:pages].to(torch.int32)[None]
    q = torch.randn(new, HEADS, RANK + ROPE, generator=gen)
    cu = torch.tensor([0, new], dtype=torch.int32)
    return q, kv_cache, block_table, cu, torch.tensor([context], dtype=torch.int32)


def _median_s(fn, args, repeats: int) -> float:
    fn(*args)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    if not _cpu_mla.available():
        raise SystemExit("this torch lacks aten::_scaled_dot_product_flash_attention_for_cpu: nothing to compare")
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'new':>5} {'context':>7} {'reference ms':>12} {'blocked ms':>10} {'speedup':>7}")
    for new, context in SHAPES:
        call = _inputs(new, context, gen) + (0.13, RANK)
        ref = _median_s(reference.mla_extend, call, args.repeats)
        blocked = _median_s(_cpu_mla.mla_extend, call, args.repeats)
        rows.append({"new": new, "context": context, "reference_s": ref, "blocked_s": blocked, "speedup": ref / blocked})
        print(f"{new:>5} {context:>7} {ref * 1e3:>12.2f} {blocked * 1e3:>10.2f} {ref / blocked:>6.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
