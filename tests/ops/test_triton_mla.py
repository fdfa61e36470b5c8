"""Triton paged MLA kernels under the interpreter (``TRITON_INTERPRET=1``, CPU) vs a float64 oracle.

Same adversarial inputs as ``test_mla.py`` (shuffled pages, NaN in unused pages, tail slots and
the padding of non-contiguous views, an in-range NaN page right after each row's last page),
with ``2**31 - 1`` in the other unused ``block_table`` entries, and zero-length sequences.
The interpreter computes the dots in fp32 (its bf16/fp16 arithmetic is not faithful), so the
error left is fp32 accumulation plus the final cast: the same tolerances as the reference.

The default run stays small (K2's 576-wide rows only at tiny batches); ``-m slow`` adds a wider
sweep.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from kvtier import ops  # noqa: E402
from kvtier.ops import _triton_mla  # noqa: E402
from tests.ops._compare import assert_close  # noqa: E402
from tests.helpers.mla_inputs import SENTINEL, _dense_attention, _make_q, _paged_pool, _rounded  # noqa: E402

HUGE = 2**31 - 1


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# dtype, out atol, out rtol, out max cos diff, lse atol (as in test_mla.DTYPES)
DTYPES = [
    pytest.param(torch.float32, 2e-5, 2e-5, 1e-10, 1e-4, id="fp32"),
    pytest.param(torch.bfloat16, 1e-2, 1.6e-2, 2e-5, 1e-4, id="bf16"),
    pytest.param(torch.float16, 2e-3, 2e-3, 1e-6, 1e-4, id="fp16"),
]
HEADS = [1, 3, 8, 16]
PAGE_SIZES = [1, 16, 64]
DECODE_LENS = [17, 0, 1, 97, 64, 0]  # zero in the middle and at the end; 64 fills a page exactly


def _pool(seqs, page_size, dtype, gen, strided=True):
    kv_cache, block_table = _paged_pool(seqs, page_size, dtype, gen, strided=strided)
    block_table[block_table == SENTINEL] = HUGE
    return kv_cache, block_table


def _decode_case(dtype, num_heads, rank, rope, page_size, lens, seed, strided=True):
    gen = torch.Generator().manual_seed(seed)
    seqs = [_rounded((n, rank + rope), dtype, gen) for n in lens]
    kv_cache, block_table = _pool(seqs, page_size, dtype, gen, strided)
    q = _make_q((len(lens), num_heads, rank + rope), dtype, gen, strided=strided)
    return seqs, kv_cache, block_table, q, torch.tensor(lens, dtype=torch.int32)


def _decode_oracle(q, seqs, sm_scale, rank, kv_scale=1.0):
    want_out = torch.zeros(q.shape[0], q.shape[1], rank, dtype=torch.float64)
    want_lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float64)
    for b, seq in enumerate(seqs):
        o, s = _dense_attention(q[b:b + 1], seq.double() * kv_scale, 1, sm_scale, rank)
        want_out[b], want_lse[b] = o[0], s[0]
    return want_out, want_lse


def _check_decode(out, lse, q, seqs, lens, sm_scale, rank, tol, kv_scale=1.0):
    out_atol, out_rtol, out_cos, lse_atol = tol
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    nonzero = lens > 0
    assert bool(torch.isfinite(out[nonzero]).all()), "NaN/inf from unused pages or slots leaked into out"
    assert bool((out[~nonzero] == 0).all()), "zero-length sequences must give out = 0"
    assert bool(torch.isposinf(lse[~nonzero]).all()), "zero-length sequences must give lse = +inf"
    want_out, want_lse = _decode_oracle(q, seqs, sm_scale, rank, kv_scale)
    assert_close(out, want_out, atol=out_atol, rtol=out_rtol, max_cos_diff=out_cos, name="out")
    assert_close(lse, want_lse, atol=lse_atol, rtol=1e-5, name="lse")


@pytest.mark.parametrize("dtype, out_atol, out_rtol, out_cos, lse_atol", DTYPES)
@pytest.mark.parametrize("num_heads", HEADS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_triton_decode_matches_dense(dtype, out_atol, out_rtol, out_cos, lse_atol, num_heads, page_size):
    seqs, kv_cache, block_table, q, lens = _decode_case(dtype, num_heads, 32, 16, page_size, DECODE_LENS,
                                                        100 + num_heads + page_size)
    out, lse = ops.mla_decode(q, kv_cache, block_table, lens, 0.3, 32, backend="triton")
    _check_decode(out, lse, q, seqs, lens, 0.3, 32, (out_atol, out_rtol, out_cos, lse_atol))


@pytest.mark.parametrize("num_splits", [2, 5, 16])
@pytest.mark.parametrize("dtype, out_atol, out_rtol, out_cos, lse_atol", DTYPES[:2])
def test_triton_decode_split_kv_merge(num_splits, dtype, out_atol, out_rtol, out_cos, lse_atol):
    """Several key slices per sequence, including empty slices (16 splits of a 1-token sequence)."""
    seqs, kv_cache, block_table, q, lens = _decode_case(dtype, 3, 24, 8, 16, DECODE_LENS, 7 + num_splits)
    out = q.new_empty(q.shape[0], 3, 24)
    lse = _triton_mla.mla_decode(q, kv_cache, block_table, lens, 0.3, 24, 1.0, out, num_splits=num_splits)
    _check_decode(out, lse, q, seqs, lens, 0.3, 24, (out_atol, out_rtol, out_cos, lse_atol))


@pytest.mark.parametrize("dtype, out_atol, out_rtol, out_cos, lse_atol", DTYPES)
def test_triton_decode_k2_width(dtype, out_atol, out_rtol, out_cos, lse_atol):
    """K2's 512 + 64 rows, 3 heads, page size 64, K2's YaRN sm_scale; tiny batch (interpreter cost)."""
    seqs, kv_cache, block_table, q, lens = _decode_case(dtype, 3, 512, 64, 64, [0, 70, 1], 42)
    out, lse = ops.mla_decode(q, kv_cache, block_table, lens, 0.130861, 512, backend="triton")
    _check_decode(out, lse, q, seqs, lens, 0.130861, 512, (out_atol, out_rtol, out_cos, lse_atol))


FP8 = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]


def _fp8_pool(lens, rank, rope, page_size, fp8, kv_scale, gen):
    """fp8 pages holding kv / kv_scale; returns the dequantised fp32 sequences the oracle sees."""
    seqs = [(torch.randn(n, rank + rope, generator=gen) / kv_scale).to(fp8) for n in lens]
    kv_cache, block_table = _pool([s.float() for s in seqs], page_size, torch.float32, gen, strided=False)
    return seqs, kv_cache.to(fp8), block_table  # NaN survives the cast (both formats have a NaN)


@pytest.mark.parametrize("fp8", FP8, ids=["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("page_size", [16, 64])
def test_triton_decode_fp8_kv(fp8, page_size):
    gen = torch.Generator().manual_seed(page_size)
    kv_scale = 0.37
    seqs, kv_cache, block_table = _fp8_pool(DECODE_LENS, 32, 16, page_size, fp8, kv_scale, gen)
    q = _rounded((len(DECODE_LENS), 3, 48), torch.bfloat16, gen)
    lens = torch.tensor(DECODE_LENS, dtype=torch.int32)
    out, lse = ops.mla_decode(q, kv_cache, block_table, lens, 0.3, 32, kv_scale=kv_scale, backend="triton")
    ref_out, ref_lse = ops.mla_decode(q, kv_cache, block_table, lens, 0.3, 32, kv_scale=kv_scale, backend="torch")
    tol = (1e-2, 1.6e-2, 2e-5, 1e-4)  # bf16 out; fp8 values are exact in fp32, so only accumulation + cast
    _check_decode(out, lse, q, [s.float() for s in seqs], lens, 0.3, 32, tol, kv_scale)
    _check_decode(ref_out, ref_lse, q, [s.float() for s in seqs], lens, 0.3, 32, tol, kv_scale)


# (seq_len, new tokens): 1-token prompt, a full prefill, a chunk on a long prefix, no new tokens,
# an empty sequence, a chunk ending exactly on a 64-token page boundary.
EXTEND_SEQS = [(1, 1), (17, 17), (97, 5), (40, 0), (0, 0), (64, 3)]


def _extend_case(dtype, num_heads, rank, rope, page_size, spec, seed, strided=True):
    gen = torch.Generator().manual_seed(seed)
    seqs = [_rounded((n, rank + rope), dtype, gen) for n, _ in spec]
    kv_cache, block_table = _pool(seqs, page_size, dtype, gen, strided)
    cu = [0]
    for _, n_q in spec:
        cu.append(cu[-1] + n_q)
    q = _make_q((cu[-1], num_heads, rank + rope), dtype, gen, strided=strided)
    return seqs, kv_cache, block_table, q, cu, torch.tensor([n for n, _ in spec], dtype=torch.int32)


def _check_extend(out, lse, q, seqs, cu, spec, sm_scale, rank, tol):
    out_atol, out_rtol, out_cos, lse_atol = tol
    assert out.dtype == q.dtype and out.shape == (cu[-1], q.shape[1], rank)
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all()), "NaN/inf leaked into extend"
    want_out = torch.empty(cu[-1], q.shape[1], rank, dtype=torch.float64)
    want_lse = torch.empty(cu[-1], q.shape[1], dtype=torch.float64)
    for b, seq in enumerate(seqs):
        want_out[cu[b]:cu[b + 1]], want_lse[cu[b]:cu[b + 1]] = _dense_attention(
            q[cu[b]:cu[b + 1]], seq, spec[b][1], sm_scale, rank)
    assert_close(out, want_out, atol=out_atol, rtol=out_rtol, max_cos_diff=out_cos, name="out")
    assert_close(lse, want_lse, atol=lse_atol, rtol=1e-5, name="lse")


@pytest.mark.parametrize("dtype, out_atol, out_rtol, out_cos, lse_atol", DTYPES)
@pytest.mark.parametrize("num_heads", HEADS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_triton_extend_matches_dense_causal(dtype, out_atol, out_rtol, out_cos, lse_atol, num_heads, page_size):
    seqs, kv_cache, block_table, q, cu, lens = _extend_case(dtype, num_heads, 32, 16, page_size, EXTEND_SEQS,
                                                            200 + num_heads + page_size)
    out, lse = ops.mla_extend(q, kv_cache, block_table, torch.tensor(cu, dtype=torch.int32), lens, 0.3, 32,
                              backend="triton")
    _check_extend(out, lse, q, seqs, cu, EXTEND_SEQS, 0.3, 32, (out_atol, out_rtol, out_cos, lse_atol))


def test_triton_extend_k2_width_fp8():
    """K2's 576-wide rows from an fp8 cache: a 3-token chunk on a 61-token prefix, page size 64."""
    gen = torch.Generator().manual_seed(9)
    spec, kv_scale = [(64, 3), (2, 2)], 0.5
    seqs, kv_cache, block_table = _fp8_pool([n for n, _ in spec], 512, 64, 64, torch.float8_e4m3fn, kv_scale, gen)
    q = _rounded((5, 2, 576), torch.bfloat16, gen)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    lens = torch.tensor([64, 2], dtype=torch.int32)
    out, lse = ops.mla_extend(q, kv_cache, block_table, cu, lens, 0.130861, 512, kv_scale=kv_scale, backend="triton")
    _check_extend(out, lse, q, [s.double() * kv_scale for s in seqs], [0, 3, 5], spec, 0.130861, 512,
                  (1e-2, 1.6e-2, 2e-5, 1e-4))


