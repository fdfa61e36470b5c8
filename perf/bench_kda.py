"""KDA and short-conv kernel benchmarks: one CSV row per (op, shape, dtype, backend), plus a summary.

Columns as :mod:`bench_moe` (op, shape, dtype, backend, resolved_backend, device, median_us,
p20_us, p80_us, gb_s, tflop_s, pct_hbm_peak, pct_matrix_peak, commit). Bytes and FLOPs come from
:mod:`kvtier.reference.kda` (``kda_decode_bytes``, ``kda_prefill_flops``): decode reads and
writes each sequence's fp32 state (``2 * H * K * V * 4`` bytes) and moves its bf16 q/k/g/v/o, so
``pct_hbm_peak`` is the figure that matters for it; prefill counts its inputs, outputs and the
states read and written. Peaks are the datasheet figures of :mod:`kvtier.sim.hardware`
(H200, MI355X) found by the device name; blank elsewhere.

On a GPU: K3 shapes (96 heads x head dim 128, fp32 states, bf16 activations; g in fp32 as the
gate hands it over): prefill of 1 x 4096, 8 x 1024 and 1 x 16384 new tokens from a given state,
triton's chunked kernel (``-C64``) and its token-walking one (``-C1``, ``chunk_size=1``);
decode at batch 1, 8, 32 and 128 over shuffled state slots; the short conv (dim 3 x 12,288,
kernel 4) prefill at 4096 tokens and update at batch 1 and 128. torch (the fp32 reference, up
to :data:`TORCH_MAX_TOKENS` prefill tokens) and triton. On CPU: the torch backend at tiny shapes;
``--dry-run`` forces those on a GPU machine too. Timing: one warm-up call (compiles), then
``--repeats`` calls each bracketed by a device synchronisation (warm L2; a 128-sequence decode's
states are 800 MB). With ``--budget-s`` the remaining cases are skipped once it is spent.
``--summary`` writes a markdown table: prefill tokens/s, decode step time and % of HBM peak.

Usage: python perf/bench_kda.py [--csv out.csv] [--summary out.md] [--repeats 20]
       [--backends torch triton] [--budget-s 60] [--dry-run]
"""

from __future__ import annotations

import argparse
import csv
import sys

import torch

from bench_moe import FIELDS, Case, run_cases
from kvtier import ops
from kvtier.reference.kda import kda_decode_bytes, kda_prefill_flops
from timing import add_kernel_bench_args, parse_kernel_bench_args

TORCH_MAX_TOKENS = 4096  # the reference loops over chunks in Python
GPU_PREFILL = ((1, 4096), (8, 1024), (1, 16384))  # (sequences, new tokens each)
GPU_DECODE = (1, 8, 32, 128)
PREFILL_CHUNKS = (64, 1)  # triton: the chunked kernel, then the token-walking one (the reference runs once)


def _kda_inputs(num_tokens, heads, dim, device, dtype):
    q, k, v = (torch.randn(num_tokens, heads, dim, device=device, dtype=dtype) for _ in range(3))
    g = -5.0 * torch.sigmoid(torch.randn(num_tokens, heads, dim, device=device) - 3)
    beta = torch.rand(num_tokens, heads, device=device).to(dtype)
    return q, k, v, g, beta


def _prefill_case(batch, per_seq, heads, dim, device, dtype, es, chunk_size):
    tokens = batch * per_seq
    q, k, v, g, beta = _kda_inputs(tokens, heads, dim, device, dtype)
    state = torch.randn(batch, heads, dim, dim, device=device) * 0.1
    cu = torch.arange(0, tokens + 1, per_seq, dtype=torch.int32, device=device)
    nbytes = tokens * heads * ((3 * dim + 1) * es + 4 * dim) + 2 * batch * heads * dim * dim * 4
    return Case("kda_chunk_prefill", f"B{batch}xT{per_seq}-H{heads}-K{dim}-C{chunk_size}",
                lambda b: ops.kda_chunk_prefill(q, k, v, g, beta, state, cu, chunk_size=chunk_size, validate=False,
                                                backend=b),
                nbytes, kda_prefill_flops(tokens, heads, dim, dim, chunk_size), tokens)


def _decode_case(batch, heads, dim, device, dtype, es):
    q, k, v, g, beta = _kda_inputs(batch, heads, dim, device, dtype)
    slots = torch.randn(batch + 3, heads, dim, dim, device=device) * 0.1
    idx = torch.randperm(batch + 3, device=device)[:batch].to(torch.int32)
    return Case("kda_recurrent_decode", f"B{batch}-H{heads}-K{dim}",
                lambda b: ops.kda_recurrent_decode(q, k, v, g, beta, slots, idx, validate=False, backend=b),
                kda_decode_bytes(batch, heads, dim, dim, es), 7 * batch * heads * dim * dim, batch)


