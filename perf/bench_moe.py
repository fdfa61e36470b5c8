"""MoE, sampling and page-copy kernel benchmarks: one CSV row per (op, shape, dtype, backend).

Columns: op, shape, dtype, backend, resolved_backend, device, median_us, p20_us, p80_us, gb_s,
tflop_s, pct_hbm_peak, pct_matrix_peak, commit. Bytes and FLOPs come from the formulas in
:mod:`kvtier.reference` (moe, quant, pages, sampling). ``pct_hbm_peak`` = the weight bytes read
(every hit expert's, in its storage format; all bytes for the ops without weights) per second as
a percentage of the device's HBM peak, the figure that matters at decode; ``pct_matrix_peak`` =
``tflop_s`` as a percentage of its dense matrix peak for the op's compute dtype (bf16 for bf16
and W4A16, fp8 for W8A8), the figure that matters at prefill. Peaks are the datasheet figures of
:mod:`kvtier.sim.hardware` (MI355X, H200), found by the device name; blank elsewhere.

On a GPU: K2 shapes (MoE at 1-4096 tokens, E=384, top-8, H=7168, I=2048 with bf16 weights, INT4
group-32 weights (``fused_moe_w4a16``) and FP8 128x128-block weights (``fused_moe_fp8_block``,
W8A8), with moe_align_block_size at block_m 64 on its own; sampling over the 163840 vocab; gather
of 64-token pages x 61 layers x 576), torch vs triton vs hip where each exists, and fused_moe on
aiter where it is available (ROCm with aiter installed); a backend an op lacks, or that cannot
run here, is skipped with the reason on stderr. Random INT4 weights are uniform nibbles with
bf16 scales; FP8 weights are drawn expert by expert (no fp32 copy of the 17 GB). On CPU: the
torch backend at small shapes (the interpreter is not a timing target); ``--dry-run`` forces
those on a GPU machine too. Timing: one warm-up call (compiles), then ``--repeats`` calls each
bracketed by a device synchronisation (warm L2: the weights of one MoE call exceed any L2).
Cases run in the order listed (small token counts first, every weight format at each); with
``--budget-s`` the remaining cases are skipped once the budget is spent, and printed. The fp32
torch reference runs up to :data:`TORCH_MAX_TOKENS` tokens (bf16 weights) and
:data:`QUANT_TORCH_MAX_TOKENS` (quantized weights, dequantized per expert per call) on a GPU.

Usage: python perf/bench_moe.py [--csv out.csv] [--repeats 20] [--backends torch triton hip aiter]
       [--budget-s 150] [--dry-run]
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier import ops
from kvtier.ops.dispatch import resolve_backend
from kvtier.provenance import git_commit
from kvtier.reference.quant import fp8_block_bytes, int4_group_bytes
from timing import add_kernel_bench_args, device_peaks, parse_kernel_bench_args, peak_fractions

TORCH_MAX_TOKENS = 512  # the per-expert fp32 reference at 4096 tokens x top-8 takes seconds per call
QUANT_TORCH_MAX_TOKENS = 64  # ... and dequantizes every hit expert's weights per call
QUANT_OPS = ("fused_moe_w4a16", "fused_moe_fp8_block")
GPU_TOKENS = (1, 8, 64, 256, 1024, 4096)
FIELDS = ["op", "shape", "dtype", "backend", "resolved_backend", "device", "median_us", "p20_us", "p80_us", "gb_s",
          "tflop_s", "pct_hbm_peak", "pct_matrix_peak", "commit"]


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


@dataclass
class Case:
    """One benchmark row's inputs: ``fn(backend)`` runs it; ``weight_bytes`` (None: ``nbytes``) is
    what ``pct_hbm_peak`` counts; ``compute`` the dtype of its matrix peak (None: no FLOPs)."""

    op: str
    shape: str
    fn: Callable[[str], object]
    nbytes: int
    flops: int
    num_tokens: int
    weight_bytes: int | None = None
    compute: str | None = None
    dtype: str = ""


def _quant_experts(device, num_experts, hidden, inter, fp8_dtype):
    """Random K2-shaped experts: INT4 (uniform nibbles, bf16 scales ~ 1/(7.5 sqrt(K))) and FP8 blocks
    (drawn one expert at a time: no fp32 copy of the whole tensor)."""
    def int4(rows, k):
        packed = torch.randint(-2**31, 2**31 - 1, (num_experts, rows, k // 8), dtype=torch.int32, device=device)
        scale = torch.full((num_experts, rows, k // 32), k ** -0.5 / 7.5, dtype=torch.bfloat16, device=device)
        return packed, scale

    def fp8(rows, k):
        w = torch.empty(num_experts, rows, k, dtype=fp8_dtype, device=device)
        for e in range(num_experts):
            w[e] = torch.randn(rows, k, device=device, dtype=torch.bfloat16).mul_(25.0).clamp_(-200, 200).to(fp8_dtype)
        return w, torch.full((num_experts, -(-rows // 128), -(-k // 128)), k ** -0.5 / 25.0, device=device)

    return (*int4(2 * inter, hidden), *int4(hidden, inter)), (*fp8(2 * inter, hidden), *fp8(hidden, inter))


def _cases(device: torch.device, dtype: torch.dtype):
    gpu = device.type == "cuda"
    num_experts, top_k, hidden, inter = (384, 8, 7168, 2048) if gpu else (16, 4, 256, 128)
    # K2 bf16 weights are 34 GB: drawn in their dtype (an fp32 draw would need twice that again)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=device, dtype=dtype).mul_(hidden ** -0.5)
    w2 = torch.randn(num_experts, hidden, inter, device=device, dtype=dtype).mul_(inter ** -0.5)
    fp8_dtype = torch.float8_e4m3fn
    if gpu:
        from kvtier.ops._triton import arch_of

        fp8_dtype = ops.fp8_e4m3_dtype(arch_of(device))
    int4_w, fp8_w = _quant_experts(device, num_experts, hidden, inter, fp8_dtype)
    bias = torch.zeros(num_experts, device=device)
    es = torch.tensor([], dtype=dtype).element_size()
    compute = "bf16" if dtype == torch.bfloat16 else None
    expert_bytes = {"fused_moe": 3 * inter * hidden * es,
                    "fused_moe_w4a16": int4_group_bytes(2 * inter, hidden) + int4_group_bytes(hidden, inter),
                    "fused_moe_fp8_block": fp8_block_bytes(2 * inter, hidden) + fp8_block_bytes(hidden, inter)}
    moe_fns = {"fused_moe": lambda x, w, ids, b: ops.fused_moe(x, w13, w2, w, ids, validate=False, backend=b),
               "fused_moe_w4a16": lambda x, w, ids, b: ops.fused_moe_w4a16(x, *int4_w, w, ids, validate=False,
                                                                          backend=b),
               "fused_moe_fp8_block": lambda x, w, ids, b: ops.fused_moe_fp8_block(x, *fp8_w, w, ids, validate=False,
                                                                                  backend=b)}
    for num_tokens in (GPU_TOKENS if gpu else (1, 16, 64)):
        x = torch.randn(num_tokens, hidden, device=device, dtype=dtype)
        logits = torch.randn(num_tokens, num_experts, device=device)
        n_group = 1
        yield Case("moe_route", f"T{num_tokens}-E{num_experts}-k{top_k}", lambda b, lg=logits: ops.moe_route(
            lg, bias, top_k, n_group, n_group, 2.827, backend=b), num_tokens * num_experts * 4 + 8 * num_tokens * top_k,
            0, num_tokens)
        w, ids = ops.moe_route(logits, bias, top_k, 1, 1, 2.827)
        pairs, block_m = num_tokens * top_k, 64
        max_padded = -(-(pairs + num_experts * (block_m - 1)) // block_m) * block_m
        yield Case("moe_align_block_size", f"T{num_tokens}-E{num_experts}-k{top_k}-M{block_m}",
                   lambda b, ids=ids, block_m=block_m: ops.moe_align_block_size(ids, num_experts, block_m, backend=b),
                   4 * (pairs + max_padded + max_padded // block_m + 1), 0, num_tokens)
        hit = int(torch.unique(ids).numel())
        flops = 6 * num_tokens * top_k * hidden * inter
        for op, fn in moe_fns.items():
            weight_bytes = hit * expert_bytes[op]
            yield Case(op, f"T{num_tokens}-E{num_experts}-k{top_k}-H{hidden}-I{inter}",
                       lambda b, x=x, w=w, ids=ids, fn=fn: fn(x, w, ids, b),
                       weight_bytes + 2 * num_tokens * hidden * es,
                       flops, num_tokens, weight_bytes, "fp8" if op == "fused_moe_fp8_block" else compute,
                       {"fused_moe_w4a16": "int4-g32", "fused_moe_fp8_block": str(fp8_dtype).removeprefix("torch.")}
                       .get(op, ""))
    del w13, w2, int4_w, fp8_w
    vocab = 163840 if gpu else 4096
    for batch in ((1, 64) if gpu else (1, 8)):
        lg = torch.randn(batch, vocab, device=device).to(dtype)
        t, p = torch.ones(batch, device=device), torch.full((batch,), 0.9, device=device)
        yield Case("sample", f"B{batch}-V{vocab}-topp0.9", lambda b, lg=lg, t=t, p=p: ops.sample(lg, t, p, backend=b),
                   batch * vocab * es * 34, 0, batch)
    layers, page_size, row, blocks = (61, 64, 576, 32) if gpu else (4, 16, 576, 8)
    pools = [torch.randn(2 * blocks, page_size, row, device=device).to(dtype) for _ in range(layers)]
    pages = torch.randperm(2 * blocks, device=device)[:blocks]
    yield Case("gather_pages", f"L{layers}-P{page_size}-R{row}-N{blocks}",
               lambda b: ops.gather_pages(pools, pages, backend=b), 2 * blocks * layers * page_size * row * es, 0, 0)


def _skip_torch(case: Case, backend: str, device: torch.device) -> bool:
    """The fp32 reference is not timed past its token limit on a GPU."""
    if backend != "torch" or device.type != "cuda":
        return False
    limit = {"fused_moe": TORCH_MAX_TOKENS}.get(case.op, QUANT_TORCH_MAX_TOKENS if case.op in QUANT_OPS else None)
    return limit is not None and case.num_tokens > limit


def run_cases(cases, backends, device, dtype, repeats, budget_s, writer, out, skip) -> None:
    """Time every case on every backend (``skip(case, backend, device)`` True: not this one) and write
    a row each; unavailable backends are skipped with the reason on stderr; past ``budget_s``
    seconds the remaining cases are skipped and named."""
    commit = git_commit() or "unknown"
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peaks = device_peaks(dev_name)
    deadline = None if budget_s is None else time.monotonic() + budget_s
    for case in cases:
        if deadline is not None and time.monotonic() > deadline:
            print(f"budget of {budget_s:.0f} s spent: skipping {case.op}/{case.shape} and what follows",
                  file=sys.stderr)
            break
        for backend in backends:
            if skip(case, backend, device):
                continue
            try:
                resolved = resolve_backend(case.op, backend, device, dtype)
            except ops.BackendUnavailableError as exc:
                print(f"skip {case.op} on {backend}: {exc}", file=sys.stderr)
                continue
            try:
                t = _times_us(lambda: case.fn(backend), repeats, device)
            except ops.BackendUnavailableError as exc:  # a limit of the backend for these inputs
                print(f"skip {case.op}/{case.shape} on {backend}: {exc}", file=sys.stderr)
                continue
            med = t[len(t) // 2]
            writer.writerow({"op": case.op, "shape": case.shape,
                             "dtype": ";".join(filter(None, [str(dtype).removeprefix("torch."), case.dtype])),
                             "backend": backend, "resolved_backend": resolved, "device": dev_name,
                             "median_us": f"{med:.1f}", "p20_us": f"{t[len(t) // 5]:.1f}",
                             "p80_us": f"{t[(4 * len(t)) // 5]:.1f}", "gb_s": f"{case.nbytes / med / 1e3:.2f}",
                             "tflop_s": f"{case.flops / med / 1e6:.4f}",
                             **peak_fractions(peaks, med, case.weight_bytes if case.weight_bytes is not None
                                              else case.nbytes, case.flops, case.compute), "commit": commit})
            out.flush()


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
    out = sys.stdout if args.csv == "-" else open(args.csv, "w", newline="")
    writer = csv.DictWriter(out, FIELDS)
    writer.writeheader()
    run_cases(_cases(device, dtype), backends, device, dtype, repeats, args.budget_s, writer, out, _skip_torch)
    if out is not sys.stdout:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
