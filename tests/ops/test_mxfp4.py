"""MXFP4 weights (Kimi K3's routed experts): the format's reference against the OCP MX spec's
values, the ops' checks, and the Triton kernel body (interpreter on CPU, tiny shapes) against the
dequantized fp32 reference, for the dense linear and the fused MoE with SiLU and SiTU gating;
SiTU in the bf16 ``fused_moe`` too.

Adversarial inputs: every E2M1 code and scales from 2^-127 (E8M0 0) to 2^8, an expert no token
picks whose scales are 255 (NaN: any read of it shows), every token routed to one expert, K and
N that are not multiples of the tiles (16 x 16 x 32 under the interpreter), the gfx950 scaled-dot
variant forced under the interpreter.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvtier import ops, reference
from kvtier.ops import _triton_mxfp4
from kvtier.reference import mxfp4 as ref
from kvtier.reference.activation import situ_and_mul
from tests.ops._compare import assert_close


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# dtype -> (atol relative to the output's max |value|, rtol, max cos diff): the interpreter runs fp32,
# so the error is accumulation order plus the final rounding to the dtype
TOL = {torch.float32: (1e-5, 1e-5, 1e-10), torch.bfloat16: (8e-3, 8e-3, 2e-5)}
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in TOL]
SITU = ("situ", 4.0, 25.0)  # K3's activation_situ_beta, activation_situ_linear_beta


def _close(got, want, dtype, name="out"):
    atol, rtol, cos = TOL[dtype]
    peak = float(want.abs().max()) if want.numel() else 1.0
    assert_close(got, want, atol=atol * max(peak, 1e-6), rtol=rtol, max_cos_diff=cos, name=name)


def make_mxfp4(*shape, gen, spread=3):
    """Random codes and E8M0 scales around 2^0 (``127 +- spread``): (packed, scale)."""
    *lead, n, k = shape
    packed = torch.randint(0, 256, (*lead, n, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    scale = torch.randint(127 - spread, 127 + spread + 1, (*lead, n, k // 32), generator=gen,
                          dtype=torch.int32).to(torch.uint8)
    return packed, scale


# ---------------------------------------------------------------------------------------------
# the format


def test_e2m1_codes_and_e8m0_scales_decode_to_the_spec_values():
    # byte 0x21: code 1 (0.5) at the even K index, code 2 (1.0) at the odd one
    codes = torch.arange(16, dtype=torch.int32)
    packed = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).repeat(1, 4)[None].reshape(1, 32)[:, :16]
    w = ref.dequantize_mxfp4(packed, torch.tensor([[127]], dtype=torch.uint8))
    spec = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert w[0, :16].tolist() == spec and w[0, 16:].tolist() == spec
    s = ref.e8m0_to_float(torch.tensor([0, 1, 126, 127, 135, 254, 255], dtype=torch.uint8))
    assert s[:6].tolist() == [2.0 ** -127, 2.0 ** -126, 0.5, 1.0, 256.0, 2.0 ** 127]
    assert torch.isnan(s[6])


def test_quantize_follows_the_ocp_algorithm():
    # amax 5.0: exponent floor(log2 5) - 2 = 0; ties go to the even code, values saturate at 6
    row = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.3] + [0.0] * 24)
    packed, scale = ref.quantize_mxfp4(row[None])
    assert scale.tolist() == [[127]]
    assert ref.dequantize_mxfp4(packed, scale)[0, :8].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.5]
    # a group of 48 = 1.5 * 2^5: exponent 5 - 2 = 3 (scale 8), 48 / 8 = 6 exactly; all-zero group: E8M0 0
    packed, scale = ref.quantize_mxfp4(torch.cat([torch.full((1, 32), 48.0), torch.zeros(1, 32)], dim=1))
    assert scale.tolist() == [[130, 0]] and bool((ref.dequantize_mxfp4(packed, scale)[0, :32] == 48).all())
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8, 64, generator=gen)
    packed, scale = ref.quantize_mxfp4(w)
    err = (ref.dequantize_mxfp4(packed, scale) - w).abs().unflatten(-1, (2, 32)).amax(-1)
    group_scale = ref.e8m0_to_float(scale)
    # per group: rounding error <= half the widest E2M1 step (2) times the scale, clipping <= amax - 6 * scale
    amax = w.abs().unflatten(-1, (2, 32)).amax(-1)
    assert bool((err <= torch.maximum(group_scale, amax - 6 * group_scale) + 1e-6).all())


def test_ops_dequantize_matches_reference_and_checks_shapes():
    gen = torch.Generator().manual_seed(1)
    packed, scale = make_mxfp4(3, 8, 64, gen=gen)
    assert torch.equal(ops.dequantize_mxfp4(packed, scale), ref.dequantize_mxfp4(packed, scale))
    with pytest.raises(ValueError, match="weight_scale"):
        ops.dequantize_mxfp4(packed, scale[..., :1])
    with pytest.raises(ValueError, match="weight_packed"):
        ops.dequantize_mxfp4(packed.to(torch.int32), scale)
    with pytest.raises(ValueError, match="multiple of 32"):
        ops.dequantize_mxfp4(packed[..., :8], scale[..., :1])


# ---------------------------------------------------------------------------------------------
# the linear


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k", [(1, 23, 64), (17, 40, 96), (5, 16, 32)], ids=["m1-n23", "m17-n40-k96", "k32"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_linear_mxfp4_triton_matches_dequantized_reference(dtype, m, n, k, with_bias):
    gen = torch.Generator().manual_seed(m * 7 + n + k)
    packed, scale = make_mxfp4(n, k, gen=gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    want = F.linear(x.float(), ref.dequantize_mxfp4(packed, scale), None if bias is None else bias.float()).to(dtype)
    _close(ops.linear_mxfp4(x, packed, scale, bias, backend="triton"), want, dtype)
    _close(ops.linear_mxfp4(x, packed, scale, bias, backend="torch"), want, dtype)


def test_linear_mxfp4_extreme_scales():
    gen = torch.Generator().manual_seed(3)
    packed, _ = make_mxfp4(16, 64, gen=gen)
    scale = torch.tensor([0, 1, 100, 135] * 8, dtype=torch.uint8).reshape(16, 2)
    x = torch.randn(4, 64, generator=gen)
    want = x @ ref.dequantize_mxfp4(packed, scale).T
    _close(ops.linear_mxfp4(x, packed, scale, backend="triton"), want, torch.float32)


def test_linear_mxfp4_scaled_dot_variant_under_the_interpreter():
    """The gfx950 branch (``tl.dot_scaled`` on the packed tile) agrees with the reference."""
    gen = torch.Generator().manual_seed(4)
    packed, scale = make_mxfp4(24, 96, gen=gen)
    x = torch.randn(5, 96, generator=gen).to(torch.bfloat16)
    want = (x.float() @ ref.dequantize_mxfp4(packed, scale).T).to(torch.bfloat16)
    got = _triton_mxfp4.linear_mxfp4(x, packed, scale, None, torch.bfloat16, scaled_dot=True)
    _close(got, want, torch.bfloat16)


def test_linear_mxfp4_bad_input_names_the_argument():
    packed, scale = make_mxfp4(8, 64, gen=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="x"):
        ops.linear_mxfp4(torch.randn(2, 32), packed, scale)
    with pytest.raises(ValueError, match="weight_scale"):
        ops.linear_mxfp4(torch.randn(2, 64), packed, scale.to(torch.int32))


# ---------------------------------------------------------------------------------------------
# the fused MoE


def _routing(t, e, k, gen):
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
    weights = torch.rand(t, k, generator=gen)
    return weights / weights.sum(-1, keepdim=True), ids


def _moe_oracle(x, w13, w2, weights, ids, act):
    """The dense loop over (token, choice) with the dequantized weights, fp64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e].double() @ x[t].double()
            gate, up = h.chunk(2)
            a = F.silu(gate) * up if act[0] == "silu" else situ_and_mul(torch.cat([gate, up]), act[1], act[2])
            out[t] += weights[t, j].double() * (w2[e].double() @ a)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", [("silu", 1.0, None), SITU, ("situ", 0.5, None)],
                         ids=["silu", "situ-k3", "situ-no-clip"])
