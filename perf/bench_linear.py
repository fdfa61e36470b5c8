"""Quantized linear benchmarks: one CSV row per (op, shape, dtype, backend).

Columns: op, shape, dtype, backend, resolved_backend, device, median_us, p20_us, p80_us, gb_s,
tflop_s, pct_hbm_peak, pct_matrix_peak, commit (as perf/bench_moe.py). Ops: ``linear_fp8_block``
(W8A8, 128x128 weight blocks, activations quantized per token per 128 columns inside) at the K2
dense and attention projections, ``linear_w4a16`` (INT4 group 32) at K2's expert shapes, and the
bf16 ``torch.nn.functional.linear`` of the same shapes (op ``linear_bf16``, the vendor GEMM) as the
baseline. Bytes: the weight in its storage format (:func:`kvtier.reference.quant.fp8_block_bytes`,
:func:`~kvtier.reference.quant.int4_group_bytes`) + ``M * K`` activations in + ``M * N`` out, bf16;
``pct_hbm_peak`` counts the weight bytes only (decode: M small); FLOPs ``2 * M * N * K`` and
``pct_matrix_peak`` against the fp8 (W8A8) or bf16 (W4A16, bf16) dense peak of the device
(:mod:`kvtier.sim.hardware` datasheets, found by the device name; blank elsewhere).

K2 shapes (N x K): q_a_proj 1536 x 7168, kv_a_proj_with_mqa 576 x 7168, o_proj 7168 x 8192,
dense MLP down 7168 x 18432 (FP8); expert gate/up 4096 x 7168 and down 7168 x 2048 (INT4). Tokens
M = 1, 16, 256, 4096. Method: random weights (FP8 drawn in bf16 and cast; INT4 uniform nibbles),
bf16 activations, seeds fixed; one warm-up call (compiles), then ``--repeats`` calls each
bracketed by a device synchronisation (warm L2; the largest weights exceed it). The fp32 torch
reference runs up to :data:`TORCH_MAX_TOKENS` tokens. Cases run small M first; with ``--budget-s``
the rest are skipped once the budget is spent. On CPU (or ``--dry-run``): tiny shapes, torch only.

Usage: python perf/bench_linear.py [--csv out.csv] [--repeats 20] [--backends torch triton]
       [--budget-s 60] [--dry-run]
"""

from __future__ import annotations

import argparse
import csv
import sys

import torch
import torch.nn.functional as F

from bench_moe import FIELDS, Case, run_cases
from kvtier import ops
from kvtier.reference.quant import fp8_block_bytes, int4_group_bytes
from timing import add_kernel_bench_args, parse_kernel_bench_args

TORCH_MAX_TOKENS = 256  # the fp32 reference dequantizes the whole weight per call
FP8_SHAPES = {"q_a_proj": (1536, 7168), "kv_a_proj": (576, 7168), "o_proj": (7168, 8192), "dense_down": (7168, 18432)}
INT4_SHAPES = {"expert_w13": (4096, 7168), "expert_w2": (7168, 2048)}
GPU_TOKENS = (1, 16, 256, 4096)


def _weights(device, fp8_dtype, gpu):
    scale = 1 if gpu else 16  # tiny shapes on CPU
    fp8, int4 = {}, {}
    for name, (n, k) in FP8_SHAPES.items():
        n, k = max(n // scale, 1), k // scale
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16).mul_(25.0).clamp_(-200, 200).to(fp8_dtype)
        fp8[name] = (w, torch.full((-(-n // 128), -(-k // 128)), k ** -0.5 / 25.0, device=device))
    for name, (n, k) in INT4_SHAPES.items():
        n, k = n // scale, k // scale
        packed = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device=device)
        int4[name] = (packed, torch.full((n, k // 32), k ** -0.5 / 7.5, dtype=torch.bfloat16, device=device))
    return fp8, int4


def _cases(device: torch.device):
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    fp8_dtype = torch.float8_e4m3fn
    if gpu:
        from kvtier.ops._triton import arch_of

        fp8_dtype = ops.fp8_e4m3_dtype(arch_of(device))
    fp8, int4 = _weights(device, fp8_dtype, gpu)
    es = torch.tensor([], dtype=dtype).element_size()
    fp8_name = str(fp8_dtype).removeprefix("torch.")
    for m in (GPU_TOKENS if gpu else (1, 16)):
        for name, (w, s) in fp8.items():
            n, k = w.shape
            x = torch.randn(m, k, device=device, dtype=dtype)
            act = (m * k + m * n) * es
            shape = f"{name}-M{m}-N{n}-K{k}"
            yield Case("linear_fp8_block", shape, lambda b, x=x, w=w, s=s: ops.linear_fp8_block(x, w, s, backend=b),
                       fp8_block_bytes(n, k) + act, 2 * m * n * k, m, fp8_block_bytes(n, k), "fp8", fp8_name)
            wb = torch.randn(n, k, device=device, dtype=dtype)
            yield Case("linear_bf16", shape, lambda b, x=x, wb=wb: F.linear(x, wb), n * k * es + act, 2 * m * n * k, m,
                       n * k * es, "bf16" if gpu else None)
        for name, (p, s) in int4.items():
            n, k = p.shape[0], p.shape[1] * 8
            x = torch.randn(m, k, device=device, dtype=dtype)
            yield Case("linear_w4a16", f"{name}-M{m}-N{n}-K{k}",
                       lambda b, x=x, p=p, s=s: ops.linear_w4a16(x, p, s, backend=b),
                       int4_group_bytes(n, k) + (m * k + m * n) * es, 2 * m * n * k, m, int4_group_bytes(n, k),
                       "bf16" if gpu else None, "int4-g32")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", default="-")
    add_kernel_bench_args(parser, "torch triton")
    return parse_kernel_bench_args(parser, argv)


def _skip(case: Case, backend: str, device: torch.device) -> bool:
    if case.op == "linear_bf16":
        return backend != "torch"  # the vendor GEMM, once
    return backend == "torch" and device.type == "cuda" and case.num_tokens > TORCH_MAX_TOKENS


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backends = args.backends or (["torch", "triton"] if device.type == "cuda" else ["torch"])
    repeats = min(args.repeats, 2) if args.dry_run else args.repeats
    out = sys.stdout if args.csv == "-" else open(args.csv, "w", newline="")
    writer = csv.DictWriter(out, FIELDS)
    writer.writeheader()
    run_cases(_cases(device), backends, device, dtype, repeats, args.budget_s, writer, out, _skip)
    if out is not sys.stdout:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
