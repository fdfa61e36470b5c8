"""The aiter backend: availability reasons, and the layout conversion of its adapters on CPU.

aiter runs only on ROCm, so here a stand-in ``aiter`` package (``aiter.mla``, ``aiter.fused_moe``)
is put in ``sys.modules`` and the availability check is forced for the CPU tensors. The stand-in
follows aiter's documented contract and nothing more (see :func:`_fake_mla_decode_fwd`): it reads
the arguments in aiter's layout (token-level ``kv_indptr``/``kv_indices``, 16 or 128 heads, a
``[pages, page_size, 1, 576]`` buffer), checks their types and shapes, and computes the answer
with kvtier's torch reference from exactly what it received. Comparing ``ops.mla_decode(...,
backend="aiter")`` with ``kvtier.reference`` on the original paged inputs thus checks the
conversion end to end (page -> token indices, head padding and slicing back, lse, zero-length
sequences, kv_scale) on adversarial paged inputs (shuffled pages, NaN in unused pages and slots,
a huge sentinel in unused block_table entries, non-contiguous caches). The real kernels are
checked against the torch reference on a ROCm GPU with aiter installed
(``tests/ops/test_gpu_kernels.py``, ``pytest -m gpu``).
"""

from __future__ import annotations

import importlib.machinery
import math
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
from kvtier import ops, reference
from kvtier.ops import _aiter, dispatch

from tests.ops._compare import assert_close
from tests.helpers.mla_inputs import SENTINEL, _paged_pool, _rounded

ROOT = Path(__file__).resolve().parents[2]
RANK, ROPE, SM_SCALE = 512, 64, 0.130861
DIM = RANK + ROPE
SEQ_LENS = [17, 0, 1, 97, 64, 0]  # zero-length in the middle and at the end; 64 fills pages exactly


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=name == "aiter")
    if name == "aiter":
        mod.__path__ = []
    mod.__dict__.update(attrs)
    return mod


def _fake_mla_decode_fwd(calls):
    """A stand-in for ``aiter.mla.mla_decode_fwd`` (ROCm/aiter v0.1.13 - v0.1.20.post1).

    Contract taken from aiter's source: q [total_s, nhead, 576] bf16 with nhead 16 or 128 (one KV
    head); kv_buffer [num_page, page_size, 1, 576] bf16; o [total_s, nhead, v_head_dim] bf16,
    written in place; qo_indptr, kv_indptr [bs + 1], kv_indices, kv_last_page_lens [bs], all int32;
    page-level ``kv_indptr`` with sequence length ``(pages - 1) * page_size + last_page_len`` when
    ``page_size`` > 1; returns ``(logits, final_lse [total_s, nhead] fp32)`` with
    ``return_lse=True``. For a sequence with no KV, aiter's reduce divides by an empty sum: o is
    NaN and lse -inf here. Arguments past ``max_seqlen_q`` are keyword-only: their positions moved
    between tags (``page_size`` was inserted before ``sm_scale``).
    """

    def mla_decode_fwd(
        q,
        kv_buffer,
        o,
        qo_indptr,
        kv_indptr,
        kv_indices,
        kv_last_page_lens,
        max_seqlen_q,
        *,
        page_size=1,
        nhead_kv=1,
        sm_scale=None,
        logit_cap=0.0,
        num_kv_splits=None,
        num_kv_splits_indptr=None,
        work_meta_data=None,
        q_scale=None,
        kv_scale=None,
        return_lse=False,
        **unused,
    ):
        total_s, nhead, qk_dim = q.shape
        bs = qo_indptr.shape[0] - 1
        assert q.dtype == kv_buffer.dtype == o.dtype == torch.bfloat16
        assert nhead in (16, 128) and nhead_kv == 1 and qk_dim == DIM and q.is_contiguous()
        assert kv_buffer.dim() == 4 and kv_buffer.shape[1] == page_size and kv_buffer.shape[2:] == (1, qk_dim)
        assert o.shape[:2] == (total_s, nhead) and o.is_contiguous()
        for t, n in ((qo_indptr, bs + 1), (kv_indptr, bs + 1), (kv_last_page_lens, bs), (kv_indices, None)):
            assert t.dtype == torch.int32 and t.dim() == 1 and (n is None or t.shape[0] == n)
        assert max_seqlen_q == 1 and torch.equal(qo_indptr, torch.arange(bs + 1, dtype=torch.int32))
        assert sm_scale is not None and logit_cap <= 0 and work_meta_data is None and q_scale is kv_scale is None
        assert not unused, f"unexpected arguments {sorted(unused)}"
        calls.append({"nhead": nhead, "page_size": page_size, "kv_indices": kv_indices.clone()})
        num_used = kv_indptr[1:] - kv_indptr[:-1]
        used = kv_indices[: int(kv_indptr[-1])]
        assert int(num_used.min()) >= 0 and (
            used.numel() == 0 or 0 <= int(used.min()) <= int(used.max()) < kv_buffer.shape[0]
        )
        block_table = torch.zeros(bs, max(int(num_used.max()), 1), dtype=torch.int32)
        for b in range(bs):
            block_table[b, : int(num_used[b])] = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])]
        seq_lens = torch.where(num_used > 0, (num_used - 1) * page_size + kv_last_page_lens, 0).to(torch.int32)
        out, lse = reference.mla_decode(q, kv_buffer[:, :, 0], block_table, seq_lens, sm_scale, o.shape[2])
        empty = (num_used == 0)[:, None]
        o.copy_(out.masked_fill(empty[..., None], math.nan))
        return o, (lse.masked_fill(empty, -math.inf) if return_lse else None)

    return mla_decode_fwd


