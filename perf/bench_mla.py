"""Paged MLA decode/extend benchmarks: one CSV row per (op, shape, dtype, backend).

Columns: op, shape, dtype, backend, resolved_backend, device, median_us, p20_us, p80_us, gb_s,
tflop_s, pct_copy_bw, commit. ``pct_copy_bw`` = ``gb_s`` as a percentage of the measured copy
bandwidth (:func:`measure_copy_gbps`: a device-to-device ``copy_`` of a 2 GiB buffer, read + write
bytes over its median time = the HBM bandwidth a kernel can actually reach).

Bytes and FLOPs: decode from :func:`kvtier.reference.mla.mla_decode_bytes` / ``mla_decode_flops``
(each sequence's cache rows read once, shared by all heads); extend from :func:`extend_bytes` /
:func:`extend_flops` below (cache rows once per sequence; each new token sees the prefix and the
new tokens up to itself).

Method: K2 widths (kv_lora_rank 512 + rope 64, K2's YaRN sm_scale 0.130861), page size 64, pages
shuffled (random block_table), all sequences at the same context. The step's plan
(``plan_mla_decode`` / ``plan_mla_extend``) is made before timing; the timed call is the per-layer
``mla_decode_run`` / ``mla_extend_run``. One warm-up call (compiles),
then ``--repeats`` timed calls; on a GPU each call is timed with CUDA events after writing a
512 MiB buffer (cold L2), and the median/p20/p80 are reported. Seeds are fixed (0). Shapes run
from the smallest cache to the largest; with ``--budget-s`` the remaining (largest) shapes are
skipped once the budget is spent, and the skipped ones are printed.

GPU shapes: decode batch 1-128 at 4K-128K context with 64 heads (one GPU) and 8 heads (a TP8
rank), bf16 and fp8 KV; extend (prefill chunks of 512-4096 new tokens on 4K-64K prefixes, 64 heads);
triton, hip (decode only; where kvtier._hip is built), aiter where it is available (ROCm with aiter
installed: decode with bf16 KV, heads padded to 16/128 by the adapter; its token-index plan is
built before timing, see :func:`_aiter_decode_call`), and the fp32 torch reference where it fits
in time. A backend that is unavailable, or cannot take a shape, is skipped with the reason on
stderr. The summary's ``aiter µs / this`` column is aiter's median over the row's median for the
same shape (> 1: faster than aiter), both measured in the same run. ``--dry-run`` (or a CPU-only
machine): the same code at tiny shapes on CPU, the torch backend, to catch errors without a GPU.

Usage: python perf/bench_mla.py [--csv out.csv] [--repeats 20] [--backends triton hip aiter torch]
       [--budget-s 180] [--summary summary.md] [--dry-run]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from kvtier import ops
from kvtier.ops.dispatch import resolve_backend
from kvtier.provenance import git_commit
from timing import add_kernel_bench_args, parse_kernel_bench_args
from kvtier.reference.mla import mla_decode_bytes, mla_decode_flops

FIELDS = ["op", "shape", "dtype", "backend", "resolved_backend", "device", "median_us", "p20_us", "p80_us", "gb_s",
          "tflop_s", "pct_copy_bw", "commit"]
RANK, ROPE, PAGE, SM_SCALE = 512, 64, 64, 0.130861
DIM = RANK + ROPE
TORCH_MAX_TOKENS = 32 * 32768  # the fp32 torch reference beyond this batch x context would dominate the run
TORCH_MAX_EXTEND_SCORES = 2**25  # new tokens x context per sequence: the reference's fp32 score matrix / heads


@dataclass(frozen=True)
class Case:
    """One benchmark shape. decode: ``new_tokens`` = 1 per sequence; extend: the last ``new_tokens``
    of each sequence's ``ctx`` are new (causal among themselves)."""

    op: str  # "mla_decode" | "mla_extend"
    heads: int
    batch: int
    ctx: int  # tokens per sequence, new ones included
    new_tokens: int
    kv_dtype: torch.dtype
    q_dtype: torch.dtype = torch.bfloat16

    @property
    def shape(self) -> str:
        extra = "" if self.op == "mla_decode" else f"-new{self.new_tokens}"
        return f"b{self.batch}-h{self.heads}-ctx{self.ctx}{extra}-p{PAGE}"

    @property
    def cache_bytes(self) -> int:
        return self.batch * self.ctx * DIM * torch.empty(0, dtype=self.kv_dtype).element_size()


