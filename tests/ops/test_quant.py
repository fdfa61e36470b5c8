"""Quantized-weight ops (INT4 group W4A16, FP8 block W8A8) on the torch backend against oracles
written for them (tests/helpers/quant_inputs.py): hand-packed nibbles, a byte-level unpacker,
float64 dense loops; the errors named; ``torch.ops.kvtier.*`` registration checked with ``opcheck``.

The INT4 oracle unpacks through the little-endian bytes of each int32 (low nibble = even k),
independently of the shift-based unpacker of the reference. The W8A8 oracle quantizes each
token's ``bk``-wide groups in a Python loop and sums in float64.
"""

from __future__ import annotations

import pytest
import torch

from kvtier import ops, reference
from kvtier.reference import quant as rq
from tests.helpers.quant_inputs import (
    act_quant_oracle,
    fp8_oracle_weight,
    int4_oracle_weight,
    make_fp8,
    make_int4,
    moe_oracle,
    routing,
)
from tests.ops._compare import assert_close

OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
# opcheck's schema test compares each input before and after the call with allclose, which torch
# lacks for fp8 on CPU; the fp8 ops skip it and test_opcheck_quant_ops checks their inputs' bits.
OPCHECK_FP8 = OPCHECK_UTILS[1:]


# ---------------------------------------------------------------------------------------------
# the format itself


def test_int4_nibble_order_and_offset_by_hand():
    # q = -8..-1 -> nibbles 0..7, lowest first: 0x76543210; q = 0..7 -> nibbles 8..15: 0xFEDCBA98
    q = torch.tensor([[-8, -7, -6, -5, -4, -3, -2, -1], [0, 1, 2, 3, 4, 5, 6, 7]], dtype=torch.int8)
    packed = rq.pack_int4(q)
    assert packed.tolist() == [[0x76543210], [0xFEDCBA98 - 2**32]]
    assert torch.equal(rq.unpack_int4(packed), q)
    scale = torch.tensor([[0.5], [2.0]])
    w = ops.dequantize_int4_group(packed, scale, weight_shape=torch.tensor([2, 8], dtype=torch.int32), group_size=8)
    assert w.dtype == torch.float32
    assert torch.equal(w, q.float() * scale)


@pytest.mark.parametrize("lead", [(), (3,)], ids=["2d", "experts"])
@pytest.mark.parametrize("group_size", [32, 64])
def test_dequantize_int4_matches_byte_oracle(lead, group_size):
    gen = torch.Generator().manual_seed(group_size)
    packed, scale = make_int4((*lead, 13, 192), group_size, gen, outliers=True)
    got = ops.dequantize_int4_group(packed, scale, group_size=group_size)
    assert got.shape == (*lead, 13, 192) and got.dtype == torch.float32
    assert_close(got, int4_oracle_weight(packed, scale, group_size), atol=0, rtol=0, name="w")