def _fake_fused_moe(calls):
    """A stand-in for ``aiter.fused_moe.fused_moe``: hidden_states [T, H] bf16/fp16; w1 [E, 2I, H]
    (gate rows then up rows), w2 [E, H, I] of the same dtype (unquantised: default SiLU, no quant
    type); topk_weight [T, k] fp32, topk_ids [T, k] int32; returns [T, H] in hidden_states.dtype."""

    def fused_moe(hidden_states, w1, w2, topk_weight, topk_ids, expert_mask=None, **kwargs):
        num_tokens, hidden = hidden_states.shape
        experts, two_i, _ = w1.shape
        assert hidden_states.dtype in (torch.bfloat16, torch.float16) and w1.dtype == w2.dtype == hidden_states.dtype
        assert w1.shape == (experts, two_i, hidden) and w2.shape == (experts, hidden, two_i // 2)
        assert topk_weight.dtype == torch.float32 and topk_ids.dtype == torch.int32
        assert topk_ids.shape == topk_weight.shape and topk_ids.shape[0] == num_tokens
        assert expert_mask is None and not kwargs, f"unexpected arguments {sorted(kwargs)}"
        calls.append(num_tokens)
        return reference.fused_moe(hidden_states, w1, w2, topk_weight, topk_ids)

    return fused_moe


@pytest.fixture
def fake_aiter(monkeypatch):
    """Install the stand-in aiter and force the aiter backend available; yields the call log."""
    calls = {"mla": [], "moe": []}
    monkeypatch.setitem(sys.modules, "aiter", _module("aiter"))
    monkeypatch.setitem(
        sys.modules, "aiter.mla", _module("aiter.mla", mla_decode_fwd=_fake_mla_decode_fwd(calls["mla"]))
    )
    monkeypatch.setitem(
        sys.modules, "aiter.fused_moe", _module("aiter.fused_moe", fused_moe=_fake_fused_moe(calls["moe"]))
    )
    real = dispatch.unavailable_reason

    def forced(op, backend, device="cpu"):
        if backend == "aiter" and backend in dispatch.implemented_backends(op):
            return None
        return real(op, backend, device)

    monkeypatch.setattr(dispatch, "unavailable_reason", forced)
    monkeypatch.setattr(_aiter, "_padding_warned", set())
    return calls


def _decode_inputs(num_heads, page_size, strided, seed, seq_lens=SEQ_LENS):
    gen = torch.Generator().manual_seed(seed)
    seqs = [_rounded((n, DIM), torch.bfloat16, gen) for n in seq_lens]
    kv_cache, block_table = _paged_pool(seqs, page_size, torch.bfloat16, gen, strided=strided)
    q = _rounded((len(seq_lens), num_heads, DIM), torch.bfloat16, gen)
    return q, kv_cache, block_table, torch.tensor(seq_lens, dtype=torch.int32)


# ---------------------------------------------------------------------------------------------
# the layout conversion, end to end through ops.mla_decode / ops.fused_moe


@pytest.mark.filterwarnings("ignore:kvtier mla_decode on aiter")
@pytest.mark.parametrize("num_heads, padded", [(8, 16), (16, 16), (64, 128), (3, 16)])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("strided", [True, False], ids=["strided-cache", "contiguous-cache"])
def test_mla_decode_on_aiter_matches_reference(fake_aiter, num_heads, padded, page_size, strided):
    q, kv_cache, block_table, seq_lens = _decode_inputs(num_heads, page_size, strided, seed=page_size + num_heads)

    out, lse = ops.mla_decode(q, kv_cache, block_table, seq_lens, SM_SCALE, RANK, backend="aiter")

    assert [c["nhead"] for c in fake_aiter["mla"]] == [padded] and fake_aiter["mla"][0]["page_size"] == 1
    want_out, want_lse = reference.mla_decode(q, kv_cache, block_table, seq_lens, SM_SCALE, RANK)
    assert out.shape == (len(SEQ_LENS), num_heads, RANK) and out.dtype == torch.bfloat16
    assert_close(out, want_out, atol=1e-2, rtol=1.6e-2, max_cos_diff=2e-5, name="out")
    assert_close(lse, want_lse, atol=1e-5, rtol=1e-5, name="lse")
    empty = seq_lens == 0
    assert bool((out[empty] == 0).all()) and bool(torch.isposinf(lse[empty]).all())


def test_mla_decode_on_aiter_kv_scale_and_out(fake_aiter):
    q, kv_cache, block_table, seq_lens = _decode_inputs(128, 16, True, seed=5)
    buf = torch.full((len(SEQ_LENS), 128, RANK + 4), 7.0, dtype=torch.bfloat16)
    out_view = buf[:, :, 2 : 2 + RANK]

    got, lse = ops.mla_decode(
        q, kv_cache, block_table, seq_lens, SM_SCALE, RANK, kv_scale=0.37, out=out_view, backend="aiter"
    )

    assert got.data_ptr() == out_view.data_ptr() and fake_aiter["mla"][0]["nhead"] == 128
    want_out, want_lse = reference.mla_decode(q, kv_cache, block_table, seq_lens, SM_SCALE, RANK, kv_scale=0.37)
    assert_close(got, want_out, atol=1e-2, rtol=1.6e-2, max_cos_diff=2e-5, name="out")
    assert_close(lse, want_lse, atol=1e-5, rtol=1e-5, name="lse")
    assert bool((buf[:, :, :2] == 7.0).all()) and bool((buf[:, :, 2 + RANK :] == 7.0).all()), "wrote outside out"


def test_head_padding_warns_once_per_head_count(fake_aiter):
    q, kv_cache, block_table, seq_lens = _decode_inputs(8, 16, False, seed=1, seq_lens=[5, 0])
    with pytest.warns(RuntimeWarning, match="8 query heads padded to 16"):
        ops.mla_decode(q, kv_cache, block_table, seq_lens, SM_SCALE, RANK, backend="aiter")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.mla_decode(q, kv_cache, block_table, seq_lens, SM_SCALE, RANK, backend="aiter")
        ops.mla_decode(q.repeat(1, 2, 1), kv_cache, block_table, seq_lens, SM_SCALE, RANK, backend="aiter")  # 16
    assert [c["nhead"] for c in fake_aiter["mla"]] == [16, 16, 16]


def test_mla_decode_on_aiter_all_empty_and_empty_batch(fake_aiter):
    q, kv_cache, block_table, seq_lens = _decode_inputs(16, 4, False, seed=2, seq_lens=[0, 0])
    out, lse = ops.mla_decode(q, kv_cache, block_table, seq_lens, SM_SCALE, RANK, backend="aiter")
    assert bool((out == 0).all()) and bool(torch.isposinf(lse).all())
    out, lse = ops.mla_decode(q[:0], kv_cache, block_table[:0], seq_lens[:0], SM_SCALE, RANK, backend="aiter")
    assert out.shape == (0, 16, RANK) and lse.shape == (0, 16)
    assert len(fake_aiter["mla"]) == 1  # the empty batch never reaches aiter


def test_token_indices_expand_pages_and_pack_sequences():
    block_table = torch.tensor([[5, 2, SENTINEL], [SENTINEL, SENTINEL, SENTINEL], [0, 7, 3]], dtype=torch.int32)
    kv_indptr, kv_indices = _aiter.token_indices(block_table, torch.tensor([6, 0, 9], dtype=torch.int32), 4)
    assert kv_indptr.tolist() == [0, 6, 7, 16] and kv_indptr.dtype == kv_indices.dtype == torch.int32
    assert kv_indices.shape == (3 * 3 * 4,)
    assert kv_indices[:16].tolist() == [
        20,
        21,
        22,
        23,
        8,
        9,  # pages 5, 2: six tokens
        0,  # the empty sequence's dummy token
        0,
        1,
        2,
        3,
        28,
        29,
        30,
        31,
        12,
    ]  # pages 0, 7, 3: nine tokens


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fused_moe_on_aiter_with_moe_route_ids(fake_aiter, dtype):
    gen = torch.Generator().manual_seed(3)
    num_tokens, experts, top_k, hidden, inter = 7, 16, 4, 32, 24
    logits = torch.randn(num_tokens, experts, generator=gen)
    weights, ids = ops.moe_route(logits, torch.zeros(experts), top_k, 4, 2, 2.827)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).to(dtype)

    got = ops.fused_moe(x, w13, w2, weights, ids, backend="aiter")

    assert fake_aiter["moe"] == [num_tokens] and got.dtype == dtype
    assert torch.equal(got, reference.fused_moe(x, w13, w2, weights, ids))
    assert ops.fused_moe(x[:0], w13, w2, weights[:0], ids[:0], backend="aiter").shape == (0, hidden)
    assert fake_aiter["moe"] == [num_tokens]  # no tokens: aiter is not called


