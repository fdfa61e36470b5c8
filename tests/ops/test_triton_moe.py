"""``moe_route`` / ``fused_moe`` with ``backend="triton"`` (interpreter on CPU) against the loop
oracles of tests/helpers/moe_inputs.py and the fp32 references; ties, group variants, E=384 top-8, dtype tolerances."""

from __future__ import annotations

import math

import pytest
import torch

from kvtier import ops
from kvtier.ops.moe import fused_moe_config, moe_align_block_size
from tests.ops._compare import assert_close
from tests.helpers.moe_inputs import _dense_moe, _route_oracle, _routing_inputs, _sorted_by_id


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


ROUTE = [(8, 1, 1, 2), (16, 4, 2, 4), (16, 2, 1, 8), (12, 3, 1, 2), (64, 8, 4, 8), (384, 1, 1, 8), (384, 8, 4, 8)]


@pytest.mark.parametrize("num_experts, n_group, topk_group, top_k", ROUTE,
                         ids=[f"E{e}-g{g}-tg{tg}-k{k}" for e, g, tg, k in ROUTE])
@pytest.mark.parametrize("num_tokens", [1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_moe_route_matches_oracle(num_experts, n_group, topk_group, top_k, num_tokens, dtype):
    logits, bias = _routing_inputs(num_tokens, num_experts, n_group, dtype, seed=num_experts * 7 + num_tokens)
    renormalize = num_tokens != 3
    weights, ids = ops.moe_route(logits, bias, top_k, n_group, topk_group, 2.827, renormalize, backend="triton")
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (num_tokens, top_k)
    want_w, want_ids = _route_oracle(logits, bias, top_k, n_group, topk_group, 2.827, renormalize)
    got_w, got_ids = _sorted_by_id(weights, ids)
    assert torch.equal(got_ids, want_ids)
    assert_close(got_w, want_w, atol=1e-6, rtol=1e-5, name="topk_weights")


def test_moe_route_ties_go_to_lower_ids():
    # all experts tie; group scores tie: groups 0 and 1 kept (of 4), experts 0..k-1 of them chosen
    logits = torch.zeros(2, 16)
    weights, ids = ops.moe_route(logits, torch.zeros(16), 3, 4, 2, 1.0, backend="triton")
    assert ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    assert_close(weights, torch.full((2, 3), 1 / 3), atol=1e-6, rtol=0, name="weights")
    # a tie between two experts of the best group, with the second-best group lower
    logits = torch.full((1, 8), -5.0)
    logits[0, [5, 6]] = 1.0
    _, ids = ops.moe_route(logits, torch.zeros(8), 1, 2, 1, 1.0, backend="triton")
    assert ids.tolist() == [[5]]


def test_moe_align_block_size_layout():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], dtype=torch.int32)  # pairs 0..5
    sorted_ids, expert_ids, num_padded = moe_align_block_size(ids, 4, 4)
    assert num_padded.item() == 12  # experts 0, 1, 2 use one block of 4 each
    assert sorted_ids[:12].tolist() == [1, 4, 6, 6, 3, 6, 6, 6, 0, 2, 5, 6]
    assert expert_ids.tolist()[:3] == [0, 1, 2] and set(expert_ids.tolist()[3:]) == {-1}
    assert sorted_ids.numel() == 6 + 4 * 3 + 2  # upper bound rounded to a block


# dtype -> atol, rtol, max cos diff vs the float64 oracle: bf16/fp16 add the rounding of the
# gated activation (stored in the input dtype between the projections) to the final cast.
TOL = {torch.float32: (2e-5, 2e-5, 1e-10), torch.bfloat16: (3e-2, 2e-2, 5e-5), torch.float16: (4e-3, 3e-3, 2e-6)}