def extend_bytes(case: Case, kv_bytes: int, q_bytes: int) -> int:
    """DRAM bytes of one extend call: every sequence's cache rows once, q in and out out."""
    total_q = case.batch * case.new_tokens
    return case.batch * case.ctx * DIM * kv_bytes + total_q * case.heads * (DIM + RANK) * q_bytes


def extend_flops(case: Case) -> int:
    """FLOPs: ``2 * H * (D + R)`` per (query, visible key); query i of n sees ``ctx - n + i + 1`` keys."""
    n, prefix = case.new_tokens, case.ctx - case.new_tokens
    visible = n * prefix + n * (n + 1) // 2
    return case.batch * 2 * case.heads * visible * (DIM + RANK)


def fp8_kv_dtype(arch: str) -> torch.dtype:
    """The fp8 e4m3 KV dtype of ``arch``: e4m3fnuz on gfx942, OCP e4m3fn elsewhere."""
    return torch.float8_e4m3fnuz if arch.startswith("gfx942") else torch.float8_e4m3fn


def gpu_cases(fp8: torch.dtype) -> list[Case]:
    """The K2 shapes, smallest cache first (a spent budget skips the largest)."""
    cases = [Case("mla_decode", heads, batch, ctx, 1, kv)
             for heads in (64, 8) for kv in (torch.bfloat16, fp8)
             for batch in (1, 8, 32, 128) for ctx in (4096, 32768, 131072)]
    cases += [Case("mla_extend", 64, batch, ctx, new, kv)
              for kv in (torch.bfloat16, fp8)
              for batch, ctx, new in ((1, 4096, 512), (1, 32768, 2048), (4, 8192, 1024), (1, 65536, 4096))]
    return sorted(cases, key=lambda c: (c.cache_bytes, c.op, c.heads))


def dry_run_cases() -> list[Case]:
    """Tiny CPU shapes through the same code (fp32; 8 heads)."""
    return [Case("mla_decode", 8, batch, ctx, 1, torch.float32, torch.float32) for batch in (1, 4) for ctx in (256, 1024)
            ] + [Case("mla_extend", 8, 2, 256, 64, torch.float32, torch.float32)]


def _times_us(fn, repeats: int, device: torch.device) -> list[float]:
    fn()  # warm-up / compile
    out = []
    if device.type == "cuda":
        flush = torch.empty(512 * 2**20, dtype=torch.uint8, device=device)
        for _ in range(repeats):
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) * 1e3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e6)
    return sorted(out)


def _quantile(sorted_us: list[float], q: float) -> float:
    return sorted_us[min(len(sorted_us) - 1, int(q * len(sorted_us)))]


