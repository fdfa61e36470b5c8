"""The CPU kernel of the paged MLA ops (:mod:`kvtier.ops._cpu_mla`) against the fp32 reference
(:func:`kvtier.reference.mla_extend`, same signature) and the float64 oracle of ``tests/helpers/mla_inputs.py``.

``test_mla`` covers the ops' contract at small sizes, where this kernel takes the reference's
dense path; here the sequences are long enough for the blocked path (prefix and causal block
merged by their log-sum-exps) and cross the CPU attention kernel's block sizes (32-512 rows).
Inputs are adversarial as in ``test_mla``: shuffled pages, NaN in every slot no sequence owns,
a strided cache view and strided queries.
"""

from __future__ import annotations

import pytest
import torch

from kvtier import reference
from kvtier.ops import _cpu_mla
from tests.ops._compare import assert_close
from tests.helpers.mla_inputs import _dense_attention, _make_q, _paged_pool, _rounded

# (seq_len, new tokens): a prompt past one key block; a chunk on a long prefix; a chunk of one
# query block on a prefix ending mid-page; one query on a long context (decode); a short one that
# takes the dense path; no new tokens; an empty sequence.
SEQS = [(700, 700), (1100, 300), (513, 129), (260, 1), (40, 40), (64, 0), (0, 0)]

# dtype, out atol, out rtol, out max cos diff, lse atol (fp32 accumulation over <= 1,100 keys;
# bf16's final cast of out, half an ulp).
DTYPES = [
    pytest.param(torch.float32, 5e-5, 5e-5, 1e-9, 2e-4, id="fp32"),
    pytest.param(torch.bfloat16, 1e-2, 1.6e-2, 2e-5, 2e-4, id="bf16"),
]


def _case(dtype, page_size, seed, kv_lora_rank=64, rope_dim=16, num_heads=5):
    gen = torch.Generator().manual_seed(seed)
    width = kv_lora_rank + rope_dim
    seqs = [_rounded((n, width), dtype, gen) for n, _ in SEQS]
    kv_cache, block_table = _paged_pool(seqs, page_size, dtype, gen, strided=True)
    cu = [0]
    for _, n_q in SEQS:
        cu.append(cu[-1] + n_q)
    q = _make_q((cu[-1], num_heads, width), dtype, gen, strided=True)
    return seqs, q, kv_cache, block_table, torch.tensor(cu, dtype=torch.int32), \
        torch.tensor([n for n, _ in SEQS], dtype=torch.int32)


def test_the_blocked_kernel_is_the_one_tested():
    assert _cpu_mla.available(), "this torch lacks aten::_scaled_dot_product_flash_attention_for_cpu"


@pytest.mark.parametrize("dtype, out_atol, out_rtol, out_cos, lse_atol", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_extend_matches_the_dense_oracle_and_the_reference(dtype, out_atol, out_rtol, out_cos, lse_atol, page_size):
    sm_scale, rank = 0.13, 64
    seqs, q, kv_cache, block_table, cu, seq_lens = _case(dtype, page_size, 300 + page_size)

    out, lse = _cpu_mla.mla_extend(q, kv_cache, block_table, cu, seq_lens, sm_scale, rank)
    ref_out, ref_lse = reference.mla_extend(q, kv_cache, block_table, cu, seq_lens, sm_scale, rank)

    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == ref_out.shape
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all()), "NaN/inf leaked into extend"
    want_out = torch.empty(out.shape, dtype=torch.float64)
    want_lse = torch.empty(lse.shape, dtype=torch.float64)
    bounds = cu.tolist()
    for b, seq in enumerate(seqs):
        s, e = bounds[b], bounds[b + 1]
        want_out[s:e], want_lse[s:e] = _dense_attention(q[s:e], seq, e - s, sm_scale, rank)
    assert_close(out, want_out, atol=out_atol, rtol=out_rtol, max_cos_diff=out_cos, name="out vs oracle")
    assert_close(lse, want_lse, atol=lse_atol, rtol=1e-5, name="lse vs oracle")
    assert_close(out, ref_out, atol=out_atol, rtol=out_rtol, name="out vs reference")
    assert_close(lse, ref_lse, atol=lse_atol, rtol=1e-5, name="lse vs reference")