def _moe_inputs(num_tokens, num_experts, top_k, hidden, inter, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5).to(dtype)
    unused = num_experts - 1
    w13[unused] = math.nan  # never selected: NaN would show if its rows were read
    w2[unused] = math.nan
    ids = torch.stack([torch.randperm(unused, generator=gen)[:top_k] for _ in range(num_tokens)]).to(torch.int32)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("num_tokens", [1, 3, 17])
@pytest.mark.parametrize("num_experts, top_k, hidden, inter", [(8, 2, 40, 12), (16, 8, 24, 7), (9, 1, 33, 20)],
                         ids=["E8-k2-H40-I12", "E16-k8-H24-I7", "E9-k1-H33-I20"])
def test_fused_moe_matches_dense_oracle(dtype, num_tokens, num_experts, top_k, hidden, inter):
    x, w13, w2, weights, ids = _moe_inputs(num_tokens, num_experts, top_k, hidden, inter, dtype,
                                           seed=num_tokens * 13 + num_experts)
    out = ops.fused_moe(x, w13, w2, weights, ids, backend="triton")
    assert out.dtype == dtype and out.shape == (num_tokens, hidden)
    assert bool(torch.isfinite(out).all()), "the unselected expert's NaN weights leaked"
    atol, rtol, cos = TOL[dtype]
    assert_close(out, _dense_moe(x, w13, w2, weights, ids), atol=atol, rtol=rtol, max_cos_diff=cos, name="out")


def test_fused_moe_k2_experts_top8_tiny_dims():
    x, w13, w2, weights, ids = _moe_inputs(3, 384, 8, 16, 16, torch.bfloat16, seed=384)
    out = ops.fused_moe(x, w13, w2, weights, ids, backend="triton")
    atol, rtol, cos = TOL[torch.bfloat16]
    assert_close(out, _dense_moe(x, w13, w2, weights, ids), atol=atol, rtol=rtol, max_cos_diff=cos, name="out")


def test_fused_moe_zero_tokens_and_route_then_moe():
    x, w13, w2, weights, ids = _moe_inputs(0, 4, 2, 8, 4, torch.float32, seed=0) if False else (
        torch.empty(0, 8), torch.randn(4, 8, 8), torch.randn(4, 8, 4), torch.empty(0, 2), torch.empty(0, 2, dtype=torch.int32))
    assert ops.fused_moe(x, w13, w2, weights, ids, backend="triton").shape == (0, 8)
    logits, bias = _routing_inputs(5, 16, 4, torch.float32, seed=1)
    w, i = ops.moe_route(logits, bias, 4, 4, 2, 2.827, backend="triton")
    x, w13, w2, _, _ = _moe_inputs(5, 17, 4, 16, 8, torch.float32, seed=2)
    assert_close(ops.fused_moe(x, w13, w2, w, i, backend="triton"), ops.fused_moe(x, w13, w2, w, i, backend="torch"),
                 atol=2e-5, rtol=2e-5, name="out")


def test_config_file_lookup():
    cfg = fused_moe_config(384, 4096, 7168, torch.bfloat16, "sm_90", 1)
    assert cfg["BLOCK_M"] == 16 and {"BLOCK_N", "BLOCK_K", "num_warps", "num_stages"} <= set(cfg)
    assert fused_moe_config(384, 4096, 7168, torch.bfloat16, "sm_90", 10**6)["BLOCK_M"] == 64  # largest bucket
    assert fused_moe_config(5, 6, 7, torch.float16, "gfx950", 100)["BLOCK_M"] == 32  # default table


@pytest.mark.slow
@pytest.mark.parametrize("num_tokens", [33, 64])
def test_fused_moe_larger_sweep(num_tokens):
    x, w13, w2, weights, ids = _moe_inputs(num_tokens, 33, 8, 48, 40, torch.bfloat16, seed=num_tokens)
    atol, rtol, cos = TOL[torch.bfloat16]
    assert_close(ops.fused_moe(x, w13, w2, weights, ids, backend="triton"), _dense_moe(x, w13, w2, weights, ids),
                 atol=atol, rtol=rtol, max_cos_diff=cos, name="out")