@pytest.mark.parametrize("t, e, k, hidden, inter", [(5, 6, 2, 64, 32), (9, 4, 4, 96, 64)],
                         ids=["t5-e6-top2", "t9-all-experts"])
def test_fused_moe_mxfp4_triton_matches_dequantized_reference(dtype, act, t, e, k, hidden, inter):
    gen = torch.Generator().manual_seed(t * 13 + e + hidden)
    w13, s13 = make_mxfp4(e, 2 * inter, hidden, gen=gen, spread=2)
    w2, s2 = make_mxfp4(e, hidden, inter, gen=gen, spread=2)
    x = (0.5 * torch.randn(t, hidden, generator=gen)).to(dtype)
    weights, ids = _routing(t, e, k, gen)
    kwargs = dict(activation=act[0], situ_beta=act[1], situ_linear_beta=act[2])
    want = _moe_oracle(x, ref.dequantize_mxfp4(w13, s13), ref.dequantize_mxfp4(w2, s2), weights, ids, act)
    got_ref = ops.fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, backend="torch", **kwargs)
    _close(got_ref, want.to(dtype), dtype, "torch")
    got = ops.fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, backend="triton", **kwargs)
    _close(got, got_ref, dtype, "triton")


def test_fused_moe_mxfp4_unpicked_expert_with_nan_scales_is_never_read():
    gen = torch.Generator().manual_seed(7)
    w13, s13 = make_mxfp4(3, 64, 64, gen=gen)
    w2, s2 = make_mxfp4(3, 64, 32, gen=gen)
    s13[1], s2[1] = 255, 255  # expert 1: NaN scales
    x = torch.randn(6, 64, generator=gen)
    ids = torch.tensor([[0, 2]] * 3 + [[2, 0]] * 3, dtype=torch.int32)
    weights = torch.full((6, 2), 0.5)
    got = ops.fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, activation="situ", situ_beta=4.0,
                              situ_linear_beta=25.0, backend="triton")
    assert bool(torch.isfinite(got).all())
    _close(got, reference.fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, "situ", 4.0, 25.0), torch.float32)