def test_inputs_aiter_cannot_take_raise_backend_unavailable(fake_aiter):
    q, kv_cache, block_table, seq_lens = _decode_inputs(16, 16, False, seed=4, seq_lens=[3])
    cases = [
        ((q.float(), kv_cache), RANK, "bf16 q"),
        ((q, kv_cache.to(torch.float8_e4m3fn)), RANK, "bf16 kv_cache"),
        ((q.repeat(1, 9, 1)[:, :129], kv_cache), RANK, "at most 128 query heads"),
        ((q[..., : DIM - 8], kv_cache[..., : DIM - 8]), RANK, "512 latent"),
        ((q, kv_cache[::2]), RANK, "one stride apart"),
    ]
    for (q_in, kv_in), rank, match in cases:
        with pytest.raises(ops.BackendUnavailableError, match=match):
            ops.mla_decode(
                q_in, kv_in, block_table, seq_lens.clamp(max=kv_in.shape[1]), SM_SCALE, rank, backend="aiter"
            )
    x, w13, w2 = torch.randn(2, 8), torch.randn(4, 6, 8), torch.randn(4, 8, 3)
    with pytest.raises(ops.BackendUnavailableError, match="bf16 or fp16"):
        ops.fused_moe(x, w13, w2, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int32), backend="aiter")
    assert fake_aiter == {"mla": [], "moe": []}


