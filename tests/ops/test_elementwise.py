"""rms_norm, silu_and_mul and rope_interleaved against formulas written here, plus properties."""

from __future__ import annotations


import pytest
import torch

from kvtier import ops
from kvtier.model import preset
from kvtier.model.rope import build_cos_sin_cache
from tests.ops._compare import assert_close

# dtype, atol, rtol, max cos diff. Inputs are rounded to dtype first, so the error is the op's:
# rms_norm rounds twice (normalised value, then after the weight), silu_and_mul once.
DTYPES = [
    pytest.param(torch.float32, 1e-5, 1e-5, 1e-10, id="fp32"),
    pytest.param(torch.bfloat16, 1.6e-2, 1.6e-2, 2e-5, id="bf16"),
    pytest.param(torch.float16, 2e-3, 2e-3, 1e-6, id="fp16"),
]

SHAPES = [(1, 7), (17, 97), (2, 3, 128), (3, 7168)]  # odd widths, a 3-D batch, K2's hidden size


@pytest.mark.parametrize("dtype, atol, rtol, cos", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("weight_fp32", [False, True], ids=["w-same-dtype", "w-fp32"])
def test_rms_norm_matches_formula(dtype, atol, rtol, cos, shape, weight_fp32):
    gen = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    weight = (1.0 + 0.1 * torch.randn(shape[-1], generator=gen)).to(torch.float32 if weight_fp32 else dtype)
    eps = 1e-6
    got = ops.rms_norm(x, weight, eps)
    xd = x.double()
    want = weight.double() * xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    assert got.dtype == dtype and got.shape == x.shape
    assert_close(got, want, atol=atol, rtol=rtol, max_cos_diff=cos, name="rms_norm")


def test_rms_norm_eps_is_inside_the_square_root():
    # small activations and a large eps make x / sqrt(ms + eps) and x / (sqrt(ms) + eps) far apart
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3)) * 0.1
    weight = torch.full((16,), 2.0)
    got = ops.rms_norm(x, weight, 0.05)
    xd = x.double()
    want = 2.0 * xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 0.05)
    assert_close(got, want, atol=1e-6, rtol=1e-5, name="rms_norm eps=0.05")


def test_rms_norm_properties():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 33, generator=gen)
    weight = torch.ones(33)
    y = ops.rms_norm(x, weight, 1e-6)
    # unit weight: each row has root-mean-square 1, and scaling x does not change the output
    assert_close(y.pow(2).mean(-1).sqrt(), torch.ones(5), atol=1e-5, rtol=0, name="rms of output")
    assert_close(ops.rms_norm(x * 1000.0, weight, 1e-6), y, atol=1e-5, rtol=1e-5, name="scale invariance")
    # an all-zero row stays zero (eps keeps it finite, no NaN)
    zero = ops.rms_norm(torch.zeros(2, 33), weight, 1e-6)
    assert bool((zero == 0).all())


def test_rms_norm_rejects_bad_args():
    with pytest.raises(ValueError, match="weight"):
        ops.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="eps"):
        ops.rms_norm(torch.randn(2, 8), torch.ones(8), 0.0)


@pytest.mark.parametrize("dtype, atol, rtol, cos", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (17, 194), (3, 5, 512)], ids=lambda s: "x".join(map(str, s)))
def test_silu_and_mul_matches_formula(dtype, atol, rtol, cos, shape):
    gen = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    rows = x.view(-1, shape[-1])
    for i, gate in enumerate([60.0, -60.0, -0.0, 1e-3][:rows.shape[0]]):  # saturated, zero and tiny gates
        rows[i, 0] = gate
    got = ops.silu_and_mul(x)
    half = shape[-1] // 2
    gate, up = x[..., :half].double(), x[..., half:].double()
    want = gate / (1.0 + torch.exp(-gate)) * up
    assert got.dtype == dtype and got.shape == (*shape[:-1], half)
    assert bool(torch.isfinite(got).all())
    assert_close(got, want, atol=atol, rtol=rtol, max_cos_diff=cos, name="silu_and_mul")


def test_silu_and_mul_rejects_odd_width():
    with pytest.raises(ValueError, match="even"):
        ops.silu_and_mul(torch.randn(3, 7))


# ---------------------------------------------------------------------------------------------
# rope_interleaved


def _cos_sin_cache(max_position, rope_dim, base=50000.0, scale=1.0):
    """[max_position, rope_dim] fp32, cos | sin of p * base^(-2i/rope_dim), built in float64."""
    inv_freq = base ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos() * scale, angles.sin() * scale], dim=-1).float()


def _rope_complex(x, positions, cache):
    """Pairs (x[2i], x[2i+1]) as complex numbers times (cos + i sin) from the cache, in float64."""
    half = cache.shape[-1] // 2
    rot = torch.complex(cache[positions, :half].double(), cache[positions, half:].double())
    if x.dim() == 3:
        rot = rot[:, None, :]
    xd = x.double()
    z = torch.complex(xd[..., 0::2], xd[..., 1::2]) * rot
    return torch.stack([z.real, z.imag], dim=-1).flatten(-2)