def _cases(device: torch.device, dtype: torch.dtype):
    gpu = device.type == "cuda"
    heads, dim = (96, 128) if gpu else (2, 16)
    es = torch.tensor([], dtype=dtype).element_size()
    for batch, per_seq in (GPU_PREFILL if gpu else ((1, 32), (3, 16))):
        for chunk_size in PREFILL_CHUNKS:
            yield _prefill_case(batch, per_seq, heads, dim, device, dtype, es, chunk_size)
    for batch in (GPU_DECODE if gpu else (1, 4)):
        yield _decode_case(batch, heads, dim, device, dtype, es)
    conv_dim, width = 3 * heads * dim, 4
    weight = torch.randn(conv_dim, width, device=device).to(dtype)
    tokens = 4096 if gpu else 32
    x = torch.randn(tokens, conv_dim, device=device).to(dtype)
    state = torch.zeros(1, conv_dim, width - 1, device=device, dtype=dtype)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    yield Case("causal_conv1d_prefill", f"T{tokens}-D{conv_dim}-W{width}",
               lambda b: ops.causal_conv1d_prefill(x, weight, None, state, cu, validate=False, backend=b),
               (2 * tokens + width) * conv_dim * es, 2 * width * tokens * conv_dim, tokens)
    for batch in ((1, 128) if gpu else (1, 4)):
        slots = torch.zeros(batch + 1, conv_dim, width - 1, device=device, dtype=dtype)
        idx = torch.arange(batch, dtype=torch.int32, device=device)
        xb = x[:batch]
        yield Case("causal_conv1d_update", f"B{batch}-D{conv_dim}-W{width}",
                   lambda b, xb=xb, slots=slots, idx=idx: ops.causal_conv1d_update(xb, weight, None, slots, idx,
                                                                                   validate=False, backend=b),
                   batch * conv_dim * (2 + 2 * (width - 1)) * es + conv_dim * width * es,
                   2 * width * batch * conv_dim, batch)


def _skip_torch(case: Case, backend: str, device: torch.device) -> bool:
    if backend != "torch" or case.op != "kda_chunk_prefill":
        return False
    return case.shape.endswith("-C1") or (device.type == "cuda" and case.num_tokens > TORCH_MAX_TOKENS)


def write_summary(rows: list[dict], path: str) -> None:
    """Markdown: prefill tokens/s, decode and conv step time (µs) and % of HBM peak, per backend."""
    lines = ["KDA (K3: 96 heads x 128, fp32 state) and short conv, per layer "
             "(op, shape, backend, median µs, tokens/s, GB/s, % HBM peak):", "",
             "| op | shape | backend | median µs | tokens/s | GB/s | % HBM peak |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        tokens = _tokens_of(r["shape"])
        tok_s = f"{tokens / (float(r['median_us']) * 1e-6):,.0f}" if tokens else ""
        lines.append(f"| {r['op']} | {r['shape']} | {r['resolved_backend']} | {r['median_us']} | {tok_s} | "
                     f"{r['gb_s']} | {r['pct_hbm_peak']} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _tokens_of(shape: str) -> int:
    """Tokens of one call from a shape label: ``B8xT1024`` -> 8192, ``T4096`` -> 4096, ``B32`` -> 32."""
    head = shape.split("-")[0]
    if "xT" in head:
        b, t = head[1:].split("xT")
        return int(b) * int(t)
    return int(head[1:]) if head[:1] in ("B", "T") and head[1:].isdigit() else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", default="-")
    parser.add_argument("--summary", default=None, help="markdown summary path (needs --csv to a file)")
    add_kernel_bench_args(parser, "torch triton")
    args = parse_kernel_bench_args(parser, argv)
    if args.summary and args.csv == "-":
        parser.error("--summary needs --csv PATH (it is built from the rows written there)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backends = args.backends or (["torch", "triton"] if device.type == "cuda" else ["torch"])
    repeats = min(args.repeats, 2) if args.dry_run else args.repeats
    out = sys.stdout if args.csv == "-" else open(args.csv, "w", newline="")
    writer = csv.DictWriter(out, FIELDS)
    writer.writeheader()
    run_cases(_cases(device, dtype), backends, device, dtype, repeats, args.budget_s, writer, out, _skip_torch)
    if out is not sys.stdout:
        out.close()
        if args.summary:
            write_summary(list(csv.DictReader(open(args.csv))), args.summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