def test_triton_decode_into_strided_out_and_empty_batch():
    seqs, kv_cache, block_table, q, lens = _decode_case(torch.bfloat16, 3, 16, 8, 4, [5, 0, 12], 3)
    buf = torch.full((3, 3, 20), 7.0, dtype=torch.bfloat16)
    view = buf[:, :, 2:18]
    got, lse = ops.mla_decode(q, kv_cache, block_table, lens, 0.3, 16, out=view, backend="triton")
    assert got.data_ptr() == view.data_ptr()
    assert bool((buf[:, :, :2] == 7.0).all()) and bool((buf[:, :, 18:] == 7.0).all()), "wrote outside out"
    _check_decode(view, lse, q, seqs, lens, 0.3, 16, (1e-2, 1.6e-2, 2e-5, 1e-4))
    out, lse = ops.mla_decode(torch.empty(0, 2, 24), torch.randn(2, 4, 24), torch.empty(0, 3, dtype=torch.int32),
                              torch.empty(0, dtype=torch.int32), 0.2, 16, backend="triton")
    assert out.shape == (0, 2, 16) and lse.shape == (0, 2)


def test_decode_num_splits_planner():
    plan = _triton_mla.decode_num_splits
    assert plan(1, 64, 128 * 1024, 132) == 64  # one long sequence: as many slices as allowed
    assert plan(128, 64, 4096, 132) == 1  # 512 programs already: no split
    assert plan(1, 8, 200, 132) == 1  # too short to split
    assert all(1 <= plan(b, h, n, 304) <= _triton_mla.MAX_KV_SPLITS
               for b in (1, 7, 128) for h in (1, 8, 64) for n in (0, 64, 4096, 131072))


