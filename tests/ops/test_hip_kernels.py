"""The HIP kernels (``kvtier._hip``, ``backend="hip"``) on a GPU against the torch references and
against their C++ CPU implementations, at K2 widths (the decode sweep against the torch reference
is ``test_mla_decode_on_gpu`` in test_gpu_kernels.py, parametrised over triton and hip).

Marked ``gpu``: skipped without a CUDA/ROCm device, and skipped with the build's reason when
``kvtier._hip`` is not built (``pytest -m gpu``; run by ``perf/gpu_check.sh``, which builds it).
Paged inputs are adversarial: shuffled pages, NaN in unused pages and tail slots, a huge sentinel
in unused ``block_table`` entries, zero-length sequences, a non-contiguous cache view.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvtier import ops, reference
from kvtier.ops import _native
from kvtier.ops.dispatch import unavailable_reason
from tests.ops._compare import assert_close
from tests.helpers.gpu_mla_inputs import RANK, ROPE, SM_SCALE, _fp8, _paged

_HIP_REASON = unavailable_reason("mla_decode", "hip", "cuda") if torch.cuda.is_available() else None

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
              pytest.mark.skipif(_HIP_REASON is not None, reason=f"backend 'hip' unavailable: {_HIP_REASON}")]

BF16_TOL = {"atol": 1e-2, "rtol": 1.6e-2, "max_cos_diff": 2e-5}


@pytest.mark.parametrize("num_splits", [1, 5, 64])
def test_hip_mla_decode_forced_splits_and_views(num_splits):
    q, kv, bt, lens = _paged(3, 16, [300, 0, 77], 16, torch.bfloat16)
    padded = torch.full((kv.shape[0], 16, RANK + ROPE + 32), math.nan, device="cuda", dtype=torch.bfloat16)
    padded[..., :RANK + ROPE] = kv
    view = padded[..., :RANK + ROPE]  # rows 1216 bytes apart: not contiguous, still 16-byte aligned
    out = torch.full((3, 16, 2 * RANK), 7.0, device="cuda", dtype=torch.bfloat16)
    lse = _native.mla_decode(_native.gpu_kernels(), q, view, bt, lens, SM_SCALE, RANK, 1.0, out[..., ::2],
                             num_splits=num_splits)
    ref_out, ref_lse = reference.mla_decode(q, kv, bt, lens, SM_SCALE, RANK)
    assert_close(out[..., ::2].float(), ref_out.float(), name="out", **BF16_TOL)
    assert_close(lse, ref_lse, atol=1e-3, rtol=1e-4, name="lse")
    assert bool((out[..., 1::2] == 7.0).all()), "wrote outside out"


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16])
def test_hip_mla_decode_matches_cpu_implementation(q_dtype):
    """Small odd widths (element loads, masked lanes) and the same inputs through both implementations."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(4, 6, 40, generator=gen).to(q_dtype)
    kv = torch.randn(30, 4, 40, generator=gen).to(q_dtype)
    bt = torch.randperm(30, generator=gen).to(torch.int32)[:28].view(4, 7)
    lens = torch.tensor([0, 3, 17, 28], dtype=torch.int32)
    out_cpu = torch.empty(4, 6, 33, dtype=q_dtype)
    lse_cpu = _native.mla_decode(_native.cpu_kernels(), q, kv, bt, lens, 0.3, 33, 1.0, out_cpu, num_splits=3)
    dev = [t.cuda() for t in (q, kv, bt, lens)]
    out_gpu = torch.empty(4, 6, 33, dtype=q_dtype, device="cuda")
    lse_gpu = _native.mla_decode(_native.gpu_kernels(), *dev, 0.3, 33, 1.0, out_gpu, num_splits=3)
    tol = (2e-5, 2e-5) if q_dtype == torch.float32 else (2e-3, 2e-3)
    assert_close(out_gpu.cpu().float(), out_cpu.float(), atol=tol[0], rtol=tol[1], name="out gpu vs cpu")
    assert_close(lse_gpu.cpu(), lse_cpu, atol=2e-5, rtol=1e-5, name="lse gpu vs cpu")


@pytest.mark.parametrize("row, dtype, word", [(576, torch.bfloat16, 16), (5, torch.bfloat16, 2), (7, torch.uint8, 1)])
def test_hip_page_copy_matches_reference(row, dtype, word):
    gen = torch.Generator(device="cuda").manual_seed(0)
    pools = [torch.randint(0, 255, (40, 64 if row > 8 else 3, row), device="cuda", generator=gen,
                           dtype=torch.uint8).to(dtype) for _ in range(3)]
    pages = torch.randperm(40, device="cuda", generator=gen)[:13]
    staging = torch.empty(13, 3, *pools[0].shape[1:], dtype=dtype, device="cuda")
    assert _native.page_copy(_native.gpu_kernels(), pools, pages.to(torch.int32), staging, gather=True) == word
    assert torch.equal(staging, reference.gather_pages(pools, pages))
    staged = ops.gather_pages(pools, pages, backend="hip")
    assert torch.equal(staged, staging)
    fresh = [torch.zeros_like(p) for p in pools]
    ops.scatter_pages(staged, fresh, pages, backend="hip")
    unselected = torch.ones(40, dtype=torch.bool, device="cuda")
    unselected[pages] = False
    for p, f in zip(pools, fresh):
        assert torch.equal(f[pages], p[pages]) and not bool(f[unselected].any())


@pytest.mark.parametrize("num_tokens", [1, 7, 300, 4096])
@pytest.mark.parametrize("block_m", [16, 64])
def test_hip_moe_align_matches_reference(num_tokens, block_m):
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    ids = torch.randint(0, 384, (num_tokens, 8), device="cuda", generator=gen, dtype=torch.int32)
    got = ops.moe_align_block_size(ids, 384, block_m, backend="hip")
    want = ops.moe_align_block_size(ids, 384, block_m, backend="torch")
    for name, g, w in zip(("sorted_ids", "expert_ids", "num_padded"), got, want):
        assert torch.equal(g, w), name
