"""MoE, sampling and page-copy kernel benchmarks: one CSV row per (op, shape, dtype, backend).

Columns: op, shape, dtype, backend, resolved_backend, device, median_us, p20_us, p80_us, gb_s,
tflop_s, commit. Bytes and FLOPs come from the formulas in :mod:`kvtier.reference` (moe, pages,
sampling). On a GPU: K2 shapes (MoE at 1-4096 tokens, E=384, top-8, H=7168, I=2048, with
moe_align_block_size at block_m 64 on its own; sampling over the 163840 vocab; gather of 64-token
pages x 61 layers x 576), torch vs triton vs hip where each exists, and fused_moe on aiter where
it is available (ROCm with aiter installed); a backend an op lacks, or that cannot run here, is
skipped with the reason on stderr. On CPU: the torch
backend at small shapes (the interpreter is not a timing target); ``--dry-run`` forces those on a
GPU machine too. Timing: one warm-up call (compiles), then ``--repeats`` calls each bracketed by a
device synchronisation (warm L2: the weights of one MoE call exceed any L2). Cases run in the
order listed (small token counts first); with ``--budget-s`` the remaining cases are skipped once
the budget is spent, and printed. The fp32 torch reference runs up to :data:`TORCH_MAX_TOKENS`
tokens on a GPU.

Usage: python perf/bench_moe.py [--csv out.csv] [--repeats 20] [--backends torch triton hip aiter]
       [--budget-s 150] [--dry-run]
"""

from __future__ import annotations

import argparse
import csv
import sys
import time

import torch

from kvtier import ops
from kvtier.ops.dispatch import resolve_backend
from kvtier.provenance import git_commit
from timing import add_kernel_bench_args, parse_kernel_bench_args

TORCH_MAX_TOKENS = 512  # the per-expert fp32 reference at 4096 tokens x top-8 takes seconds per call
GPU_TOKENS = (1, 8, 64, 256, 1024, 4096)
FIELDS = ["op", "shape", "dtype", "backend", "resolved_backend", "device", "median_us", "p20_us", "p80_us", "gb_s",
          "tflop_s", "commit"]


def _times_us(fn, repeats: int, device: torch.device) -> list[float]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t0) * 1e6)
    return sorted(out)


def _cases(device: torch.device, dtype: torch.dtype):
    gpu = device.type == "cuda"
    num_experts, top_k, hidden, inter = (384, 8, 7168, 2048) if gpu else (16, 4, 256, 128)
    # K2 bf16 weights are 34 GB: drawn in their dtype (an fp32 draw would need twice that again)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=device, dtype=dtype).mul_(hidden ** -0.5)
    w2 = torch.randn(num_experts, hidden, inter, device=device, dtype=dtype).mul_(inter ** -0.5)
    bias = torch.zeros(num_experts, device=device)
    es = torch.tensor([], dtype=dtype).element_size()
    for num_tokens in (GPU_TOKENS if gpu else (1, 16, 64)):
        x = torch.randn(num_tokens, hidden, device=device, dtype=dtype)
        logits = torch.randn(num_tokens, num_experts, device=device)
        n_group = 1
        yield ("moe_route", f"T{num_tokens}-E{num_experts}-k{top_k}", lambda b, lg=logits: ops.moe_route(
            lg, bias, top_k, n_group, n_group, 2.827, backend=b), num_tokens * num_experts * 4 + 8 * num_tokens * top_k, 0,
            num_tokens)
        w, ids = ops.moe_route(logits, bias, top_k, 1, 1, 2.827)
        pairs, block_m = num_tokens * top_k, 64
        max_padded = -(-(pairs + num_experts * (block_m - 1)) // block_m) * block_m
        yield ("moe_align_block_size", f"T{num_tokens}-E{num_experts}-k{top_k}-M{block_m}",
               lambda b, ids=ids, block_m=block_m: ops.moe_align_block_size(ids, num_experts, block_m, backend=b),
               4 * (pairs + max_padded + max_padded // block_m + 1), 0, num_tokens)
        hit = int(torch.unique(ids).numel())
        nbytes = hit * 3 * inter * hidden * es + 2 * num_tokens * hidden * es
        flops = 6 * num_tokens * top_k * hidden * inter
        yield ("fused_moe", f"T{num_tokens}-E{num_experts}-k{top_k}-H{hidden}-I{inter}",
               lambda b, x=x, w=w, ids=ids: ops.fused_moe(x, w13, w2, w, ids, backend=b), nbytes, flops,
               num_tokens)
    vocab = 163840 if gpu else 4096
    for batch in ((1, 64) if gpu else (1, 8)):
        lg = torch.randn(batch, vocab, device=device).to(dtype)
        t, p = torch.ones(batch, device=device), torch.full((batch,), 0.9, device=device)
        yield ("sample", f"B{batch}-V{vocab}-topp0.9", lambda b, lg=lg, t=t, p=p: ops.sample(lg, t, p, backend=b),
               batch * vocab * es * 34, 0, batch)
    layers, page_size, row, blocks = (61, 64, 576, 32) if gpu else (4, 16, 576, 8)
    pools = [torch.randn(2 * blocks, page_size, row, device=device).to(dtype) for _ in range(layers)]
    pages = torch.randperm(2 * blocks, device=device)[:blocks]
    yield ("gather_pages", f"L{layers}-P{page_size}-R{row}-N{blocks}",
           lambda b: ops.gather_pages(pools, pages, backend=b), 2 * blocks * layers * page_size * row * es, 0, 0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", default="-")
    add_kernel_bench_args(parser, "torch triton hip aiter")
    return parse_kernel_bench_args(parser, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backends = args.backends or (["torch", "triton", "hip", "aiter"] if device.type == "cuda" else ["torch"])
    repeats = min(args.repeats, 2) if args.dry_run else args.repeats
    commit = git_commit() or "unknown"
    out = sys.stdout if args.csv == "-" else open(args.csv, "w", newline="")
    writer = csv.DictWriter(out, FIELDS)
    writer.writeheader()
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    deadline = None if args.budget_s is None else time.monotonic() + args.budget_s
    for op, shape, fn, nbytes, flops, num_tokens in _cases(device, dtype):
        if deadline is not None and time.monotonic() > deadline:
            print(f"budget of {args.budget_s:.0f} s spent: skipping {op}/{shape} and what follows", file=sys.stderr)
            break
        for backend in backends:
            if backend == "torch" and device.type == "cuda" and op == "fused_moe" and num_tokens > TORCH_MAX_TOKENS:
                continue
            try:
                resolved = resolve_backend(op, backend, device, dtype)
            except ops.BackendUnavailableError as exc:
                print(f"skip {op} on {backend}: {exc}", file=sys.stderr)
                continue
            try:
                t = _times_us(lambda: fn(backend), repeats, device)
            except ops.BackendUnavailableError as exc:  # a limit of the backend for these inputs
                print(f"skip {op}/{shape} on {backend}: {exc}", file=sys.stderr)
                continue
            med = t[len(t) // 2]
            writer.writerow({"op": op, "shape": shape, "dtype": str(dtype).removeprefix("torch."), "backend": backend,
                             "resolved_backend": resolved, "device": dev_name, "median_us": f"{med:.1f}",
                             "p20_us": f"{t[len(t) // 5]:.1f}", "p80_us": f"{t[(4 * len(t)) // 5]:.1f}",
                             "gb_s": f"{nbytes / med / 1e3:.2f}", "tflop_s": f"{flops / med / 1e6:.4f}",
                             "commit": commit})
            out.flush()
    if out is not sys.stdout:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