# ---------------------------------------------------------------------------------------------
# availability: each reason, in the order the dispatcher checks them


@pytest.mark.skipif(torch.version.hip is not None, reason="ROCm build")
@pytest.mark.parametrize("op", ["mla_decode", "fused_moe"])
def test_aiter_unavailable_without_rocm(op):
    assert dispatch.unavailable_reason(op, "aiter", "cuda") == "aiter needs ROCm (this torch is built without HIP)"


def test_aiter_unavailable_reasons_in_order(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    monkeypatch.setattr(dispatch, "_has_module", lambda name: False)
    assert dispatch.unavailable_reason("mla_decode", "aiter", "cuda") == "aiter not installed"
    monkeypatch.setattr(dispatch, "_has_module", lambda name: name == "aiter")
    assert dispatch.unavailable_reason("fused_moe", "aiter", "cpu") == "aiter needs a GPU tensor, got device type 'cpu'"
    assert "no 'aiter' implementation" in dispatch.unavailable_reason("mla_extend", "aiter", "cuda")
    for version, mla_reason, moe_reason in [
        ("0.1.20.post1", None, None),
        ("0.1.14.dev3+g1234abc", None, None),
        ("0.1.12", "needs amd-aiter >= 0.1.13, found 0.1.12", None),
        ("0.1.4", "needs amd-aiter >= 0.1.13, found 0.1.4", "needs amd-aiter >= 0.1.5, found 0.1.4"),
        (None, "cannot read the installed version", "cannot read the installed version"),
    ]:
        monkeypatch.setattr(_aiter, "installed_version", lambda v=version: v)
        for op, want in (("mla_decode", mla_reason), ("fused_moe", moe_reason)):
            reason = dispatch.unavailable_reason(op, "aiter", "cuda")
            assert (reason is None) if want is None else (want in reason), (version, op, reason)
    with pytest.raises(ops.BackendUnavailableError, match="cannot read the installed version"):
        ops.resolve_backend("mla_decode", "aiter", "cuda", torch.bfloat16)
    assert ops.resolve_backend("mla_decode", "auto", "cuda", torch.bfloat16) != "aiter"  # auto never picks aiter


# ---------------------------------------------------------------------------------------------
# the plan / run split, and the benchmark's aiter call


def test_token_indices_of_an_empty_table():
    kv_indptr, kv_indices = _aiter.token_indices(
        torch.empty(2, 0, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), 4
    )
    assert kv_indptr.tolist() == [0, 1, 2] and kv_indices.shape == (8,) and kv_indices[:2].tolist() == [0, 0]


def test_one_plan_serves_many_calls(fake_aiter):
    q, kv_cache, block_table, seq_lens = _decode_inputs(16, 16, True, seed=6)
    plan = _aiter.plan_mla_decode(block_table, seq_lens, 16)
    for layer in range(2):
        q_layer = q * (layer + 1)
        out = torch.empty(q.shape[0], 16, RANK, dtype=torch.bfloat16)
        lse = _aiter.run_mla_decode(plan, q_layer, kv_cache, SM_SCALE, RANK, 1.0, out)
        want_out, want_lse = ops.mla_decode(q_layer, kv_cache, block_table, seq_lens, SM_SCALE, RANK, backend="aiter")
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    with pytest.raises(ValueError, match="plan is for page_size 16"):
        _aiter.run_mla_decode(plan, q, kv_cache.view(-1, 8, DIM), SM_SCALE, RANK, 1.0, out)


def test_bench_mla_times_aiter_through_the_adapter(fake_aiter):
    sys.path.insert(0, str(ROOT / "perf"))
    try:
        import bench_mla
    finally:
        sys.path.remove(str(ROOT / "perf"))
    case = bench_mla.Case("mla_decode", 8, 2, 200, 1, torch.bfloat16)
    inputs = bench_mla._inputs(case, torch.device("cpu"), torch.Generator().manual_seed(0))
    with pytest.warns(RuntimeWarning, match="8 query heads padded to 16"):
        lse = bench_mla._call(case, inputs, 1.0, "aiter")()  # the timed call returns lse, out is scratch
    q, kv, bt, lens, _ = inputs
    _, want_lse = reference.mla_decode(q, kv, bt, lens, bench_mla.SM_SCALE, RANK)
    assert_close(lse, want_lse, atol=1e-5, rtol=1e-5, name="lse")
    assert [c["nhead"] for c in fake_aiter["mla"]] == [16]
    fp8 = bench_mla.Case("mla_decode", 8, 2, 200, 1, torch.float8_e4m3fn)
    with pytest.raises(ops.BackendUnavailableError, match="bf16 kv_cache"):
        bench_mla._call(fp8, bench_mla._inputs(fp8, torch.device("cpu"), torch.Generator()), 0.05, "aiter")


def test_one_decode_plan_builds_aiter_table_once_for_every_layer(fake_aiter, monkeypatch):
    q, kv_cache, block_table, seq_lens = _decode_inputs(16, 16, strided=False, seed=3)
    built = []
    real = _aiter.token_indices
    monkeypatch.setattr(_aiter, "token_indices", lambda *a: built.append(1) or real(*a))
    plan = ops.plan_mla_decode(block_table, seq_lens, 16, 16, RANK, backend="aiter")
    want_out, _ = reference.mla_decode(q, kv_cache, block_table, seq_lens, SM_SCALE, RANK)
    for _ in range(3):  # three layers, one plan
        out, _ = ops.mla_decode_run(q, kv_cache, plan, SM_SCALE)
        assert_close(out, want_out, atol=1e-2, rtol=1.6e-2, max_cos_diff=2e-5, name="out")
    assert len(built) == 1 and len(fake_aiter["mla"]) == 3