def test_fused_moe_mxfp4_scaled_dot_variant_and_one_hot_routing():
    gen = torch.Generator().manual_seed(8)
    w13, s13 = make_mxfp4(2, 64, 64, gen=gen)
    w2, s2 = make_mxfp4(2, 64, 32, gen=gen)
    x = torch.randn(7, 64, generator=gen).to(torch.bfloat16)
    ids = torch.ones(7, 1, dtype=torch.int32)  # every token to expert 1
    weights = torch.ones(7, 1)
    want = reference.fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, *SITU)
    got = _triton_mxfp4.fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, *SITU, scaled_dot=True)
    _close(got, want, torch.bfloat16)


def test_fused_moe_mxfp4_bad_input():
    gen = torch.Generator().manual_seed(0)
    w13, s13 = make_mxfp4(2, 64, 64, gen=gen)
    w2, s2 = make_mxfp4(2, 64, 32, gen=gen)
    x, w, i = torch.randn(3, 64), torch.ones(3, 1), torch.zeros(3, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="activation must be one of"):
        ops.fused_moe_mxfp4(x, w13, s13, w2, s2, w, i, activation="gelu")
    with pytest.raises(ValueError, match="situ_beta"):
        ops.fused_moe_mxfp4(x, w13, s13, w2, s2, w, i, activation="situ", situ_beta=0.0)
    with pytest.raises(ValueError, match="w2_packed"):
        ops.fused_moe_mxfp4(x, w13, s13, w2[:, :32], s2[:, :32], w, i)
    with pytest.raises(ValueError, match=r"topk_ids must be in \[0, 2\)"):
        ops.fused_moe_mxfp4(x, w13, s13, w2, s2, w, i + 5)


def test_library_ops_opcheck():
    gen = torch.Generator().manual_seed(0)
    w13, s13 = make_mxfp4(2, 64, 64, gen=gen)
    w2, s2 = make_mxfp4(2, 64, 32, gen=gen)
    x, (w, i) = torch.randn(3, 64), _routing(3, 2, 1, gen)
    torch.library.opcheck(torch.ops.kvtier.fused_moe_mxfp4.default, (x, w13, s13, w2, s2, w, i, "situ", 4.0, 25.0))
    torch.library.opcheck(torch.ops.kvtier.linear_mxfp4.default, (x, w13[0], s13[0], None, torch.float32))
    torch.library.opcheck(torch.ops.kvtier.dequantize_mxfp4.default, (w2, s2))


# ---------------------------------------------------------------------------------------------
# SiTU in the bf16 fused MoE


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", [SITU, ("situ", 2.0, None)], ids=["situ-k3", "situ-no-clip"])
def test_fused_moe_situ_triton_matches_reference(dtype, act):
    gen = torch.Generator().manual_seed(11)
    e, hidden, inter, t = 5, 48, 40, 7
    w13 = (torch.randn(e, 2 * inter, hidden, generator=gen) / 4).to(dtype)
    w2 = (torch.randn(e, hidden, inter, generator=gen) / 4).to(dtype)
    x = torch.randn(t, hidden, generator=gen).to(dtype)
    weights, ids = _routing(t, e, 2, gen)
    kwargs = dict(activation=act[0], situ_beta=act[1], situ_linear_beta=act[2])
    want = _moe_oracle(x, w13.float(), w2.float(), weights, ids, act)
    got_ref = ops.fused_moe(x, w13, w2, weights, ids, backend="torch", **kwargs)
    _close(got_ref, want.to(dtype), dtype, "torch")
    _close(ops.fused_moe(x, w13, w2, weights, ids, backend="triton", **kwargs), got_ref, dtype, "triton")
    torch.library.opcheck(torch.ops.kvtier.fused_moe.default, (x, w13, w2, weights, ids, *act))