def measure_copy_gbps(device: torch.device, nbytes: int = 2 * 2**30, repeats: int = 10) -> float:
    """Achievable memory bandwidth in GB/s: ``dst.copy_(src)`` of ``nbytes`` (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    us = _times_us(lambda: dst.copy_(src), repeats, device)
    del src, dst
    return 2 * nbytes / statistics.median(us) / 1e3


def _inputs(case: Case, device: torch.device, gen: torch.Generator):
    pages_per_seq = -(-case.ctx // PAGE)
    num_pages = case.batch * pages_per_seq
    kv = torch.randn(num_pages, PAGE, DIM, device=device, dtype=torch.bfloat16, generator=gen).to(case.kv_dtype)
    block_table = torch.randperm(num_pages, device=device, generator=gen).to(torch.int32).view(case.batch, -1)
    total_q = case.batch * case.new_tokens
    q = torch.randn(total_q, case.heads, DIM, device=device, dtype=torch.bfloat16, generator=gen).to(case.q_dtype)
    seq_lens = torch.full((case.batch,), case.ctx, dtype=torch.int32, device=device)
    cu_seqlens_q = torch.arange(0, total_q + 1, case.new_tokens, dtype=torch.int32, device=device)
    return q, kv, block_table, seq_lens, cu_seqlens_q


def _aiter_decode_call(q, kv, bt, lens, kv_scale: float):
    """aiter's decode through kvtier's adapter, its token-index plan built here, before timing (a
    serving loop builds it once per step for all layers); the timed call pads heads, runs aiter and
    slices the result back. Raises BackendUnavailableError for inputs aiter cannot take."""
    from kvtier.ops import _aiter

    _aiter.check_mla_decode(q, kv, RANK)
    plan = _aiter.plan_mla_decode(bt, lens, kv.shape[1])
    return lambda: _aiter.run_mla_decode(plan, q, kv, SM_SCALE, RANK, kv_scale, q.new_empty(*q.shape[:2], RANK))


def _call(case: Case, inputs, kv_scale: float, backend: str):
    q, kv, bt, lens, cu = inputs
    if case.op == "mla_decode" and backend == "aiter":
        return _aiter_decode_call(q, kv, bt, lens, kv_scale)
    # planned here, before timing, as a serving loop plans once per step for all layers
    if case.op == "mla_decode":
        plan = ops.plan_mla_decode(bt, lens, kv.shape[1], q.shape[1], RANK, num_pages=kv.shape[0], backend=backend)
        return lambda: ops.mla_decode_run(q, kv, plan, SM_SCALE, kv_scale=kv_scale)
    plan = ops.plan_mla_extend(bt, cu, lens, kv.shape[1], q.shape[1], RANK, num_pages=kv.shape[0], backend=backend)
    return lambda: ops.mla_extend_run(q, kv, plan, SM_SCALE, kv_scale=kv_scale)


def _row(case, backend, resolved, us, device_name, copy_gbps, commit, kv_bytes, q_bytes) -> dict:
    med = statistics.median(us)
    if case.op == "mla_decode":
        nbytes = mla_decode_bytes(case.batch, case.heads, case.ctx, DIM, RANK, kv_bytes, q_bytes)
        flops = mla_decode_flops(case.batch, case.heads, case.ctx, DIM, RANK)
    else:
        nbytes, flops = extend_bytes(case, kv_bytes, q_bytes), extend_flops(case)
    gbps = nbytes / med / 1e3
    return {"op": case.op, "shape": case.shape,
            "dtype": f"q:{str(case.q_dtype)[6:]};kv:{str(case.kv_dtype)[6:]}", "backend": backend,
            "resolved_backend": resolved, "device": device_name, "median_us": round(med, 2),
            "p20_us": round(_quantile(us, 0.2), 2), "p80_us": round(_quantile(us, 0.8), 2),
            "gb_s": round(gbps, 1), "tflop_s": round(flops / med / 1e6, 3),
            "pct_copy_bw": round(100 * gbps / copy_gbps, 1) if copy_gbps else "", "commit": commit}


def run(cases: list[Case], backends: list[str], repeats: int, device: torch.device, copy_gbps: float | None,
        budget_s: float | None = None) -> list[dict]:
    """Time every case on every backend; returns the CSV rows (also printed as they come)."""
    rows, commit = [], git_commit() or "unknown"
    gen = torch.Generator(device=device).manual_seed(0)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    deadline = None if budget_s is None else time.monotonic() + budget_s
    for i, case in enumerate(cases):
        if deadline is not None and time.monotonic() > deadline:
            print(f"budget of {budget_s:.0f} s spent: skipping {len(cases) - i} larger shape(s): "
                  + ", ".join(f"{c.op}/{c.shape}/{str(c.kv_dtype)[6:]}" for c in cases[i:]), file=sys.stderr)
            break
        try:
            inputs = _inputs(case, device, gen)
        except torch.OutOfMemoryError:
            print(f"skip {case.op}/{case.shape}: out of memory", file=sys.stderr)
            continue
        kv_scale = 1.0 if case.kv_dtype in (torch.bfloat16, torch.float16, torch.float32) else 0.05
        for backend in backends:
            if backend == "torch" and device.type == "cuda" and (
                    case.batch * case.ctx > TORCH_MAX_TOKENS or case.new_tokens * case.ctx > TORCH_MAX_EXTEND_SCORES):
                continue
            try:
                resolved = resolve_backend(case.op, backend, device, case.q_dtype)
            except ops.BackendUnavailableError as exc:
                print(f"skip {backend}: {exc}", file=sys.stderr)
                continue
            try:
                us = _times_us(_call(case, inputs, kv_scale, backend), repeats, device)
            except torch.OutOfMemoryError:
                print(f"skip {case.op}/{case.shape} on {backend}: out of memory", file=sys.stderr)
                continue
            except ops.BackendUnavailableError as exc:  # a limit of the backend for these inputs
                print(f"skip {case.op}/{case.shape}/{str(case.kv_dtype)[6:]} on {backend}: {exc}", file=sys.stderr)
                continue
            rows.append(_row(case, backend, resolved, us, device_name, copy_gbps, commit,
                             inputs[1].element_size(), inputs[0].element_size()))
            print(",".join(str(rows[-1][f]) for f in FIELDS), flush=True)
        del inputs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def summary_markdown(rows: list[dict], copy_gbps: float | None) -> str:
    """Decode and extend rows as a markdown table: median µs, GB/s, % of the copy bandwidth, and
    aiter's median over the row's for the same (op, shape, dtype) where aiter ran."""
    aiter_us = {(r["op"], r["shape"], r["dtype"]): r["median_us"] for r in rows if r["resolved_backend"] == "aiter"}
    lines = [f"Measured copy bandwidth: {copy_gbps:.0f} GB/s" if copy_gbps else "Copy bandwidth: not measured", "",
             "| op | shape | dtype | backend | median µs | GB/s | % copy BW | TFLOP/s | aiter µs / this |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = aiter_us.get((r["op"], r["shape"], r["dtype"]))
        ratio = f"{base / r['median_us']:.2f}" if base else ""
        lines.append(f"| {r['op']} | {r['shape']} | {r['dtype']} | {r['resolved_backend']} | {r['median_us']} | "
                     f"{r['gb_s']} | {r['pct_copy_bw']} | {r['tflop_s']} | {ratio} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", help="write the rows here")
    parser.add_argument("--summary", help="write a markdown summary table here")
    parser.add_argument("--copy-gbps", type=float, default=None, help="reuse a measured copy bandwidth")
    add_kernel_bench_args(parser, "triton hip aiter torch")
    return parse_kernel_bench_args(parser, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpu = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda" if gpu else "cpu")
    if gpu:
        from kvtier.ops._triton import arch_of

        cases = gpu_cases(fp8_kv_dtype(arch_of(device)))
        backends = args.backends or ["triton", "hip", "aiter", "torch"]
    else:
        gpu_cases(torch.float8_e4m3fn)  # the GPU shape list builds on CPU too
        cases = dry_run_cases()
        backends = args.backends or ["torch"]
        args.repeats = min(args.repeats, 2) if args.dry_run else args.repeats
    copy_gbps = args.copy_gbps or measure_copy_gbps(device, 2 * 2**30 if gpu else 64 * 2**20, 10 if gpu else 3)
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s ({device.type})", file=sys.stderr)
    print(",".join(FIELDS))
    rows = run(cases, backends, args.repeats, device, copy_gbps, args.budget_s)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            w.writerows(rows)
    if args.summary:
        with open(args.summary, "w") as f:
            f.write(summary_markdown(rows, copy_gbps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
