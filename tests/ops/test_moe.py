"""MoE ops: ``moe_route`` (DeepSeek-V3 noaux_tc) and ``fused_moe`` against oracles written for them
(tests/helpers/moe_inputs.py).

The routing oracle is a per-token Python loop in float64 following the published rule; when
transformers is importable, its ``DeepseekV3TopkRouter`` is a second, independent oracle.
``fused_moe`` is compared with a dense per-token, per-choice loop in float64.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvtier import ops, reference
from tests.helpers.moe_inputs import _dense_moe, _route_oracle, _routing_inputs, _sorted_by_id
from tests.ops._compare import assert_close


# num_experts, n_group, topk_group, top_k
ROUTE_SHAPES = [
    pytest.param(64, 8, 4, 8, id="E64-g8-tg4-k8"),
    pytest.param(384, 1, 1, 8, id="K2-E384-g1-k8"),
    pytest.param(12, 3, 1, 2, id="E12-g3-tg1-k2"),
    pytest.param(8, 4, 2, 4, id="E8-g4-tg2-k4-all-of-kept-groups"),
]


@pytest.mark.parametrize("num_experts, n_group, topk_group, top_k", ROUTE_SHAPES)
@pytest.mark.parametrize("num_tokens", [1, 17])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_moe_route_matches_loop_oracle(num_experts, n_group, topk_group, top_k, num_tokens, renormalize, dtype):
    logits, bias = _routing_inputs(num_tokens, num_experts, n_group, dtype, seed=num_experts + num_tokens)
    scale = 2.827  # K2 routed_scaling_factor
    weights, ids = ops.moe_route(logits, bias, top_k, n_group, topk_group, scale, renormalize)
    assert weights.shape == (num_tokens, top_k) and weights.dtype == torch.float32
    assert ids.shape == (num_tokens, top_k) and ids.dtype == torch.int32

    want_w, want_ids = _route_oracle(logits, bias, top_k, n_group, topk_group, scale, renormalize)
    got_w, got_ids = _sorted_by_id(weights, ids)
    assert torch.equal(got_ids, want_ids), f"expert choice differs:\n{got_ids}\n!=\n{want_ids}"
    assert_close(got_w, want_w, atol=1e-6, rtol=1e-5, name="topk_weights")
    # properties: distinct experts from at most topk_group groups; renormalised weights sum to scale
    per_group = num_experts // n_group
    for t in range(num_tokens):
        assert len(set(got_ids[t].tolist())) == top_k
        assert len({e // per_group for e in got_ids[t].tolist()}) <= topk_group
    if renormalize:
        assert_close(weights.sum(-1), torch.full((num_tokens,), scale), atol=1e-5, rtol=1e-6, name="sum(weights)")


def test_moe_route_group_score_is_top2_sum_not_max():
    """The best single expert loses when its group's second-best is poor (group score = top-2 sum)."""
    # 4 groups of 4; only 1 group kept. Group 0 has the best expert (logit 4) but a weak runner-up;
    # group 1's two experts at logit 2 give the larger top-2 sum.
    logits = torch.full((1, 16), -6.0)
    logits[0, 0] = 4.0
    logits[0, 5] = logits[0, 6] = 2.0
    weights, ids = ops.moe_route(logits, torch.zeros(16), 2, 4, 1, 1.0)
    assert sorted(ids[0].tolist()) == [5, 6]
    assert_close(weights[0], torch.tensor([0.5, 0.5]), atol=1e-6, rtol=0, name="weights")


def test_moe_route_bias_selects_but_does_not_weight():
    """A large bias gets a low-score expert chosen, but its weight is its unbiased sigmoid score."""
    logits = torch.tensor([[3.0, 2.0, -3.0, 1.0]])
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0])
    weights, ids = ops.moe_route(logits, bias, 2, 1, 1, 1.0, renormalize=False)
    got_w, got_ids = _sorted_by_id(weights, ids)
    assert got_ids[0].tolist() == [0, 2]
    assert_close(got_w[0], torch.sigmoid(torch.tensor([3.0, -3.0])), atol=1e-7, rtol=1e-6, name="weights")