@pytest.mark.parametrize("dtype, atol, rtol, cos", DTYPES)
@pytest.mark.parametrize("shape", [(17, 64), (5, 3, 64), (1, 1, 8)], ids=lambda s: "x".join(map(str, s)))
def test_rope_interleaved_matches_complex_rotation(dtype, atol, rtol, cos, shape):
    gen = torch.Generator().manual_seed(shape[0])
    max_position = 300
    cache = _cos_sin_cache(max_position, shape[-1], scale=1.3)  # a YaRN-like attention factor != 1
    x = torch.randn(shape, generator=gen).to(dtype)
    positions = torch.randint(0, max_position, (shape[0],), generator=gen)
    positions[0] = max_position - 1
    got = ops.rope_interleaved(x, positions, cache)
    assert got.dtype == dtype and got.shape == x.shape
    assert_close(got, _rope_complex(x, positions, cache), atol=atol, rtol=rtol, max_cos_diff=cos, name="rope")


def test_rope_position_zero_is_identity_and_norm_is_preserved():
    cache = _cos_sin_cache(64, 16)
    x = torch.randn(6, 4, 16, generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([0, 1, 5, 17, 40, 63])
    y = ops.rope_interleaved(x, positions, cache)
    assert_close(y[0], x[0], atol=0, rtol=0, name="position 0")
    assert_close(y.norm(dim=-1), x.norm(dim=-1), atol=1e-5, rtol=1e-5, name="norm")


def _relative_property_check(cache, rope_dim, seed, atol):
    """<rope(q, p), rope(k, p')> depends only on p - p': for each offset d, the dot product is the
    same for every absolute start s (and differs across d, so the check is not vacuous)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, rope_dim, generator=gen)
    k = torch.randn(1, rope_dim, generator=gen)
    starts = [0, 1, 7, 100, 333, 1000]
    per_offset = []
    for d in (-5, 0, 3, 40):
        dots = []
        for s in starts:
            p_q, p_k = s + max(d, 0), s + max(-d, 0)  # p_q - p_k == d
            rq = ops.rope_interleaved(q, torch.tensor([p_q]), cache)
            rk = ops.rope_interleaved(k, torch.tensor([p_k]), cache)
            dots.append(float((rq.double() * rk.double()).sum()))
        assert max(dots) - min(dots) <= atol, f"offset {d}: dot products vary with absolute position: {dots}"
        per_offset.append(dots[0])
    assert max(per_offset) - min(per_offset) > 10 * atol, f"dot products do not depend on the offset: {per_offset}"


def test_rope_relative_position_property():
    _relative_property_check(_cos_sin_cache(1100, 64), 64, seed=1, atol=2e-5)  # observed spread ~1e-6


def test_rope_relative_position_property_with_k2_yarn_cache():
    # The model's own YaRN table (factor 32, attention factor 1 for K2): the rotation must still be a
    # rotation. The table is built with fp32 angles, whose error grows with position (~p * 2^-24 rad),
    # hence the looser bound than with the float64-built table above: ~p * 6e-8 = 6e-5 rad at p = 1045
    # on the fastest pair, times |q_i||k_i| summed over 32 pairs (~64) gives ~4e-3 worst case; the
    # spreads observed with seeds 1 and 2 are 4e-5 and 2e-4.
    config = preset("kimi-k2")
    cache = build_cos_sin_cache(config, max_position=1100)
    _relative_property_check(cache, config.qk_rope_head_dim, seed=2, atol=2e-3)


def test_rope_rejects_bad_args():
    cache = _cos_sin_cache(10, 8)
    with pytest.raises(ValueError, match="positions"):
        ops.rope_interleaved(torch.randn(2, 8), torch.tensor([0, 10]), cache)
    with pytest.raises(ValueError, match="positions"):
        ops.rope_interleaved(torch.randn(2, 8), torch.tensor([0, 1], dtype=torch.int32), cache)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        ops.rope_interleaved(torch.randn(2, 8), torch.tensor([0, 1]), cache.half())
    with pytest.raises(ValueError, match="cos_sin_cache"):
        ops.rope_interleaved(torch.randn(2, 6), torch.tensor([0, 1]), cache)


def test_rope_rejects_negative_positions():
    with pytest.raises(ValueError, match="positions"):
        ops.rope_interleaved(torch.randn(2, 8), torch.tensor([-1, 0]), _cos_sin_cache(10, 8))


def test_rope_rejects_4d_x():
    with pytest.raises(ValueError, match="x"):
        ops.rope_interleaved(torch.randn(3, 2, 3, 8), torch.tensor([1, 2, 3]), _cos_sin_cache(10, 8))
