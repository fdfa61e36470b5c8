"""The quantized-weight ops with ``backend="triton"`` (interpreter on CPU) against the fp32
references of :mod:`kvtier.reference.quant` and the float64 oracles of tests/helpers/quant_inputs.py.

Adversarial inputs: an expert no token picks whose scales are NaN (any read of it shows), every
token routed to one expert, K and N that are not multiples of the tiles (16 x 16 x 32 under the
interpreter) with K tails inside a group, groups and 128-blocks straddling tiles, scales with
300x-1000x outliers, activation groups with a 10^4 outlier (the rest of the group lands in fp8
subnormals), e4m3fn and e4m3fnuz weights. Tolerances are keyed by the activation dtype: the
interpreter computes in fp32, so the error is fp32 accumulation order plus the final rounding to
the dtype; W8A8 quantizes identically in the kernel and the reference.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvtier import ops, reference
from kvtier.ops import _triton_quant
from tests.ops._compare import assert_close
from tests.helpers.quant_inputs import (
    act_quant_oracle,
    fp8_oracle_weight,
    int4_oracle_weight,
    make_fp8,
    make_int4,
    moe_oracle,
    routing,
)


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# dtype -> (atol relative to the output's max |value|, rtol, max cos diff)
TOL = {torch.float32: (1e-5, 1e-5, 1e-10), torch.bfloat16: (8e-3, 8e-3, 2e-5), torch.float16: (1e-3, 1e-3, 1e-6)}
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in TOL]


def _close(got, want, dtype, name="out"):
    atol, rtol, cos = TOL[dtype]
    peak = float(want.abs().max()) if want.numel() else 1.0
    assert_close(got, want, atol=atol * max(peak, 1e-6), rtol=rtol, max_cos_diff=cos, name=name)


# ---------------------------------------------------------------------------------------------
# linears


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k, group_size", [(1, 23, 64, 32), (17, 40, 80, 16), (5, 16, 256, 128),
                                                 (3, 33, 96, 32)],
                         ids=["m1-n23", "m17-n40-k80-g16", "g128-one-group-spans-tiles", "n33-k96"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_linear_w4a16_triton_matches_reference(dtype, m, n, k, group_size, with_bias):
    gen = torch.Generator().manual_seed(m * 7 + n + k)
    packed, scale = make_int4((n, k), group_size, gen, outliers=True)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    got = ops.linear_w4a16(x, packed, scale, group_size, bias=bias, backend="triton")
    assert got.dtype == dtype and got.shape == (m, n)
    _close(got, reference.linear_w4a16(x, packed, scale, group_size, bias), dtype)
    want = x.double() @ int4_oracle_weight(packed, scale, group_size).T + (0 if bias is None else bias.double())
    _close(got, want, dtype, "out vs float64 oracle")


def test_linear_w4a16_triton_fp32_scales_and_out_dtype():
    gen = torch.Generator().manual_seed(2)
    packed, scale = make_int4((24, 64), 32, gen, scale_dtype=torch.float32)
    x = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    got = ops.linear_w4a16(x, packed, scale, 32, out_dtype=torch.float32, backend="triton")
    assert got.dtype == torch.float32
    _close(got, reference.linear_w4a16(x, packed, scale, 32, out_dtype=torch.float32), torch.float32)


FP8_LINEAR = [(1, 23, 64, (16, 32)), (9, 200, 300, (128, 128)), (3, 576, 256, (128, 128)), (6, 40, 96, (32, 16))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wdtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz], ids=["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("m, n, k, block", FP8_LINEAR,
                         ids=["b16x32", "n200-k300-partial-blocks", "N576-kv_a", "bk16-bn32"])
def test_linear_fp8_block_triton_matches_reference(dtype, wdtype, m, n, k, block):
    gen = torch.Generator().manual_seed(m + n + k)
    weight, scale_inv = make_fp8((n, k), block, gen, wdtype, outliers=True)
    x = torch.randn(m, k, generator=gen).to(dtype)
    x[0, 1] = 1e4 if dtype != torch.float16 else 6e4 / 8  # the rest of its group quantizes to subnormals / 0
    x[-1, -3:] = 0.0
    bias = torch.randn(n, generator=gen)
    got = ops.linear_fp8_block(x, weight, scale_inv, block, bias=bias, backend="triton")
    assert got.dtype == dtype and got.shape == (m, n)
    _close(got, reference.linear_fp8_block(x, weight, scale_inv, block, bias), dtype)
    want = act_quant_oracle(x, block[1], wdtype) @ fp8_oracle_weight(weight, scale_inv, block).T + bias.double()
    _close(got, want, dtype, "out vs float64 oracle")


def test_fp8_activation_rounding_matches_torch_on_every_e4m3_value():
    """The interpreter path rounds to the e4m3 grid in fp32 arithmetic: with a weight of one 1 per
    row, each output is one quantized activation times its scale, for values spanning the whole
    e4m3 range (subnormals, ties, the maximum)."""
    for wdtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        top = float(torch.finfo(wdtype).max)
        k = 64
        values = torch.cat([torch.linspace(-top, top, 997), torch.logspace(-12, 0, 500) * top,
                            torch.tensor([top, -top, 0.0])])
        values = values[: values.numel() // (k - 1) * (k - 1)].view(-1, k - 1)
        x = torch.cat([torch.full((values.shape[0], 1), top), values], 1)  # amax = top: scale 1
        weight = torch.eye(k).to(wdtype)
        scale_inv = torch.ones(1, 1)
        got = ops.linear_fp8_block(x, weight, scale_inv, (64, 64), backend="triton")
        assert torch.equal(got, x.to(wdtype).float()), wdtype


def test_triton_fp8_rejects_a_block_k_it_cannot_tile():
    gen = torch.Generator().manual_seed(0)
    weight, scale_inv = make_fp8((16, 96), (16, 24), gen)
    with pytest.raises(ops.BackendUnavailableError, match="power of two"):
        ops.linear_fp8_block(torch.randn(2, 96), weight, scale_inv, (16, 24), backend="triton")
    assert ops.linear_fp8_block(torch.randn(2, 96), weight, scale_inv, (16, 24), backend="torch").shape == (2, 16)


# ---------------------------------------------------------------------------------------------
# fused MoE

MOE_CASES = [(8, 2, 64, 32, 32, "random"), (9, 1, 96, 48, 16, "one"), (16, 8, 32, 32, 32, "random"),
             (5, 2, 80, 40, 8, "one")]


def _poison_unused(t, expert):
    t[expert] = math.nan


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 3, 17])
@pytest.mark.parametrize("num_experts, top_k, hidden, inter, group_size, mode", MOE_CASES,
                         ids=[f"E{e}-k{k}-H{h}-I{i}-g{g}-{m}" for e, k, h, i, g, m in MOE_CASES])
def test_fused_moe_w4a16_triton_matches_reference(dtype, num_tokens, num_experts, top_k, hidden, inter, group_size,
                                                  mode):
    gen = torch.Generator().manual_seed(num_tokens * 13 + num_experts + hidden)
    factor = 20.0 if dtype == torch.float16 else 300.0  # fp16 activations overflow past ~6e4
    w13p, w13s = make_int4((num_experts, 2 * inter, hidden), group_size, gen, outliers=True, outlier_factor=factor)
    w2p, w2s = make_int4((num_experts, hidden, inter), group_size, gen, outliers=True, outlier_factor=factor)
    _poison_unused(w13s, num_experts - 1)  # no token picks the last expert (routing())
    _poison_unused(w2s, num_experts - 1)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    weights, ids = routing(num_tokens, num_experts, top_k, gen, mode=mode)
    got = ops.fused_moe_w4a16(x, w13p, w13s, w2p, w2s, weights, ids, group_size, backend="triton")
    assert got.dtype == dtype and got.shape == (num_tokens, hidden)
    assert bool(torch.isfinite(got).all()), "the unpicked expert's NaN scales leaked"
    _close(got, reference.fused_moe_w4a16(x, w13p, w13s, w2p, w2s, weights, ids, group_size), dtype)
    want = moe_oracle(x, int4_oracle_weight(w13p, w13s, group_size), int4_oracle_weight(w2p, w2s, group_size),
                      weights, ids)
    _close(got, want, dtype, "out vs float64 oracle")


FP8_MOE = [(8, 2, 64, 32, (16, 32), "random"), (6, 2, 160, 96, (128, 128), "one"), (9, 1, 96, 48, (32, 16), "one")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wdtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz], ids=["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("num_tokens", [1, 9])
@pytest.mark.parametrize("num_experts, top_k, hidden, inter, block, mode", FP8_MOE,
                         ids=[f"E{e}-k{k}-H{h}-I{i}-b{b[0]}x{b[1]}-{m}" for e, k, h, i, b, m in FP8_MOE])
def test_fused_moe_fp8_block_triton_matches_reference(dtype, wdtype, num_tokens, num_experts, top_k, hidden, inter,
                                                      block, mode):
    gen = torch.Generator().manual_seed(num_tokens * 5 + hidden + block[0])
    factor = 20.0 if dtype == torch.float16 else 1000.0  # fp16 activations overflow past ~6e4
    w13, s13 = make_fp8((num_experts, 2 * inter, hidden), block, gen, wdtype, outliers=True, outlier_factor=factor)
    w2, s2 = make_fp8((num_experts, hidden, inter), block, gen, wdtype, outliers=True, outlier_factor=factor)
    _poison_unused(s13, num_experts - 1)
    _poison_unused(s2, num_experts - 1)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    x[0, 2] = 300.0 if dtype != torch.float16 else 20.0  # an outlier in one token group
    weights, ids = routing(num_tokens, num_experts, top_k, gen, mode=mode)
    got = ops.fused_moe_fp8_block(x, w13, s13, w2, s2, weights, ids, block, backend="triton")
    assert got.dtype == dtype and got.shape == (num_tokens, hidden)
    assert bool(torch.isfinite(got).all()), "the unpicked expert's NaN scales leaked"
    _close(got, reference.fused_moe_fp8_block(x, w13, s13, w2, s2, weights, ids, block), dtype)

    def quant(t):
        return act_quant_oracle(t.to(dtype), block[1], wdtype)

    want = moe_oracle(x, fp8_oracle_weight(w13, s13, block), fp8_oracle_weight(w2, s2, block), weights, ids, quant)
    _close(got, want, dtype, "out vs float64 oracle")


def test_fused_moe_quant_triton_every_token_on_one_expert_and_zero_tokens():
    gen = torch.Generator().manual_seed(7)
    e, h, i = 4, 64, 32
    w13p, w13s = make_int4((e, 2 * i, h), 32, gen)
    w2p, w2s = make_int4((e, h, i), 32, gen)
    x = torch.randn(19, h, generator=gen)
    ids = torch.full((19, 1), 2, dtype=torch.int32)  # 19 rows: two row blocks of one expert
    weights = torch.rand(19, 1, generator=gen)
    got = ops.fused_moe_w4a16(x, w13p, w13s, w2p, w2s, weights, ids, backend="triton")
    _close(got, reference.fused_moe_w4a16(x, w13p, w13s, w2p, w2s, weights, ids), torch.float32)
    empty = torch.empty(0, h)
    out = ops.fused_moe_w4a16(empty, w13p, w13s, w2p, w2s, torch.empty(0, 1), torch.empty(0, 1, dtype=torch.int32),
                              backend="triton")
    assert out.shape == (0, h)
    assert ops.linear_w4a16(empty, w13p[0], w13s[0], backend="triton").shape == (0, 2 * i)
    w13, s13 = make_fp8((e, 2 * i, h), (16, 32), gen)
    w2, s2 = make_fp8((e, h, i), (16, 32), gen)
    got = ops.fused_moe_fp8_block(x, w13, s13, w2, s2, weights, ids, (16, 32), backend="triton")
    _close(got, reference.fused_moe_fp8_block(x, w13, s13, w2, s2, weights, ids, (16, 32)), torch.float32)


def test_moe_route_then_quantized_moe_on_k2_expert_count():
    """E = 384, top-8 as K2 routes, tiny widths; the router's ids go in unvalidated."""
    gen = torch.Generator().manual_seed(384)
    logits = torch.randn(3, 384, generator=gen)
    weights, ids = ops.moe_route(logits, torch.zeros(384), 8, 1, 1, 2.827)
    w13p, w13s = make_int4((384, 64, 32), 32, gen)
    w2p, w2s = make_int4((384, 32, 32), 32, gen)
    x = torch.randn(3, 32, generator=gen).to(torch.bfloat16)
    got = ops.fused_moe_w4a16(x, w13p, w13s, w2p, w2s, weights, ids, validate=False, backend="triton")
    _close(got, reference.fused_moe_w4a16(x, w13p, w13s, w2p, w2s, weights, ids), torch.bfloat16)


def test_config_file_lookup():
    cfg = _triton_quant.quant_gemm_config("w4a16", 384, 4096, 7168, "sm_90", 1)
    assert cfg["BLOCK_M"] == 16 and {"BLOCK_N", "BLOCK_K", "num_warps", "num_stages"} <= set(cfg)
    assert _triton_quant.quant_gemm_config("fp8_block", 1, 7168, 18432, "gfx950", 10**6)["BLOCK_M"] == 64
    assert ops.quant.device_backend("fused_moe_w4a16", "cpu") == "torch"
