"""Every kernel op once at a small shape under torch.profiler (``kvtier kernels --profile DIR``).

Each op runs inside its ``record_function("kvtier::<op>")`` range, so the Chrome trace written to
``DIR/kvtier_kernels.json`` (open it in https://ui.perfetto.dev or chrome://tracing) shows one
named range per op with the GPU kernels it launched beneath it. Every op is called once before
profiling (Triton compiles on first use), then once under the profiler.

Shapes: K2 widths where cheap (kv_lora_rank 512 + rope 64, page size 64, 8 heads, E=16 top-4,
vocab 4096), small batch; fp32 on CPU, bf16 on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from kvtier import ops
from kvtier.ops.dispatch import resolve_backend

RANK, ROPE, PAGE, HEADS = 512, 64, 64, 8


def kernel_calls(device: torch.device, backend: str) -> list[tuple[str, Callable[[], object]]]:
    """(op name, zero-argument call) for every kernel op at a small shape on ``device``."""
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, device=device, generator=gen).to(dt)

    kv = randn(8, PAGE, RANK + ROPE)
    block_table = torch.randperm(8, device=device, generator=gen).to(torch.int32).view(2, 4)
    seq_lens = torch.tensor([200, 97], dtype=torch.int32, device=device)
    cu = torch.tensor([0, 16, 33], dtype=torch.int32, device=device)
    q_dec, q_ext = randn(2, HEADS, RANK + ROPE), randn(33, HEADS, RANK + ROPE)
    experts, top_k, hidden, inter = 16, 4, 256, 128
    x, logits = randn(8, hidden), randn(8, experts, dt=torch.float32)
    bias = torch.zeros(experts, device=device)
    w13, w2 = randn(experts, 2 * inter, hidden) * hidden ** -0.5, randn(experts, hidden, inter) * inter ** -0.5
    weights, ids = ops.moe_route(logits, bias, top_k, 4, 2, 2.827, backend="torch")
    vocab_logits = randn(4, 4096, dt=torch.float32)
    temperature, top_p = torch.full((4,), 0.8, device=device), torch.full((4,), 0.9, device=device)
    pools = [randn(8, PAGE, RANK + ROPE) for _ in range(2)]
    pages = torch.tensor([5, 1, 6], device=device)
    staging = ops.gather_pages(pools, pages, backend="torch")
    b = backend
    return [
        ("mla_decode", lambda: ops.mla_decode(q_dec, kv, block_table, seq_lens, 0.13, RANK, backend=b)),
        ("mla_extend", lambda: ops.mla_extend(q_ext, kv, block_table, cu, seq_lens, 0.13, RANK, backend=b)),
        ("moe_route", lambda: ops.moe_route(logits, bias, top_k, 4, 2, 2.827, backend=b)),
        ("fused_moe", lambda: ops.fused_moe(x, w13, w2, weights, ids, backend=b)),
        ("sample", lambda: ops.sample(vocab_logits, temperature, top_p, generator=gen, backend=b)),
        ("gather_pages", lambda: ops.gather_pages(pools, pages, backend=b)),
        ("scatter_pages", lambda: ops.scatter_pages(staging, pools, pages, backend=b)),
    ]


def profile_kernels(out_dir: Path, device: torch.device, backend: str = "auto") -> Path:
    """Run every op once (warm-up), then once under torch.profiler; returns the trace path."""
    calls = kernel_calls(device, backend)
    for name, call in calls:
        call()
        print(f"{name:14s} backend={resolve_backend(name, backend, device, torch.float32)}")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _, call in calls:
            call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "kvtier_kernels.json"
    prof.export_chrome_trace(str(path))
    return path
