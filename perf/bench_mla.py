"""Paged MLA decode/extend benchmarks: one CSV row per (op, shape, dtype, backend).

Columns: op, shape, dtype, backend, resolved_backend, device, median_us, p20_us, p80_us, gb_s,
tflop_s, commit. Bytes and FLOPs: :func:`kvtier.reference.mla.mla_decode_bytes` /
``mla_decode_flops`` (the cache is read once per sequence; extend rows use the per-query sum).

Method: K2 widths (kv_lora_rank 512 + rope 64, K2's YaRN sm_scale 0.130861), page size 64, pages
shuffled (random block_table), all sequences at the same context. One warm-up call (compiles),
then ``--repeats`` timed calls; on a GPU each call is timed with CUDA events after writing a
512 MiB buffer (cold L2), and the median/p20/p80 are reported. Seeds are fixed (0).
On a GPU: decode batch 1-128 at 4K-128K context with 64 heads (one GPU) and 8 heads (TP8 rank),
bf16 and fp8 KV, triton (and torch where it fits in time); on CPU: the torch backend at small
shapes (the interpreter is not a timing target).

Usage: python perf/bench_mla.py [--csv out.csv] [--repeats 20] [--backends torch triton]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import subprocess
import sys
import time

import torch

from kvtier import ops
from kvtier.ops.dispatch import resolve_backend
from kvtier.reference.mla import mla_decode_bytes, mla_decode_flops

FIELDS = ["op", "shape", "dtype", "backend", "resolved_backend", "device", "median_us", "p20_us", "p80_us", "gb_s",
          "tflop_s", "commit"]
RANK, ROPE, PAGE, SM_SCALE = 512, 64, 64, 0.130861


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


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


def _decode_inputs(batch, heads, ctx, q_dtype, kv_dtype, device, gen):
    pages_per_seq = -(-ctx // PAGE)
    num_pages = batch * pages_per_seq
    kv = torch.randn(num_pages, PAGE, RANK + ROPE, device=device, dtype=torch.bfloat16, generator=gen).to(kv_dtype)
    perm = torch.randperm(num_pages, device=device, generator=gen).to(torch.int32)
    block_table = perm.view(batch, pages_per_seq)
    q = torch.randn(batch, heads, RANK + ROPE, device=device, dtype=torch.bfloat16, generator=gen).to(q_dtype)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return q, kv, block_table, seq_lens


def _cases(device: torch.device):
    if device.type == "cuda":
        fp8 = torch.float8_e4m3fnuz if "gfx942" in getattr(torch.cuda.get_device_properties(device), "gcnArchName",
                                                           "") else torch.float8_e4m3fn
        for heads in (64, 8):
            for kv_dtype in (torch.bfloat16, fp8):
                for batch in (1, 8, 32, 128):
                    for ctx in (4096, 32768, 131072):
                        yield heads, batch, ctx, torch.bfloat16, kv_dtype
    else:
        for batch in (1, 4):
            for ctx in (256, 1024):
                yield 8, batch, ctx, torch.float32, torch.float32


def run(backends: list[str], repeats: int, device: torch.device) -> list[dict]:
    rows, commit = [], _commit()
    gen = torch.Generator(device=device).manual_seed(0)
    for heads, batch, ctx, q_dtype, kv_dtype in _cases(device):
        try:
            q, kv, bt, lens = _decode_inputs(batch, heads, ctx, q_dtype, kv_dtype, device, gen)
        except torch.OutOfMemoryError:
            print(f"skip b{batch} ctx{ctx}: out of memory", file=sys.stderr)
            continue
        kv_scale = 1.0 if kv_dtype in (torch.bfloat16, torch.float32) else 0.05
        for backend in backends:
            # the fp32 torch reference at long context/large batch would dominate the run time
            if backend == "torch" and device.type == "cuda" and batch * ctx > 32 * 32768:
                continue
            try:
                resolved = resolve_backend("mla_decode", backend, device, q_dtype)
            except ops.BackendUnavailableError as exc:
                print(f"skip {backend}: {exc}", file=sys.stderr)
                continue
            us = _times_us(lambda: ops.mla_decode(q, kv, bt, lens, SM_SCALE, RANK, kv_scale=kv_scale,
                                                  backend=backend), repeats, device)
            med = statistics.median(us)
            nbytes = mla_decode_bytes(batch, heads, ctx, RANK + ROPE, RANK, kv.element_size(), q.element_size())
            flops = mla_decode_flops(batch, heads, ctx, RANK + ROPE, RANK)
            rows.append({"op": "mla_decode", "shape": f"b{batch}-h{heads}-ctx{ctx}-p{PAGE}",
                         "dtype": f"q:{str(q_dtype)[6:]};kv:{str(kv_dtype)[6:]}", "backend": backend,
                         "resolved_backend": resolved,
                         "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                         "median_us": round(med, 2), "p20_us": round(_quantile(us, 0.2), 2),
                         "p80_us": round(_quantile(us, 0.8), 2), "gb_s": round(nbytes / med / 1e3, 1),
                         "tflop_s": round(flops / med / 1e6, 3), "commit": commit})
            print(",".join(str(rows[-1][f]) for f in FIELDS), flush=True)
        del q, kv, bt, lens
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", help="write the rows here")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--backends", nargs="*", default=None, help="default: triton torch on a GPU, torch on CPU")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backends = args.backends or (["triton", "torch"] if device.type == "cuda" else ["torch"])
    print(",".join(FIELDS))
    rows = run(backends, args.repeats, device)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