def test_quantize_int4_group_round_trip_error_is_half_a_step():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(7, 96, generator=gen)
    packed, scale = rq.quantize_int4_group(w, 32)
    err = (rq.dequantize_int4_group(packed, scale, group_size=32) - w).abs()
    step = scale.repeat_interleave(32, -1)
    assert bool((err <= 0.5 * step + 1e-6).all())
    assert int(rq.unpack_int4(packed).min()) >= -8 and int(rq.unpack_int4(packed).max()) <= 7


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz], ids=["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (3, 576, 7)], ids=["aligned", "odd", "experts-N576"])
def test_dequantize_fp8_block_matches_oracle(dtype, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    weight, scale_inv = make_fp8(shape, (128, 128), gen, dtype, outliers=True)
    got = ops.dequantize_fp8_block(weight, scale_inv)
    assert got.dtype == torch.float32
    assert_close(got, fp8_oracle_weight(weight, scale_inv, (128, 128)), atol=0, rtol=6e-8, name="w")  # fp32 product


def test_fp8_e4m3fn_to_fnuz_keeps_every_value():
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8)
    weight = bits.view(torch.float8_e4m3fn).reshape(16, 16)
    finite = torch.isfinite(weight.float())
    scale_inv = torch.tensor([[0.25]])
    w_fnuz, s_fnuz = ops.fp8_e4m3fn_to_fnuz(weight, scale_inv)
    assert w_fnuz.dtype == torch.float8_e4m3fnuz and float(s_fnuz) == 0.5
    got = ops.dequantize_fp8_block(w_fnuz, s_fnuz)
    want = ops.dequantize_fp8_block(weight, scale_inv)
    assert torch.equal(got[finite], want[finite])
    assert float(got.view(-1)[0x80]) == 0.0  # -0 of e4m3fn is NaN in e4m3fnuz: mapped to 0
    assert ops.fp8_e4m3_dtype("gfx942") == torch.float8_e4m3fnuz
    assert ops.fp8_e4m3_dtype("gfx950") == ops.fp8_e4m3_dtype("sm_90") == torch.float8_e4m3fn


def test_per_token_group_quant_fp8_scales_and_zero_rows():
    x = torch.tensor([[1.0, -2.0, 4.0, 0.5, 0.0, 0.0], [448.0, 1.0, 0.0, 0.0, 3.0, -6.0]])
    q, s = rq.per_token_group_quant_fp8(x, 4)
    assert s.shape == (2, 2)
    assert_close(s, torch.tensor([[4 / 448, 1e-10 / 448], [1.0, 6 / 448]]), atol=0, rtol=1e-7, name="scale")
    assert float(q[0, 2].float()) == 448.0 and float(q[1, 0].float()) == 448.0  # each group's amax -> fp8 max
    assert bool((q[0, 4:].float() == 0).all())  # an all-zero group stays zero (no NaN from 0 / 0)
    assert_close(rq._fake_quant_fp8(x, 4, torch.float8_e4m3fn), act_quant_oracle(x, 4, torch.float8_e4m3fn),
                 atol=0, rtol=6e-8, name="x_q * s")  # the fp32 product


# ---------------------------------------------------------------------------------------------
# linears and MoE on the torch backend vs the float64 oracles

# x dtype, atol, rtol: the reference computes in fp32 and casts to the dtype (half-ulp 2^-9 bf16)
LINEAR_DTYPES = [pytest.param(torch.float32, 2e-5, 2e-5, id="fp32"),
                 pytest.param(torch.bfloat16, 1e-2, 8e-3, id="bf16")]


@pytest.mark.parametrize("dtype, atol, rtol", LINEAR_DTYPES)
@pytest.mark.parametrize("m, n, k, group_size", [(1, 23, 64, 32), (9, 40, 96, 32), (5, 16, 256, 128)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_linear_w4a16_matches_oracle(dtype, atol, rtol, m, n, k, group_size, with_bias):
    gen = torch.Generator().manual_seed(m * n + k)
    packed, scale = make_int4((n, k), group_size, gen, outliers=True)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen) if with_bias else None
    out = ops.linear_w4a16(x, packed, scale, group_size, bias=bias)
    assert out.shape == (m, n) and out.dtype == dtype
    want = x.double() @ int4_oracle_weight(packed, scale, group_size).T + (0 if bias is None else bias.double())
    scale_out = float(want.abs().max())
    assert_close(out, want, atol=atol * scale_out, rtol=rtol, name="out")
    assert ops.linear_w4a16(x, packed, scale, group_size, bias=bias, out_dtype=torch.float32).dtype == torch.float32


@pytest.mark.parametrize("dtype, atol, rtol", LINEAR_DTYPES)
@pytest.mark.parametrize("wdtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz], ids=["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("m, n, k, block", [(1, 23, 64, (16, 32)), (7, 200, 300, (128, 128)),
                                           (3, 576, 256, (128, 128))])
def test_linear_fp8_block_matches_oracle(dtype, atol, rtol, wdtype, m, n, k, block):
    gen = torch.Generator().manual_seed(m + n + k)
    weight, scale_inv = make_fp8((n, k), block, gen, wdtype, outliers=True)
    x = torch.randn(m, k, generator=gen).to(dtype)
    x[0, :5] *= 50.0  # an outlier token group
    bias = torch.randn(n, generator=gen)
    out = ops.linear_fp8_block(x, weight, scale_inv, block, bias=bias)
    assert out.shape == (m, n) and out.dtype == dtype
    want = act_quant_oracle(x, block[1], wdtype) @ fp8_oracle_weight(weight, scale_inv, block).T + bias.double()
    assert_close(out, want, atol=atol * float(want.abs().max()), rtol=rtol, name="out")


def test_linear_fp8_quantization_error_is_bounded_against_exact_activations():
    """W8A8 vs the same product with unquantized activations: e4m3 keeps 3 mantissa bits, so the
    per-element error is <= 2^-4 relative; summed over K it stays a few % of the output."""
    gen = torch.Generator().manual_seed(11)
    weight, scale_inv = make_fp8((64, 512), (128, 128), gen)
    x = torch.randn(4, 512, generator=gen)
    exact = x.double() @ fp8_oracle_weight(weight, scale_inv, (128, 128)).T
    got = ops.linear_fp8_block(x, weight, scale_inv)
    rel = float((got.double() - exact).norm() / exact.norm())
    assert 1e-4 < rel < 4e-2, rel


MOE_SHAPES = [(8, 2, 64, 32, 32), (6, 3, 96, 64, 32), (17, 8, 32, 32, 32)]  # E, top_k, H, I, group


@pytest.mark.parametrize("dtype, atol, rtol", LINEAR_DTYPES)
@pytest.mark.parametrize("num_tokens", [0, 1, 9])
@pytest.mark.parametrize("num_experts, top_k, hidden, inter, group_size", MOE_SHAPES,
                         ids=[f"E{e}-k{k}-H{h}-I{i}-g{g}" for e, k, h, i, g in MOE_SHAPES])
def test_fused_moe_w4a16_matches_oracle(dtype, atol, rtol, num_tokens, num_experts, top_k, hidden, inter,
                                        group_size):
    gen = torch.Generator().manual_seed(num_tokens + num_experts)
    w13p, w13s = make_int4((num_experts, 2 * inter, hidden), group_size, gen, outliers=True)
    w2p, w2s = make_int4((num_experts, hidden, inter), group_size, gen)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    weights, ids = routing(num_tokens, num_experts, top_k, gen)
    out = ops.fused_moe_w4a16(x, w13p, w13s, w2p, w2s, weights, ids, group_size)
    assert out.shape == (num_tokens, hidden) and out.dtype == dtype
    want = moe_oracle(x, int4_oracle_weight(w13p, w13s, group_size), int4_oracle_weight(w2p, w2s, group_size),
                      weights, ids)
    assert_close(out, want, atol=atol * max(1.0, float(want.abs().max()) if want.numel() else 1.0), rtol=rtol,
                 name="out")


@pytest.mark.parametrize("dtype, atol, rtol", LINEAR_DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 9])
@pytest.mark.parametrize("block", [(16, 32), (128, 128)], ids=["b16x32", "b128"])
def test_fused_moe_fp8_block_matches_oracle(dtype, atol, rtol, num_tokens, block):
    num_experts, top_k, hidden, inter = 6, 2, 160, 96  # H, I not multiples of 128: partial blocks
    gen = torch.Generator().manual_seed(num_tokens + block[0])
    w13, w13s = make_fp8((num_experts, 2 * inter, hidden), block, gen, outliers=True)
    w2, w2s = make_fp8((num_experts, hidden, inter), block, gen)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    weights, ids = routing(num_tokens, num_experts, top_k, gen, mode="one")
    out = ops.fused_moe_fp8_block(x, w13, w13s, w2, w2s, weights, ids, block)
    assert out.shape == (num_tokens, hidden) and out.dtype == dtype

    def quant(t):  # the gated activation is rounded to x.dtype before its quantization
        return act_quant_oracle(t.to(dtype), block[1], w13.dtype)

    want = moe_oracle(x, fp8_oracle_weight(w13, w13s, block), fp8_oracle_weight(w2, w2s, block), weights, ids, quant)
    assert_close(out, want, atol=atol * float(want.abs().max()), rtol=rtol, name="out")


# ---------------------------------------------------------------------------------------------
# bad input


def test_int4_errors_name_the_argument():
    gen = torch.Generator().manual_seed(0)
    packed, scale = make_int4((8, 64), 32, gen)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="group_size=48 must divide K"):
        ops.linear_w4a16(x, packed, scale, 48)
    with pytest.raises(ValueError, match="weight_scale must have shape"):
        ops.linear_w4a16(x, packed, scale[:, :1], 32)
    with pytest.raises(ValueError, match="weight_packed must have dtype"):
        ops.linear_w4a16(x, packed.to(torch.int64), scale, 32)
    with pytest.raises(ValueError, match="x must have shape"):
        ops.linear_w4a16(torch.randn(2, 60), packed, scale, 32)
    with pytest.raises(ValueError, match="bias must have shape"):
        ops.linear_w4a16(x, packed, scale, 32, bias=torch.zeros(9))
    with pytest.raises(ValueError, match="out_dtype"):
        ops.linear_w4a16(x, packed, scale, 32, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="weight_shape must be"):
        ops.dequantize_int4_group(packed, scale, weight_shape=(8, 63))
    # K = 40 (5 int32 columns) is packed fine but group 32 does not divide it
    with pytest.raises(ValueError, match="group_size=32 must divide K = 8 \\* weight_packed.shape\\[-1\\] = 40"):
        ops.dequantize_int4_group(torch.zeros(4, 5, dtype=torch.int32), torch.ones(4, 1))


def test_fp8_errors_name_the_argument():
    gen = torch.Generator().manual_seed(0)
    weight, scale_inv = make_fp8((200, 300), (128, 128), gen)
    x = torch.randn(2, 300)
    with pytest.raises(ValueError, match="weight_scale_inv must have shape \\(2, 3\\)"):
        ops.linear_fp8_block(x, weight, scale_inv[:, :2])
    with pytest.raises(ValueError, match="weight must have dtype"):
        ops.linear_fp8_block(x, weight.float(), scale_inv)
    with pytest.raises(ValueError, match="block_size"):
        ops.linear_fp8_block(x, weight, scale_inv, (128,))
    with pytest.raises(ValueError, match="x must have shape"):
        ops.linear_fp8_block(torch.randn(2, 299), weight, scale_inv)


def test_fused_moe_quant_errors_name_the_argument():
    gen = torch.Generator().manual_seed(0)
    w13p, w13s = make_int4((4, 64, 64), 32, gen)
    w2p, w2s = make_int4((4, 64, 32), 32, gen)
    x = torch.randn(3, 64)
    weights, ids = routing(3, 4, 2, gen)
    with pytest.raises(ValueError, match="w2_packed must have shape"):
        ops.fused_moe_w4a16(x, w13p, w13s, w2p[:, :32], w2s[:, :32], weights, ids)
    with pytest.raises(ValueError, match="w13_scale must have shape"):
        ops.fused_moe_w4a16(x, w13p, w13s[..., :1], w2p, w2s, weights, ids)
    with pytest.raises(ValueError, match="topk_ids must be in"):
        ops.fused_moe_w4a16(x, w13p, w13s, w2p, w2s, weights, ids + 3)
    with pytest.raises(ValueError, match="H = 72"):
        ops.fused_moe_w4a16(torch.randn(3, 72), w13p, w13s, w2p, w2s, weights, ids)
    w13, s13 = make_fp8((4, 64, 64), (128, 128), gen)
    w2, s2 = make_fp8((4, 64, 32), (128, 128), gen, dtype=torch.float8_e4m3fnuz)
    with pytest.raises(ValueError, match="w2 must have dtype"):
        ops.fused_moe_fp8_block(x, w13, s13, w2, s2, weights, ids)
    with pytest.raises(ValueError, match="w13 dim 1 must be 2 \\* intermediate"):
        ops.fused_moe_fp8_block(x, w13[:, :63], s13, w2, s2, weights, ids)


# ---------------------------------------------------------------------------------------------
# torch.library registration


def test_opcheck_quant_ops():
    gen = torch.Generator().manual_seed(5)
    packed, scale = make_int4((24, 64), 32, gen)
    weight, scale_inv = make_fp8((24, 64), (16, 32), gen)
    x, bias = torch.randn(3, 64, generator=gen), torch.randn(24, generator=gen)
    torch.library.opcheck(torch.ops.kvtier.dequantize_int4_group.default, (packed, scale, 32),
                          test_utils=OPCHECK_UTILS)
    bits = weight.view(torch.uint8).clone()
    torch.library.opcheck(torch.ops.kvtier.dequantize_fp8_block.default, (weight, scale_inv, [16, 32]),
                          test_utils=OPCHECK_FP8)
    for b in (None, bias):
        torch.library.opcheck(torch.ops.kvtier.linear_w4a16.default, (x, packed, scale, 32, b, torch.bfloat16),
                              test_utils=OPCHECK_UTILS)
        torch.library.opcheck(torch.ops.kvtier.linear_fp8_block.default,
                              (x, weight, scale_inv, [16, 32], b, torch.float32), test_utils=OPCHECK_FP8)
    w13p, w13s = make_int4((5, 64, 64), 32, gen)
    w2p, w2s = make_int4((5, 64, 32), 32, gen)
    w13, s13 = make_fp8((5, 64, 64), (16, 32), gen)
    w2, s2 = make_fp8((5, 64, 32), (16, 32), gen)
    weights, ids = routing(3, 5, 2, gen)
    torch.library.opcheck(torch.ops.kvtier.fused_moe_w4a16.default, (x, w13p, w13s, w2p, w2s, weights, ids, 32),
                          test_utils=OPCHECK_UTILS)
    torch.library.opcheck(torch.ops.kvtier.fused_moe_fp8_block.default,
                          (x, w13, s13, w2, s2, weights, ids, [16, 32]), test_utils=OPCHECK_FP8)
    torch.ops.kvtier.linear_fp8_block(x, weight, scale_inv, [16, 32], None, torch.float32)
    assert torch.equal(weight.view(torch.uint8), bits), "an fp8 op wrote its weight"
    torch.testing.assert_close(torch.ops.kvtier.fused_moe_w4a16(x, w13p, w13s, w2p, w2s, weights, ids, 32),
                               reference.fused_moe_w4a16(x, w13p, w13s, w2p, w2s, weights, ids, 32))
    schemas = [str(getattr(torch.ops.kvtier, n).default._schema) for n in
               ("dequantize_int4_group", "dequantize_fp8_block", "linear_w4a16", "linear_fp8_block",
                "fused_moe_w4a16", "fused_moe_fp8_block")]
    assert all("backend" not in s for s in schemas), schemas


def test_dequantize_has_only_the_torch_backend():
    gen = torch.Generator().manual_seed(0)
    packed, scale = make_int4((8, 64), 32, gen)
    with pytest.raises(ops.BackendUnavailableError, match="no 'triton' implementation"):
        ops.dequantize_int4_group(packed, scale, backend="triton")