# ---------------------------------------------------------------------------------------------
# wider sweep (-m slow)


@pytest.mark.slow
@pytest.mark.parametrize("dtype, out_atol, out_rtol, out_cos, lse_atol", DTYPES)
@pytest.mark.parametrize("num_heads", [5, 16, 17, 64])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("strided", [True, False], ids=["strided", "contiguous"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_decode_sweep_slow(dtype, out_atol, out_rtol, out_cos, lse_atol, num_heads, page_size, strided,
                                  num_splits):
    lens = [300, 0, 1, 129, 64]
    seqs, kv_cache, block_table, q, lens_t = _decode_case(dtype, num_heads, 40, 24, page_size, lens,
                                                          num_heads * 7 + page_size, strided)
    out = q.new_empty(q.shape[0], num_heads, 40)
    lse = _triton_mla.mla_decode(q, kv_cache, block_table, lens_t, 0.25, 40, 1.0, out, num_splits=num_splits)
    _check_decode(out, lse, q, seqs, lens_t, 0.25, 40, (out_atol, out_rtol, out_cos, lse_atol))


@pytest.mark.slow
@pytest.mark.parametrize("dtype, out_atol, out_rtol, out_cos, lse_atol", DTYPES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_triton_k2_width_sweep_slow(dtype, out_atol, out_rtol, out_cos, lse_atol, page_size):
    tol = (out_atol, out_rtol, out_cos, lse_atol)
    seqs, kv_cache, block_table, q, lens = _decode_case(dtype, 16, 512, 64, page_size, [130, 0, 64], 5)
    out, lse = ops.mla_decode(q, kv_cache, block_table, lens, 0.130861, 512, backend="triton")
    _check_decode(out, lse, q, seqs, lens, 0.130861, 512, tol)
    spec = [(70, 6), (0, 0), (9, 9)]
    seqs, kv_cache, block_table, q, cu, lens = _extend_case(dtype, 8, 512, 64, page_size, spec, 6)
    out, lse = ops.mla_extend(q, kv_cache, block_table, torch.tensor(cu, dtype=torch.int32), lens, 0.130861, 512,
                              backend="triton")
    _check_extend(out, lse, q, seqs, cu, spec, 0.130861, 512, tol)


@pytest.mark.slow
@pytest.mark.parametrize("dtype, out_atol, out_rtol, out_cos, lse_atol", DTYPES)
@pytest.mark.parametrize("num_heads", [2, 7, 33])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_triton_extend_sweep_slow(dtype, out_atol, out_rtol, out_cos, lse_atol, num_heads, page_size):
    spec = [(150, 37), (3, 1), (65, 65), (0, 0), (128, 2)]
    seqs, kv_cache, block_table, q, cu, lens = _extend_case(dtype, num_heads, 24, 8, page_size, spec,
                                                            num_heads + page_size, strided=False)
    out, lse = ops.mla_extend(q, kv_cache, block_table, torch.tensor(cu, dtype=torch.int32), lens, 0.3, 24,
                              backend="triton")
    _check_extend(out, lse, q, seqs, cu, spec, 0.3, 24, (out_atol, out_rtol, out_cos, lse_atol))
