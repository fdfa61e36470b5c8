"""The C++ CPU implementations of the HIP kernels (``kvtier._C.kernels_cpu``) against the torch
references, through the same launchers as the GPU kernels (:mod:`kvtier.ops._native`).

Paged inputs are adversarial (docs/kernels.md): shuffled pages, NaN in unused pages and tail slots,
a huge sentinel in unused ``block_table`` entries, zero-length sequences, non-contiguous views.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvtier import ops, reference
from kvtier.ops import _native
from kvtier.ops.dispatch import unavailable_reason
from tests.ops._compare import assert_close

SENTINEL = 2**31 - 1
FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


@pytest.fixture(scope="module")
def lib():
    return _native.cpu_kernels()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# --------------------------------------------------------------------------------------------
# element conversions


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, *FP8])
def test_to_float32_is_exact_for_every_bit_pattern(lib, dtype):
    bits = torch.arange(2 ** (8 * dtype.itemsize), dtype=torch.int32)
    src = bits.to(torch.int16 if dtype.itemsize == 2 else torch.uint8).view(dtype)
    got = torch.empty(src.numel(), dtype=torch.float32)
    lib.to_float32(_native.DTYPE_CODES[dtype], src.data_ptr(), src.numel(), got.data_ptr())
    want = src.float()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    finite = ~torch.isnan(want)
    assert torch.equal(_bits(got[finite]), _bits(want[finite]))  # bitwise: signed zeros, subnormals


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_from_float32_rounds_like_torch(lib, dtype):
    gen = torch.Generator().manual_seed(0)
    edges = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 65504.0, 65519.99, 65520.0, 1e-8, 2.0**-24,
                          2.0**-25, 3 * 2.0**-26, 1.00390625, 1.01171875, 3.4e38, -1.17e-38, 5.9e-39])
    src = torch.cat([edges, torch.randn(20000, generator=gen) * 10.0 ** torch.randint(-9, 6, (20000,), generator=gen),
                     torch.randint(-(2**31), 2**31 - 1, (20000,), generator=gen, dtype=torch.int32).view(torch.float32)])
    got = torch.empty(src.numel(), dtype=dtype)
    lib.from_float32(_native.DTYPE_CODES[dtype], src.data_ptr(), src.numel(), got.data_ptr())
    want = src.to(dtype)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    mismatch = (_bits(got[~nan]).view(torch.int16) != _bits(want[~nan]).view(torch.int16)).nonzero()
    assert mismatch.numel() == 0, f"first mismatch at {src[~nan][mismatch[0]].item()!r}"


# --------------------------------------------------------------------------------------------
# page gather / scatter


def _pools(num_layers, num_pages, page_size, row, dtype, seed, pad=0):
    """Pools whose pages are ``pad`` elements further apart than their size (pad > 0: strided)."""
    gen = torch.Generator().manual_seed(seed)
    base = (torch.randn(num_layers, num_pages, page_size * row + pad, generator=gen) * 50).to(dtype)
    return [b[:, :page_size * row].unflatten(1, (page_size, row)) for b in base]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8], ids=["bf16", "fp32", "u8"])
@pytest.mark.parametrize("num_layers, num_pages, page_size, row, num_blocks, pad, word", [
    (4, 6, 4, 576, 6, 0, 16),   # K2 row: 16-byte words
    (3, 7, 1, 5, 3, 0, None),   # odd everything: narrow words
    (2, 9, 16, 36, 5, 12, None),  # strided pages
])
def test_page_copy_matches_reference(lib, dtype, num_layers, num_pages, page_size, row, num_blocks, pad, word):
    pools = _pools(num_layers, num_pages, page_size, row, dtype, seed=row, pad=pad)
    pages = torch.randperm(num_pages, generator=torch.Generator().manual_seed(1))[:num_blocks]
    if dtype.is_floating_point:
        for p in pools:
            p[sorted(set(range(num_pages)) - set(pages.tolist()))] = math.nan  # must not reach staging
    for index_dtype in (torch.int64, torch.int32):
        staging = torch.empty(num_blocks, num_layers, page_size, row, dtype=dtype)
        used = _native.page_copy(lib, pools, pages.to(index_dtype), staging, gather=True)
        assert word is None or used == word
        assert torch.equal(_bits(staging), _bits(reference.gather_pages(pools, pages)))
    targets = [torch.full_like(p, 7) for p in pools]
    want = [torch.full_like(p, 7) for p in pools]
    dest = torch.randperm(num_pages, generator=torch.Generator().manual_seed(2))[:num_blocks].to(torch.int32)
    _native.page_copy(lib, targets, dest, staging, gather=False)
    reference.scatter_pages(staging, want, dest)
    for layer, (got, exp) in enumerate(zip(targets, want)):
        assert torch.equal(_bits(got), _bits(exp)), f"layer {layer}"


def test_page_copy_repeats_and_zero_blocks(lib):
    pools = _pools(2, 5, 3, 8, torch.bfloat16, seed=3)
    pages = torch.tensor([4, 0, 4])
    staging = torch.empty(3, 2, 3, 8, dtype=torch.bfloat16)
    _native.page_copy(lib, pools, pages, staging, gather=True)
    assert torch.equal(_bits(staging), _bits(reference.gather_pages(pools, pages)))
    empty = torch.empty(0, 2, 3, 8, dtype=torch.bfloat16)
    _native.page_copy(lib, pools, torch.empty(0, dtype=torch.int64), empty, gather=True)


# --------------------------------------------------------------------------------------------
# moe_align_block_size


@pytest.mark.parametrize("num_tokens, top_k, num_experts, block_m", [
    (0, 8, 384, 64), (1, 8, 384, 64), (7, 8, 384, 16), (300, 8, 13, 16), (333, 6, 17, 1), (100, 1, 1, 4),
    (97, 3, 5, 7),
])
def test_moe_align_matches_reference(lib, num_tokens, top_k, num_experts, block_m):
    gen = torch.Generator().manual_seed(num_tokens + num_experts)
    ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen, dtype=torch.int32)
    got = _native.moe_align_block_size(lib, ids, num_experts, block_m)
    want = reference.moe_align_block_size(ids, num_experts, block_m)
    for name, g, w in zip(("sorted_ids", "expert_ids", "num_padded"), got, want):
        assert torch.equal(g, w), name


def test_moe_align_skewed_routing(lib):
    ids = torch.full((600, 4), 3, dtype=torch.int32)  # every pair on one expert, across chunks
    ids[::7, 0] = 0
    got = _native.moe_align_block_size(lib, ids, 8, 32)
    want = reference.moe_align_block_size(ids, 8, 32)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_moe_align_public_op_checks():
    ids = torch.tensor([[0, 3]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"topk_ids must be in \[0, 3\)"):
        ops.moe_align_block_size(ids, 3, 4)
    with pytest.raises(ValueError, match="topk_ids must have dtype"):
        ops.moe_align_block_size(ids.long(), 4, 4)
    with pytest.raises(ops.BackendUnavailableError, match="hip"):
        ops.moe_align_block_size(ids, 4, 4, backend="hip")
    assert ops.moe_align_block_size(ids, 4, 4)[2].item() == 8


# --------------------------------------------------------------------------------------------
# paged MLA decode


def _paged(batch, heads, seq_lens, page_size, rank, rope, q_dtype, kv_dtype, seed, strided=False):
    """Shuffled pages, NaN in unused pages and tail slots, SENTINEL past the used pages; with
    ``strided`` the cache is a view with padded slots and pages, q and out non-contiguous."""
    gen = torch.Generator().manual_seed(seed)
    dim = rank + rope
    pages_per_seq = max(1, -(-max(seq_lens) // page_size)) + 1
    num_pages = batch * pages_per_seq + 3
    pad = 8 if strided else 0
    store = torch.full((num_pages, page_size + (1 if strided else 0), dim + pad), math.nan)
    kv = store[:, :page_size, :dim]
    perm = torch.randperm(num_pages, generator=gen).to(torch.int32)
    block_table = torch.full((batch, pages_per_seq), SENTINEL, dtype=torch.int32)
    for b, n in enumerate(seq_lens):
        used = -(-n // page_size)
        block_table[b, :used] = perm[b * pages_per_seq: b * pages_per_seq + used]
        rows = torch.randn(used * page_size, dim, generator=gen)
        rows[n:] = math.nan  # tail slots of the last page
        kv[block_table[b, :used].long()] = rows.view(used, page_size, dim)
    kv_scale = 1.0
    if kv_dtype in FP8:
        kv_scale = 0.05
        store = (store / kv_scale).to(kv_dtype)
        kv = store[:, :page_size, :dim]
    elif kv_dtype != torch.float32:
        store = store.to(kv_dtype)
        kv = store[:, :page_size, :dim]
    q = torch.randn(batch, heads * (2 if strided else 1), dim, generator=gen).to(q_dtype)
    q = q[:, ::2] if strided else q
    return q, kv, block_table, torch.tensor(seq_lens, dtype=torch.int32), kv_scale


# (q, kv) dtype -> out atol, rtol, cos diff, lse atol vs the fp32 reference (which rounds its out to
# q's dtype too: bf16/fp16 outputs may differ by one rounding step).
MLA_TOL = {
    (torch.float32, torch.float32): (2e-6, 2e-5, 1e-10, 2e-5),
    (torch.float16, torch.float16): (2e-3, 2e-3, 1e-6, 2e-5),
    (torch.bfloat16, torch.bfloat16): (1e-2, 1.6e-2, 2e-5, 2e-5),
    (torch.bfloat16, torch.float8_e4m3fn): (1e-2, 1.6e-2, 2e-5, 2e-5),
    (torch.bfloat16, torch.float8_e4m3fnuz): (1e-2, 1.6e-2, 2e-5, 2e-5),
}


def _check_decode(lib, q, kv, bt, lens, kv_scale, rank, num_splits, sm_scale=0.3, strided_out=False):
    batch, heads, _ = q.shape
    out = torch.full((batch, heads, rank * (2 if strided_out else 1)), 7.0, dtype=q.dtype)
    view = out[..., ::2] if strided_out else out
    lse = _native.mla_decode(lib, q, kv, bt, lens, sm_scale, rank, kv_scale, view, num_splits=num_splits)
    ref_out, ref_lse = reference.mla_decode(q, kv, bt, lens, sm_scale, rank, kv_scale=kv_scale)
    atol, rtol, cos, lse_atol = MLA_TOL[(q.dtype, kv.dtype)]
    assert_close(view.float(), ref_out.float(), atol=atol, rtol=rtol, name="out", max_cos_diff=cos)
    assert_close(lse, ref_lse, atol=lse_atol, rtol=1e-5, name="lse")
    if strided_out:
        assert bool((out[..., 1::2] == 7.0).all()), "wrote outside out"
    return view, lse


@pytest.mark.parametrize("q_dtype, kv_dtype", list(MLA_TOL), ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_mla_decode_matches_reference(lib, q_dtype, kv_dtype, num_splits):
    q, kv, bt, lens, scale = _paged(5, 5, [0, 1, 17, 64, 97], 16, 40, 24, q_dtype, kv_dtype, seed=num_splits)
    out, lse = _check_decode(lib, q, kv, bt, lens, scale, 40, num_splits)
    assert bool((out[0] == 0).all()) and bool(torch.isposinf(lse[0]).all())  # zero-length sequence


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", [1, 17])
def test_mla_decode_strided_views(lib, page_size, heads):
    q, kv, bt, lens, scale = _paged(3, heads, [33, 0, 5], page_size, 32, 16, torch.float32, torch.float32,
                                    seed=page_size + heads, strided=True)
    assert not kv.is_contiguous() and not q.is_contiguous()
    _check_decode(lib, q, kv, bt, lens, scale, 32, 2, strided_out=True)


def test_mla_decode_k2_widths(lib):
    q, kv, bt, lens, scale = _paged(2, 4, [130, 7], 64, 512, 64, torch.bfloat16, torch.bfloat16, seed=9)
    _check_decode(lib, q, kv, bt, lens, scale, 512, 4, sm_scale=0.130861)


def test_mla_decode_splits_agree(lib):
    q, kv, bt, lens, scale = _paged(2, 3, [200, 31], 8, 40, 24, torch.float32, torch.float32, seed=4)
    outs = [torch.empty(2, 3, 40) for _ in range(3)]
    lses = [_native.mla_decode(lib, q, kv, bt, lens, 0.3, 40, scale, o, num_splits=s) for o, s in zip(outs, (1, 7, 64))]
    for o, s in zip(outs[1:], lses[1:]):
        assert_close(o, outs[0], atol=1e-6, rtol=1e-5, name="out vs 1 split")
        assert_close(s, lses[0], atol=1e-5, rtol=1e-6, name="lse vs 1 split")


def test_mla_decode_errors(lib):
    q, kv, bt, lens, scale = _paged(2, 2, [5, 3], 4, 16, 8, torch.float32, torch.float32, seed=0)
    out = torch.empty(2, 2, 16)
    with pytest.raises(ValueError, match=r"supports \(q, kv_cache\) dtypes .* got \(float32, bfloat16\)"):
        _native.mla_decode(lib, q, kv.to(torch.bfloat16), bt, lens, 0.3, 16, scale, out)
    with pytest.raises(ValueError, match=r"kv_cache.stride\(-1\) == 1"):
        _native.mla_decode(lib, q, kv.transpose(1, 2).contiguous().transpose(1, 2), bt, lens, 0.3, 16, scale, out)
    bad = bt.clone()
    bad[0, 0] = SENTINEL  # a used entry out of range: the CPU implementation checks what it reads
    with pytest.raises(IndexError, match=r"block_table\[0, 0\] = 2147483647"):
        _native.mla_decode(lib, q, kv, bad, lens, 0.3, 16, scale, out)
    with pytest.raises(ValueError, match="num_splits must be in"):
        _native.mla_decode(lib, q, kv, bt, lens, 0.3, 16, scale, out, num_splits=0)


def test_hip_backend_reports_why_it_is_unavailable_on_cpu():
    reason = unavailable_reason("mla_decode", "hip", "cpu")
    assert reason is not None and ("not built" in reason or "GPU tensor" in reason)
    q, kv, bt, lens, _ = _paged(1, 2, [3], 4, 16, 8, torch.float32, torch.float32, seed=0)
    with pytest.raises(ops.BackendUnavailableError, match="backend 'hip' is unavailable"):
        ops.mla_decode(q, kv, bt, lens, 0.3, 16, backend="hip")
    with pytest.raises(ops.BackendUnavailableError, match="backend 'hip' is unavailable"):
        ops.gather_pages([kv], torch.tensor([0]), backend="hip")
