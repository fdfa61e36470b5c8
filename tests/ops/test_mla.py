"""Paged MLA ops (mla_decode, mla_extend, concat_and_cache_mla) against a dense float64 oracle.

The oracle is written in tests/helpers/mla_inputs.py, not imported from :mod:`kvtier.reference` (the op's torch backend
*is* that reference, so comparing to it would prove nothing). Each sequence's tokens are drawn
as one contiguous ``[L, D]`` tensor; the test scatters them into a paged pool itself and the
oracle does plain softmax attention on the contiguous rows in float64.

Every paged case is adversarial (docs/kernels.md, "Adversarial paged inputs", after FlashMLA's ``generate_test_data``):
- the page pool is shuffled (``randperm`` page ids, so block tables are not monotone);
- unused pages, unused tail slots of partly filled pages, and the padding columns of the
  non-contiguous cache view are NaN, so any stray read poisons the output;
- the first unused ``block_table`` entry of each row points at a real NaN page (an in-range
  id that must not be read), the rest hold the huge sentinel ``2147480000``;
- decode batches include zero-length sequences (documented result: ``out = 0``, ``lse = +inf``).
"""

from __future__ import annotations

import math

import pytest
import torch

from kvtier import ops
from tests.helpers.mla_inputs import SENTINEL, _dense_attention, _make_q, _paged_pool, _rounded
from tests.ops._compare import assert_close


# dtype, out atol, out rtol, out max cos diff, lse atol. The inputs are rounded to dtype before the
# oracle sees them, so the error left is the op's own: fp32 accumulation over <= 97 keys (lse) and
# the final cast of out to dtype (half an ulp: 2^-9 bf16, 2^-12 fp16, relative).
DTYPES = [
    pytest.param(torch.float32, 2e-5, 2e-5, 1e-10, 1e-4, id="fp32"),
    pytest.param(torch.bfloat16, 1e-2, 1.6e-2, 2e-5, 1e-4, id="bf16"),
    pytest.param(torch.float16, 2e-3, 2e-3, 1e-6, 1e-4, id="fp16"),
]

# num_heads (odd on purpose), kv_lora_rank, qk_rope_head_dim, sm_scale.
SHAPES = [
    pytest.param(1, 40, 8, 48 ** -0.5, id="h1-r40-rope8"),
    pytest.param(17, 24, 8, 0.3, id="h17-r24-rope8"),
    # Kimi K2 / DeepSeek-V3 widths: 512 latent + 64 rope = 576; K2's YaRN sm_scale.
    pytest.param(3, 512, 64, 0.130861, id="h3-k2-576"),
]

PAGE_SIZES = [1, 16, 64]


