"""``gather_pages`` / ``scatter_pages`` with ``backend="triton"`` (interpreter on CPU) against the
reference and the native copy engine's page-first layout; shuffled pages, NaN in unselected pages."""

from __future__ import annotations

import math

import pytest
import torch

from kvtier import reference
from kvtier.ops.pages import gather_pages, scatter_pages


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _pools(num_layers, num_pages, page_size, row, dtype, seed, stride_pad=0):
    gen = torch.Generator().manual_seed(seed)
    pools = []
    for _ in range(num_layers):
        base = torch.randn(num_pages, page_size * row + stride_pad, generator=gen).to(dtype)
        pools.append(base[:, :page_size * row].view(num_pages, page_size, row) if not stride_pad
                     else base[:, :page_size * row].unflatten(1, (page_size, row)))
    return pools


def _bits(t):
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.uint8],
                         ids=["bf16", "fp32", "fp16", "u8"])
@pytest.mark.parametrize("num_layers, num_pages, page_size, row, num_blocks", [
    (3, 7, 1, 5, 3),      # odd everything: int16/int8 words
    (2, 9, 16, 36, 5),
    (4, 6, 4, 576, 6),    # K2 row, every page moved
])
def test_gather_then_scatter_match_reference(dtype, num_layers, num_pages, page_size, row, num_blocks):
    pools = _pools(num_layers, num_pages, page_size, row, torch.float32, seed=row)
    pools = [(p * 50).to(dtype) for p in pools]
    pages = torch.randperm(num_pages, generator=torch.Generator().manual_seed(1))[:num_blocks]
    unselected = sorted(set(range(num_pages)) - set(pages.tolist()))
    if dtype.is_floating_point:
        for p in pools:
            p[unselected] = math.nan  # must not leak into staging
    staging = gather_pages(pools, pages, backend="triton")
    assert staging.shape == (num_blocks, num_layers, page_size, row) and staging.dtype == dtype
    assert torch.equal(_bits(staging), _bits(reference.gather_pages(pools, pages)))
    if dtype.is_floating_point:
        assert not torch.isnan(staging.float()).any()

    targets = [torch.full_like(p, 7) for p in pools]
    dest = torch.randperm(num_pages, generator=torch.Generator().manual_seed(2))[:num_blocks].to(torch.int32)
    scatter_pages(staging, targets, dest, backend="triton")
    want = [torch.full_like(p, 7) for p in pools]
    reference.scatter_pages(staging, want, dest)
    for layer, (got, exp) in enumerate(zip(targets, want)):
        assert torch.equal(_bits(got), _bits(exp)), f"layer {layer}"


def test_strided_pools_and_out_argument():
    pools = _pools(2, 5, 3, 8, torch.bfloat16, seed=3, stride_pad=6)  # pages 6 elements apart beyond their size
    pages = torch.tensor([4, 0, 4])  # repeats are fine for gather
    out = torch.empty(3, 2, 3, 8, dtype=torch.bfloat16)
    got = gather_pages(pools, pages, out=out, backend="triton")
    assert got is out
    assert torch.equal(_bits(got), _bits(reference.gather_pages(pools, pages)))


def test_layout_matches_native_copy_engine():
    transfer = pytest.importorskip("kvtier.transfer")
    pools = _pools(3, 8, 4, 12, torch.bfloat16, seed=5)
    pages = [6, 1, 3]
    staging = torch.empty(len(pages) * 3 * 4 * 12 * 2, dtype=torch.uint8)
    engine = transfer.CopyEngine(num_threads=1)
    handle = engine.gather(pools, pages, staging)
    assert handle.result() == [0, 0, 0]
    ours = gather_pages(pools, torch.tensor(pages), backend="triton")
    assert torch.equal(_bits(ours).flatten(), staging)


def test_zero_blocks():
    pools = _pools(2, 4, 2, 3, torch.float32, seed=0)
    assert gather_pages(pools, torch.empty(0, dtype=torch.int64), backend="triton").shape == (0, 2, 2, 3)
    scatter_pages(torch.empty(0, 2, 2, 3), pools, torch.empty(0, dtype=torch.int64), backend="triton")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rejects_bad_pages_and_staging(backend):
    pools = _pools(2, 4, 2, 3, torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"pages must be in \[0, num_pages=4\)"):
        gather_pages(pools, torch.tensor([0, 4]), backend=backend)
    with pytest.raises(ValueError, match="distinct"):
        scatter_pages(torch.zeros(2, 2, 2, 3), pools, torch.tensor([1, 1]), backend=backend)
    with pytest.raises(ValueError, match="staging"):
        scatter_pages(torch.zeros(2, 3, 2, 3), pools, torch.tensor([1, 2]), backend=backend)
    with pytest.raises(ValueError, match=r"kv_pools\[1\]"):
        gather_pages([pools[0], pools[1].double()], torch.tensor([0]), backend=backend)