def test_decode_matches_the_reference_with_empty_sequences_and_an_fp8_cache():
    gen = torch.Generator().manual_seed(9)
    rank, rope, heads, kv_scale = 64, 16, 4, 0.25
    lens = [900, 0, 4100, 1, 0]
    seqs = [_rounded((n, rank + rope), torch.float32, gen) / kv_scale for n in lens]
    kv_cache, block_table = _paged_pool([s.to(torch.float8_e4m3fn).float() for s in seqs], 16,
                                        torch.float32, gen, strided=False)
    kv_cache = kv_cache.to(torch.float8_e4m3fn)  # NaN pages stay NaN in e4m3fn
    q = _rounded((len(lens), heads, rank + rope), torch.bfloat16, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = torch.full((len(lens), heads, rank), 7.0, dtype=torch.bfloat16)

    got, lse = _cpu_mla.mla_decode(q, kv_cache, block_table, seq_lens, 0.2, rank, out=out, kv_scale=kv_scale)
    ref_out, ref_lse = reference.mla_decode(q, kv_cache, block_table, seq_lens, 0.2, rank, kv_scale=kv_scale)

    assert got is out
    empty = seq_lens == 0
    assert bool((out[empty] == 0).all()) and bool(torch.isposinf(lse[empty]).all())
    assert_close(out, ref_out, atol=1e-2, rtol=1.6e-2, name="out")
    assert_close(lse, ref_lse, atol=2e-4, rtol=1e-5, name="lse")


def test_the_ops_use_it_on_the_cpu(monkeypatch):
    """``torch.ops.kvtier.mla_extend`` on a CPU tensor runs this kernel (the fp32 reference is not
    the CPU path any more)."""
    from kvtier import ops

    calls = []
    real = _cpu_mla.mla_extend
    monkeypatch.setattr(_cpu_mla, "mla_extend", lambda *a, **k: calls.append(1) or real(*a, **k))
    seqs, q, kv_cache, block_table, cu, seq_lens = _case(torch.float32, 16, 5)
    out, _ = ops.mla_extend(q, kv_cache, block_table, cu, seq_lens, 0.13, 64)
    assert calls and bool(torch.isfinite(out).all())


@pytest.mark.parametrize("dtype, out_atol, out_rtol, out_cos, lse_atol", DTYPES)
def test_a_decode_batch_runs_as_one_padded_kernel_call_and_matches(monkeypatch, dtype, out_atol, out_rtol, out_cos,
                                                                    lse_atol):
    """Lengths within ``PAD_FACTOR`` of each other (an empty sequence among them) run as one
    padded, masked kernel call; the padding reads only slots the sequence owns, so the NaN in
    every slot no sequence owns (and in the unused tail of each last page) never reaches out."""
    calls = []
    real = _cpu_mla._decode_batched
    monkeypatch.setattr(_cpu_mla, "_decode_batched", lambda *a, **k: calls.append(1) or real(*a, **k))
    gen = torch.Generator().manual_seed(11)
    rank, rope, heads = 64, 16, 4
    lens = [300, 0, 257, 333, 1 if dtype == torch.float32 else 290]
    seqs = [_rounded((n, rank + rope), dtype, gen) for n in lens]
    kv_cache, block_table = _paged_pool(seqs, 16, dtype, gen, strided=True)
    q = _make_q((len(lens), heads, rank + rope), dtype, gen, strided=True)
    seq_lens = torch.tensor(lens, dtype=torch.int32)

    out, lse = _cpu_mla.mla_decode(q, kv_cache, block_table, seq_lens, 0.2, rank)
    ref_out, ref_lse = reference.mla_decode(q, kv_cache, block_table, seq_lens, 0.2, rank)

    assert calls == [1], "the batch did not take the padded kernel call"
    assert out.dtype == dtype and out.shape == ref_out.shape and lse.dtype == torch.float32
    assert bool(torch.isfinite(out).all()), "NaN from a slot no sequence owns leaked into out"
    assert bool((out[1] == 0).all()) and bool(torch.isposinf(lse[1]).all())
    live = seq_lens > 0
    assert_close(out[live], ref_out[live], atol=out_atol, rtol=out_rtol, max_cos_diff=out_cos, name="out")
    assert_close(lse[live], ref_lse[live], atol=lse_atol, rtol=1e-5, name="lse")


def test_the_decode_op_takes_the_batched_call_on_the_cpu(monkeypatch):
    """``kvtier.ops.mla_decode`` (the model's path; it passes ``kv_scale=1.0``) reaches the
    batched call for a bf16 cache and bf16 queries."""
    from kvtier import ops

    calls = []
    real = _cpu_mla._decode_batched
    monkeypatch.setattr(_cpu_mla, "_decode_batched", lambda *a, **k: calls.append(1) or real(*a, **k))
    gen = torch.Generator().manual_seed(12)
    lens = [40, 33, 47]
    seqs = [_rounded((n, 80), torch.bfloat16, gen) for n in lens]
    kv_cache, block_table = _paged_pool(seqs, 16, torch.bfloat16, gen, strided=False)
    q = _rounded((len(lens), 4, 80), torch.bfloat16, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out, lse = ops.mla_decode(q, kv_cache, block_table, seq_lens, 0.2, 64)
    ref_out, ref_lse = reference.mla_decode(q, kv_cache, block_table, seq_lens, 0.2, 64)
    assert calls == [1]
    assert_close(out, ref_out, atol=1e-2, rtol=1.6e-2, name="out")
    assert_close(lse, ref_lse, atol=2e-4, rtol=1e-5, name="lse")


def test_a_decode_steps_layers_share_one_gather_and_a_refilled_table_gets_its_own(monkeypatch):
    """The layers of a step pass the same block_table and seq_lens: the slots and mask are built
    once; lengths refilled in place (a new step in the same buffers) are read again, never reused."""
    calls, built = [], []
    real_build = _cpu_mla._DecodeGather
    monkeypatch.setattr(_cpu_mla, "_DecodeGather", lambda *a: built.append(1) or real_build(*a))
    gen = torch.Generator().manual_seed(13)
    lens = [70, 65, 80]
    seqs = [_rounded((n, 80), torch.bfloat16, gen) for n in lens]
    kv_cache, block_table = _paged_pool(seqs, 16, torch.bfloat16, gen, strided=False)
    q = _rounded((len(lens), 4, 80), torch.bfloat16, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    for _ in range(3):  # three layers of one step
        out, lse = _cpu_mla.mla_decode(q, kv_cache, block_table, seq_lens, 0.2, 64)
        calls.append(out)
    assert built == [1]
    ref_out, _ = reference.mla_decode(q, kv_cache, block_table, seq_lens, 0.2, 64)
    assert_close(calls[-1], ref_out, atol=1e-2, rtol=1.6e-2, name="out")
    seq_lens.copy_(torch.tensor([60, 64, 1], dtype=torch.int32))  # shorter: the rest of each page is NaN-free data
    out, lse = _cpu_mla.mla_decode(q, kv_cache, block_table, seq_lens, 0.2, 64)
    assert built == [1, 1]
    ref_out, ref_lse = reference.mla_decode(q, kv_cache, block_table, seq_lens, 0.2, 64)
    assert_close(out, ref_out, atol=1e-2, rtol=1.6e-2, name="out after refill")
    assert_close(lse, ref_lse, atol=2e-4, rtol=1e-5, name="lse after refill")


def test_a_cache_whose_pages_are_not_evenly_strided_is_read_and_written_slot_by_slot():
    """A cache view with gaps between pages (no ``[num_pages * page_size, D]`` row view) takes the
    two-index gather and the reference's write, with the same results."""
    gen = torch.Generator().manual_seed(21)
    wide = torch.full((6, 20, 80), float("nan"), dtype=torch.bfloat16)
    kv_cache = wide[:, :16]  # 16 slots a page, 20 apart
    assert kv_cache.stride(0) != kv_cache.shape[1] * kv_cache.stride(1)
    rows = _rounded((5, 80), torch.bfloat16, gen)
    slots = torch.tensor([17, -1, 3, 95, 40])
    _cpu_mla.concat_and_cache_mla(rows[:, :64], rows[:, 64:], kv_cache, slots)
    want = torch.full_like(wide, float("nan"))
    reference.concat_and_cache_mla(rows[:, :64], rows[:, 64:], want[:, :16], slots)
    assert torch.equal(wide.isnan(), want.isnan()) and torch.equal(wide.nan_to_num(), want.nan_to_num())
    keep = slots[slots >= 0]
    got = _cpu_mla._read_slots(kv_cache, keep[None])
    assert torch.equal(got[0], kv_cache[keep // 16, keep % 16])