@pytest.mark.parametrize("dtype, out_atol, out_rtol, out_cos, lse_atol", DTYPES)
@pytest.mark.parametrize("num_heads, kv_lora_rank, rope_dim, sm_scale", SHAPES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("strided", [True, False], ids=["strided-cache", "contiguous-cache"])
def test_mla_decode_matches_dense(dtype, out_atol, out_rtol, out_cos, lse_atol, num_heads, kv_lora_rank, rope_dim,
                                  sm_scale, page_size, strided):
    gen = torch.Generator().manual_seed(1000 + page_size + num_heads)
    width = kv_lora_rank + rope_dim
    seq_lens = [17, 0, 1, 97, 64, 0]  # zero in the middle and at the end; 64 fills pages exactly
    seqs = [_rounded((n, width), dtype, gen) for n in seq_lens]
    kv_cache, block_table = _paged_pool(seqs, page_size, dtype, gen, strided=strided)
    q = _make_q((len(seq_lens), num_heads, width), dtype, gen, strided=strided)

    out, lse = ops.mla_decode(q, kv_cache, block_table, torch.tensor(seq_lens, dtype=torch.int32), sm_scale,
                              kv_lora_rank)

    assert out.dtype == dtype and lse.dtype == torch.float32
    want_out = torch.zeros(len(seq_lens), num_heads, kv_lora_rank, dtype=torch.float64)
    want_lse = torch.empty(len(seq_lens), num_heads, dtype=torch.float64)
    for b, seq in enumerate(seqs):
        o, s = _dense_attention(q[b:b + 1], seq, 1, sm_scale, kv_lora_rank)
        want_out[b], want_lse[b] = o[0], s[0]
    nonzero = torch.tensor(seq_lens) > 0
    assert bool(torch.isfinite(out[nonzero]).all()), "NaN/inf from unused pages or slots leaked into out"
    assert bool((out[~nonzero] == 0).all()), "zero-length sequences must give out = 0"
    assert bool(torch.isposinf(lse[~nonzero]).all()), "zero-length sequences must give lse = +inf"
    assert_close(out, want_out, atol=out_atol, rtol=out_rtol, max_cos_diff=out_cos, name="out")
    assert_close(lse, want_lse, atol=lse_atol, rtol=1e-5, name="lse")


# (seq_len, new tokens): a 1-token prompt, a full prefill, a chunk on a long prefix, a sequence with
# no new tokens this step, an empty one, and a chunk ending exactly on a 64-token page boundary.
EXTEND_SEQS = [(1, 1), (17, 17), (97, 5), (40, 0), (0, 0), (64, 3)]


@pytest.mark.parametrize("dtype, out_atol, out_rtol, out_cos, lse_atol", DTYPES)
@pytest.mark.parametrize("num_heads, kv_lora_rank, rope_dim, sm_scale", SHAPES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_mla_extend_matches_dense_causal(dtype, out_atol, out_rtol, out_cos, lse_atol, num_heads, kv_lora_rank,
                                         rope_dim, sm_scale, page_size):
    gen = torch.Generator().manual_seed(2000 + page_size + num_heads)
    width = kv_lora_rank + rope_dim
    seqs = [_rounded((n, width), dtype, gen) for n, _ in EXTEND_SEQS]
    kv_cache, block_table = _paged_pool(seqs, page_size, dtype, gen, strided=True)
    n_qs = [n_q for _, n_q in EXTEND_SEQS]
    cu = [0]
    for n_q in n_qs:
        cu.append(cu[-1] + n_q)
    q = _make_q((cu[-1], num_heads, width), dtype, gen, strided=True)

    out, lse = ops.mla_extend(q, kv_cache, block_table, torch.tensor(cu, dtype=torch.int32),
                              torch.tensor([n for n, _ in EXTEND_SEQS], dtype=torch.int32), sm_scale, kv_lora_rank)

    assert out.shape == (cu[-1], num_heads, kv_lora_rank) and lse.shape == (cu[-1], num_heads)
    want_out = torch.empty(cu[-1], num_heads, kv_lora_rank, dtype=torch.float64)
    want_lse = torch.empty(cu[-1], num_heads, dtype=torch.float64)
    for b, seq in enumerate(seqs):
        want_out[cu[b]:cu[b + 1]], want_lse[cu[b]:cu[b + 1]] = _dense_attention(
            q[cu[b]:cu[b + 1]], seq, n_qs[b], sm_scale, kv_lora_rank)
    # every new token sees at least itself, so nothing may be non-finite
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all()), "NaN/inf leaked into extend"
    assert_close(out, want_out, atol=out_atol, rtol=out_rtol, max_cos_diff=out_cos, name="out")
    assert_close(lse, want_lse, atol=lse_atol, rtol=1e-5, name="lse")


def test_mla_extend_is_causal_future_keys_do_not_matter():
    """Changing the last key of a prefill changes only the last query's output (a property check)."""
    gen = torch.Generator().manual_seed(7)
    seq_len, heads, rank, rope = 9, 3, 16, 8
    seq = _rounded((seq_len, rank + rope), torch.float32, gen)
    q = _rounded((seq_len, heads, rank + rope), torch.float32, gen)
    args = (torch.tensor([0, seq_len], dtype=torch.int32), torch.tensor([seq_len], dtype=torch.int32), 0.25, rank)
    kv_a, bt_a = _paged_pool([seq], 4, torch.float32, torch.Generator().manual_seed(1), strided=False)
    seq_b = seq.clone()
    seq_b[-1] += 5.0
    kv_b, bt_b = _paged_pool([seq_b], 4, torch.float32, torch.Generator().manual_seed(1), strided=False)
    out_a, lse_a = ops.mla_extend(q, kv_a, bt_a, *args)
    out_b, lse_b = ops.mla_extend(q, kv_b, bt_b, *args)
    assert torch.equal(out_a[:-1], out_b[:-1]) and torch.equal(lse_a[:-1], lse_b[:-1])
    assert not torch.allclose(out_a[-1], out_b[-1])


def test_mla_decode_equals_last_row_of_extend():
    """Decode of a sequence == the last query of a prefill of the same tokens (two entry points, one math)."""
    gen = torch.Generator().manual_seed(11)
    seq_len, heads, rank, rope = 23, 5, 32, 16
    seq = _rounded((seq_len, rank + rope), torch.float32, gen)
    kv_cache, block_table = _paged_pool([seq], 8, torch.float32, gen, strided=True)
    q = _rounded((seq_len, heads, rank + rope), torch.float32, gen)
    lens = torch.tensor([seq_len], dtype=torch.int32)
    out_e, lse_e = ops.mla_extend(q, kv_cache, block_table, torch.tensor([0, seq_len], dtype=torch.int32), lens,
                                  0.2, rank)
    out_d, lse_d = ops.mla_decode(q[-1:], kv_cache, block_table, lens, 0.2, rank)
    assert_close(out_d[0], out_e[-1], atol=1e-6, rtol=1e-6, name="out")
    assert_close(lse_d[0], lse_e[-1], atol=1e-6, rtol=1e-6, name="lse")


def test_mla_decode_writes_into_strided_out():
    gen = torch.Generator().manual_seed(3)
    rank, rope, heads = 16, 8, 3
    seqs = [_rounded((n, rank + rope), torch.bfloat16, gen) for n in (5, 0, 12)]
    kv_cache, block_table = _paged_pool(seqs, 4, torch.bfloat16, gen, strided=True)
    q = _rounded((3, heads, rank + rope), torch.bfloat16, gen)
    buf = torch.full((3, heads, rank + 4), 7.0, dtype=torch.bfloat16)
    out_view = buf[:, :, 2:2 + rank]
    lens = torch.tensor([5, 0, 12], dtype=torch.int32)
    got, lse = ops.mla_decode(q, kv_cache, block_table, lens, 0.3, rank, out=out_view)
    assert got.data_ptr() == out_view.data_ptr()
    fresh, fresh_lse = ops.mla_decode(q, kv_cache, block_table, lens, 0.3, rank)
    assert torch.equal(out_view, fresh) and torch.equal(lse, fresh_lse)
    assert bool((buf[:, :, :2] == 7.0).all()) and bool((buf[:, :, 2 + rank:] == 7.0).all()), "wrote outside out"
    assert bool((out_view[1] == 0).all())


def test_mla_decode_empty_batch():
    out, lse = ops.mla_decode(torch.empty(0, 2, 24), torch.randn(2, 4, 24), torch.empty(0, 3, dtype=torch.int32),
                              torch.empty(0, dtype=torch.int32), 0.2, 16)
    assert out.shape == (0, 2, 16) and lse.shape == (0, 2)


# ---------------------------------------------------------------------------------------------
# concat_and_cache_mla


# kv_c/k_pe dtype, cache dtype (the op casts rows to the cache dtype).
CACHE_DTYPES = [
    pytest.param(torch.float32, torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, torch.bfloat16, id="bf16"),
    pytest.param(torch.float16, torch.float16, id="fp16"),
    pytest.param(torch.float32, torch.bfloat16, id="fp32-into-bf16"),
]


@pytest.mark.parametrize("in_dtype, cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("kv_lora_rank, rope_dim", [(512, 64), (24, 8)], ids=["k2-576", "r24-rope8"])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_concat_and_cache_mla_writes_only_mapped_slots(in_dtype, cache_dtype, page_size, kv_lora_rank, rope_dim,
                                                      slot_dtype):
    gen = torch.Generator().manual_seed(page_size + kv_lora_rank)
    width = kv_lora_rank + rope_dim
    num_tokens = 17
    num_pages = math.ceil(2 * num_tokens / page_size) + 1  # room for unmapped slots
    num_slots = num_pages * page_size
    # strided view of a wider buffer with random (finite) old contents everywhere, padding included
    wide = _rounded((num_pages, page_size, width + 6), cache_dtype, gen)
    kv_cache = wide[:, :, 2:2 + width]
    before = wide.clone()
    kv_c = _rounded((num_tokens, kv_lora_rank), in_dtype, gen)
    k_pe = _rounded((num_tokens, rope_dim), in_dtype, gen)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]  # distinct, scattered over pages
    slots[::3] = -1  # skipped tokens (padding)
    ops.concat_and_cache_mla(kv_c, k_pe, kv_cache, slots.to(slot_dtype))

    expected = before.clone()
    view = expected[:, :, 2:2 + width]
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            view[slot // page_size, slot % page_size, :kv_lora_rank] = kv_c[t].to(cache_dtype)
            view[slot // page_size, slot % page_size, kv_lora_rank:] = k_pe[t].to(cache_dtype)
    assert int((slots >= 0).sum()) > 0 and int((slots < 0).sum()) > 0
    assert torch.equal(wide, expected), "mapped slots wrong, or a skipped/unmapped slot or padding column changed"


def test_concat_and_cache_mla_round_trip_through_decode():
    """Tokens written by concat_and_cache_mla into a shuffled NaN pool decode like the dense oracle."""
    gen = torch.Generator().manual_seed(5)
    rank, rope, heads, page_size = 32, 8, 3, 16
    lens = [19, 0, 33]
    num_pages = 8
    kv_cache = torch.full((num_pages, page_size, rank + rope), math.nan)
    perm = torch.randperm(num_pages, generator=gen).tolist()
    block_table = torch.full((len(lens), 3), SENTINEL, dtype=torch.int32)
    seqs, slot_list, nxt = [], [], 0
    for b, n in enumerate(lens):
        seqs.append(_rounded((n, rank + rope), torch.float32, gen))
        for p in range(math.ceil(n / page_size)):
            block_table[b, p] = perm[nxt]
            nxt += 1
        slot_list += [int(block_table[b, i // page_size]) * page_size + i % page_size for i in range(n)]
    tokens = torch.cat(seqs)
    ops.concat_and_cache_mla(tokens[:, :rank], tokens[:, rank:], kv_cache, torch.tensor(slot_list))
    q = _rounded((len(lens), heads, rank + rope), torch.float32, gen)
    out, lse = ops.mla_decode(q, kv_cache, block_table, torch.tensor(lens, dtype=torch.int32), 0.2, rank)
    for b, seq in enumerate(seqs):
        want_out, want_lse = _dense_attention(q[b:b + 1], seq, 1, 0.2, rank)
        assert_close(out[b:b + 1], want_out, atol=2e-5, rtol=2e-5, name=f"out[{b}]")
        assert_close(lse[b:b + 1], want_lse, atol=1e-4, rtol=1e-5, name=f"lse[{b}]")


# ---------------------------------------------------------------------------------------------
# argument checks: the message names the argument


def _decode_args(**over):
    args = dict(q=torch.randn(2, 3, 24), kv_cache=torch.randn(4, 4, 24),
                block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                seq_lens=torch.tensor([5, 8], dtype=torch.int32), sm_scale=0.2, kv_lora_rank=16)
    args.update(over)
    return args


def test_decode_block_table_int64_rejected():
    with pytest.raises(ValueError, match="block_table"):
        ops.mla_decode(**_decode_args(block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int64)))


def test_decode_seq_lens_beyond_block_table_capacity_rejected():
    # 2 pages x page_size 4 = 8 tokens of capacity; 9 is one too many
    with pytest.raises(ValueError, match="seq_lens.*exceeds block_table capacity"):
        ops.mla_decode(**_decode_args(seq_lens=torch.tensor([5, 9], dtype=torch.int32)))


def test_decode_negative_seq_lens_rejected():
    with pytest.raises(ValueError, match="seq_lens"):
        ops.mla_decode(**_decode_args(seq_lens=torch.tensor([5, -1], dtype=torch.int32)))


def test_decode_q_width_mismatch_rejected():
    with pytest.raises(ValueError, match=r"^q must have shape .*24\), got \(2, 3, 23\)"):
        ops.mla_decode(**_decode_args(q=torch.randn(2, 3, 23)))


def test_decode_q_batch_mismatch_rejected():
    with pytest.raises(ValueError, match=r"^q must have shape"):
        ops.mla_decode(**_decode_args(q=torch.randn(3, 3, 24)))


def test_decode_kv_lora_rank_out_of_range_rejected():
    with pytest.raises(ValueError, match="kv_lora_rank"):
        ops.mla_decode(**_decode_args(kv_lora_rank=24))


def test_decode_out_wrong_dtype_rejected():
    with pytest.raises(ValueError, match="out"):
        ops.mla_decode(**_decode_args(), out=torch.empty(2, 3, 16, dtype=torch.bfloat16))


def _extend_args(**over):
    args = dict(q=torch.randn(4, 3, 24), kv_cache=torch.randn(4, 4, 24),
                block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                cu_seqlens_q=torch.tensor([0, 1, 4], dtype=torch.int32),
                seq_lens=torch.tensor([5, 8], dtype=torch.int32), sm_scale=0.2, kv_lora_rank=16)
    args.update(over)
    return args


def test_extend_baseline_args_are_valid():
    out, lse = ops.mla_extend(**_extend_args())
    assert out.shape == (4, 3, 16) and bool(torch.isfinite(lse).all())


def test_extend_more_new_tokens_than_seq_len_rejected():
    with pytest.raises(ValueError, match="seq_lens"):
        ops.mla_extend(**_extend_args(seq_lens=torch.tensor([5, 2], dtype=torch.int32)))


def test_extend_cu_seqlens_not_ending_at_total_q_rejected():
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        ops.mla_extend(**_extend_args(cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32)))


def test_extend_decreasing_cu_seqlens_rejected():
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        ops.mla_extend(**_extend_args(cu_seqlens_q=torch.tensor([0, 5, 4], dtype=torch.int32)))


def test_extend_cu_seqlens_not_starting_at_zero_rejected():
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        ops.mla_extend(**_extend_args(cu_seqlens_q=torch.tensor([1, 1, 4], dtype=torch.int32)))


def test_concat_slot_out_of_cache_rejected():
    kv_cache = torch.zeros(2, 4, 24)
    with pytest.raises(ValueError, match="slot_mapping"):
        ops.concat_and_cache_mla(torch.randn(2, 16), torch.randn(2, 8), kv_cache, torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="slot_mapping"):
        ops.concat_and_cache_mla(torch.randn(2, 16), torch.randn(2, 8), kv_cache, torch.tensor([0, -2]))
    assert bool((kv_cache == 0).all()), "a rejected call must not write"


def test_concat_k_pe_width_mismatch_rejected():
    with pytest.raises(ValueError, match="k_pe"):
        ops.concat_and_cache_mla(torch.randn(2, 16), torch.randn(2, 7), torch.zeros(2, 4, 24), torch.tensor([0, 1]))


def test_concat_integer_kv_cache_rejected():
    with pytest.raises(ValueError, match="kv_cache"):
        ops.concat_and_cache_mla(torch.randn(2, 16), torch.randn(2, 8), torch.zeros(2, 4, 24, dtype=torch.int64),
                                 torch.tensor([0, 1]))