@pytest.mark.parametrize("num_experts, n_group, topk_group, top_k", ROUTE_SHAPES)
def test_moe_route_matches_transformers_router(num_experts, n_group, topk_group, top_k):
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hidden, num_tokens = 32, 17
    config = transformers.DeepseekV3Config(hidden_size=hidden, n_routed_experts=num_experts,
                                           num_experts_per_tok=top_k, n_group=n_group, topk_group=topk_group,
                                           routed_scaling_factor=2.827, norm_topk_prob=True, num_hidden_layers=1)
    router = DeepseekV3TopkRouter(config)
    gen = torch.Generator().manual_seed(num_experts)
    _, bias = _routing_inputs(1, num_experts, n_group, torch.float32, seed=num_experts)
    with torch.no_grad():
        router.weight.copy_(torch.randn(num_experts, hidden, generator=gen) / hidden ** 0.5 * 2)
        router.e_score_correction_bias.copy_(bias)
        logits, hf_w, hf_ids = router(torch.randn(num_tokens, hidden, generator=gen))
    weights, ids = ops.moe_route(logits, bias, top_k, n_group, topk_group, 2.827, True)
    got_w, got_ids = _sorted_by_id(weights, ids)
    want_w, want_ids = _sorted_by_id(hf_w, hf_ids)
    assert torch.equal(got_ids, want_ids)
    assert_close(got_w, want_w, atol=1e-6, rtol=1e-5, name="topk_weights")


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_group=5), "n_group"),  # 16 experts not divisible into 5 groups
    (dict(n_group=16), "n_group"),  # groups of 1 expert (top-2 group score needs >= 2)
    (dict(topk_group=5), "topk_group"),
    (dict(top_k=9), "top_k"),  # > topk_group * experts per group = 2 * 4
    (dict(top_k=0), "top_k"),
], ids=["indivisible", "group-of-1", "topk_group>n_group", "top_k-too-big", "top_k-0"])
def test_moe_route_rejects_inconsistent_sizes(kwargs, match):
    args = dict(top_k=2, n_group=4, topk_group=2, routed_scaling_factor=1.0) | kwargs
    with pytest.raises(ValueError, match=match):
        ops.moe_route(torch.randn(3, 16), torch.zeros(16), **args)


def test_moe_route_rejects_bias_of_wrong_size():
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        ops.moe_route(torch.randn(3, 16), torch.zeros(15), 2, 4, 2, 1.0)


# ---------------------------------------------------------------------------------------------
# fused_moe

# dtype, atol, rtol, max cos diff: inputs are rounded to dtype before the oracle sees them, so the
# error is fp32 accumulation plus the final cast to dtype (relative half-ulp 2^-9 bf16, 2^-12 fp16).
MOE_DTYPES = [
    pytest.param(torch.float32, 1e-5, 1e-5, 1e-10, id="fp32"),
    pytest.param(torch.bfloat16, 2e-2, 1.6e-2, 2e-5, id="bf16"),
    pytest.param(torch.float16, 3e-3, 2e-3, 1e-6, id="fp16"),
]


@pytest.mark.parametrize("dtype, atol, rtol, cos", MOE_DTYPES)
@pytest.mark.parametrize("num_tokens", [0, 1, 17])
@pytest.mark.parametrize("num_experts, top_k, hidden, inter", [(6, 2, 40, 12), (17, 8, 24, 7)],
                         ids=["E6-k2-H40-I12", "E17-k8-H24-I7"])
def test_fused_moe_matches_dense_loop(dtype, atol, rtol, cos, num_tokens, num_experts, top_k, hidden, inter):
    gen = torch.Generator().manual_seed(num_tokens * 31 + num_experts)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5).to(dtype)
    unused = num_experts - 1  # no token selects it; its weights are NaN so any use of them shows
    w13[unused] = math.nan
    w2[unused] = math.nan
    ids = torch.stack([torch.randperm(unused, generator=gen)[:top_k] for _ in range(num_tokens)]) \
        if num_tokens else torch.empty(0, top_k, dtype=torch.int64)
    ids = ids.to(torch.int32)
    weights = torch.rand(num_tokens, top_k, generator=gen)

    out = ops.fused_moe(x, w13, w2, weights, ids)

    assert out.dtype == dtype and out.shape == (num_tokens, hidden)
    assert bool(torch.isfinite(out).all()), "the unselected expert's NaN weights leaked"
    assert_close(out, _dense_moe(x, w13, w2, weights, ids), atol=atol, rtol=rtol, max_cos_diff=cos, name="out")


def test_fused_moe_zero_weight_choice_contributes_nothing():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 8, generator=gen)
    w13, w2 = torch.randn(4, 6, 8, generator=gen), torch.randn(4, 8, 3, generator=gen)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)
    weights = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.0]])
    full = ops.fused_moe(x, w13, w2, weights, ids)
    single = ops.fused_moe(x, w13, w2, weights[:, :1], ids[:, :1])
    assert_close(full[0], single[0], atol=1e-6, rtol=1e-6, name="token 0")
    assert_close(full[2], single[2], atol=1e-6, rtol=1e-6, name="token 2")


def test_fused_moe_rejects_bad_ids_and_shapes():
    x, w13, w2 = torch.randn(2, 8), torch.randn(4, 6, 8), torch.randn(4, 8, 3)
    weights = torch.ones(2, 1)
    with pytest.raises(ValueError, match="topk_ids"):
        ops.fused_moe(x, w13, w2, weights, torch.tensor([[0], [4]], dtype=torch.int32))
    with pytest.raises(ValueError, match="topk_ids"):
        ops.fused_moe(x, w13, w2, weights, torch.tensor([[0], [1]], dtype=torch.int64))
    with pytest.raises(ValueError, match="w2"):
        ops.fused_moe(x, w13, torch.randn(4, 8, 4), weights, torch.tensor([[0], [1]], dtype=torch.int32))
    with pytest.raises(ValueError, match="w13"):
        ops.fused_moe(x, torch.randn(4, 6, 7), w2, weights, torch.tensor([[0], [1]], dtype=torch.int32))
    with pytest.raises(ValueError, match="topk_weights"):
        ops.fused_moe(x, w13, w2, torch.ones(2, 1, dtype=torch.bfloat16), torch.tensor([[0], [1]], dtype=torch.int32))


def test_fused_moe_rejects_odd_w13_rows():
    with pytest.raises(ValueError, match="w13"):
        ops.fused_moe(torch.randn(2, 4), torch.randn(3, 5, 4), torch.randn(3, 4, 2), torch.ones(2, 1),
                      torch.zeros(2, 1, dtype=torch.int32))



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "situ"])
@pytest.mark.parametrize("num_tokens", [1, 8, 300])
def test_cpu_moe_sorted_by_expert_is_the_reference_math(dtype, activation, num_tokens):
    """The CPU kernel (pairs sorted by expert, kvtier.ops._cpu_moe) computes what the fp32
    reference does, up to the order of each token's sum: K2-like routing sizes (16 experts, top 4,
    a skewed choice so one expert gets every token), SiLU and K3's SiTU, an unchosen expert of NaN
    weights that must never be read."""
    from kvtier.ops import _cpu_moe

    gen = torch.Generator().manual_seed(num_tokens)
    num_experts, top_k, hidden, inter = 16, 4, 64, 32
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5).to(dtype)
    w13[0], w2[0] = math.nan, math.nan
    ids = torch.stack([torch.cat([torch.tensor([3]), 4 + torch.randperm(num_experts - 4, generator=gen)[:top_k - 1]])
                       for _ in range(num_tokens)]).to(torch.int32)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    args = (activation, 4.0, 25.0 if activation == "situ" else None)
    got = _cpu_moe.fused_moe(x, w13, w2, weights, ids, *args)
    want = reference.fused_moe(x, w13, w2, weights, ids, *args)
    assert got.dtype == dtype and bool(torch.isfinite(got).all())
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: one rounding of the same fp32 sums
    assert_close(got, want, atol=tol, rtol=tol, max_cos_diff=1e-9 if dtype == torch.float32 else 1e-6, name="out")


def test_cpu_ops_fused_moe_runs_the_sorted_kernel(monkeypatch):
    """ops.fused_moe on the CPU runs kvtier.ops._cpu_moe for every float dtype."""
    from kvtier.ops import _cpu_moe

    calls = []
    real = _cpu_moe.fused_moe
    monkeypatch.setattr(_cpu_moe, "fused_moe", lambda *a: calls.append(a[0].dtype) or real(*a))
    ids, weights = torch.tensor([[0, 1], [1, 2]], dtype=torch.int32), torch.ones(2, 2)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x, w13, w2 = torch.randn(2, 8).to(dtype), torch.randn(3, 6, 8).to(dtype), torch.randn(3, 8, 3).to(dtype)
        assert ops.fused_moe(x, w13, w2, weights, ids).dtype == dtype
    assert calls == [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5, 8, 33])
def test_cpu_moe_padded_layout_is_the_reference_math(monkeypatch, dtype, num_tokens):
    """At decode sizes the CPU kernel runs its padded layout (one ``bmm`` per product over every
    expert): the same sums as the reference and as the sorted loop, with fp32 or bf16 weights, and
    an unchosen expert's NaN weights (computed on padding rows) never reach the output."""
    from kvtier.ops import _cpu_moe

    gen = torch.Generator().manual_seed(40 + num_tokens)
    num_experts, top_k, hidden, inter = 16, 4, 64, 32
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5).to(dtype)
    w13[5], w2[5] = math.nan, math.nan
    ids = torch.stack([torch.tensor([e for e in torch.randperm(num_experts, generator=gen).tolist() if e != 5][:top_k])
                       for _ in range(num_tokens)]).to(torch.int32)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    calls = []
    real = _cpu_moe._padded
    monkeypatch.setattr(_cpu_moe, "_padded", lambda *a: calls.append(1) or real(*a))
    got = _cpu_moe.fused_moe(x, w13, w2, weights, ids)
    assert calls == [1], "decode sizes did not take the padded layout"
    monkeypatch.setattr(_cpu_moe, "PADDED_MAX_PAIRS", 0)
    looped = _cpu_moe.fused_moe(x.float(), w13.float(), w2.float(), weights, ids).to(dtype)
    want = reference.fused_moe(x, w13, w2, weights, ids)
    assert got.dtype == dtype and bool(torch.isfinite(got).all()), "the unchosen expert's NaN leaked"
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: one rounding of the same fp32 sums
    cos = 1e-9 if dtype == torch.float32 else 1e-6
    assert_close(got, want, atol=tol, rtol=tol, max_cos_diff=cos, name="padded vs reference")
    assert_close(got, looped, atol=tol, rtol=tol, max_cos_diff=cos, name="padded vs sorted")
