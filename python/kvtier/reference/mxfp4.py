"""MXFP4 weight references: dequantization, the W4A16 linear and the fused (latent) MoE.

Format (OCP Microscaling v1.0 MXFP4; compressed-tensors ``mxfp4-pack-quantized``, as Kimi K3
ships its routed experts). Per linear of logical shape ``[N, K]`` (K a multiple of 32):

* ``weight_packed`` uint8 ``[N, K // 2]``: two FP4 E2M1 codes per byte, the even K index in the
  low nibble, the odd one in the high nibble (the order ``tl.dot_scaled`` reads too). A code is
  ``s e e m`` (sign, 2 exponent bits with bias 1, 1 mantissa bit): magnitudes
  ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` for codes 0..7 and their negatives for 8..15.
* ``weight_scale`` uint8 ``[N, K // 32]``: one E8M0 exponent per 32 consecutive K values,
  ``scale = 2 ** (s - 127)``; ``s = 255`` is NaN.
* ``w[n, k] = e2m1(code[n, k]) * scale[n, k // 32]``.

Quantization (the OCP MX spec's algorithm, used for random checkpoints): per group of 32, shared
exponent ``floor(log2(amax)) - 2`` (2 = E2M1's largest exponent), clamped to [-127, 127] (an
all-zero group gets -127); each value divided by ``2 ** exponent`` and rounded to the nearest
E2M1 value, ties to the even code, saturating at +-6.

Bytes: ``N * K / 2 + N * K / 32`` per weight (0.53125 bytes per weight, against INT4 group-32's
0.5625 with bf16 scales). Linear ``[M, K] x [N, K]^T``: weight bytes + ``M * K + M * N``
activation elements, FLOPs ``2 * M * N * K``. Fused MoE: the weight bytes of every hit expert
(``2 I x L`` and ``L x I``) + ``2 * T * L`` activation elements, FLOPs ``6 * T * top_k * L * I``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvtier.reference.activation import gated_act

MXFP4_GROUP = 32  # K values per E8M0 scale
E8M0_BIAS = 127
E8M0_NAN = 255
E2M1_MAX = 6.0
E2M1_EMAX = 2  # exponent of E2M1's largest normal (6 = 1.5 * 2**2)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# rounding |v| onto the E2M1 magnitudes: boundaries between neighbours; at a tie the even code wins,
# which is the upper neighbour at 0.75, 1.75 and 3.5 and the lower one at the others
_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_UP = (0.75, 1.75, 3.5)


def mxfp4_bytes(n: int, k: int) -> int:
    """Bytes of one MXFP4 linear ``[n, k]``: packed codes plus E8M0 scales."""
    return n * k // 2 + n * (k // MXFP4_GROUP)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 exponents -> fp32 ``2 ** (s - 127)`` (NaN for 255)."""
    s = scale.to(torch.int32)
    out = torch.exp2((s - E8M0_BIAS).float())
    return torch.where(s == E8M0_NAN, torch.full_like(out, float("nan")), out)


def unpack_mxfp4(weight_packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., N, K // 2]`` -> fp32 E2M1 values ``[..., N, K]`` (unscaled; module docstring)."""
    b = weight_packed.to(torch.int64)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=weight_packed.device)
    return table[codes]


def dequantize_mxfp4(weight_packed: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """``w[n, k] = e2m1(code[n, k]) * 2 ** (weight_scale[n, k // 32] - 127)`` -> fp32 ``[..., N, K]``.

    weight_packed: uint8 ``[..., N, K // 2]``; weight_scale: uint8 ``[..., N, K // 32]``.
    """
    return unpack_mxfp4(weight_packed) * e8m0_to_float(weight_scale).repeat_interleave(MXFP4_GROUP, -1)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float ``[..., N, K]`` (K a multiple of 32) -> (weight_packed uint8 ``[..., N, K // 2]``,
    weight_scale uint8 ``[..., N, K // 32]``) by the OCP MX algorithm (module docstring).

    Raises:
        ValueError: K not a multiple of 32.
    """
    k = weight.shape[-1]
    if k % MXFP4_GROUP:
        raise ValueError(f"weight's last dim (K) must be a multiple of {MXFP4_GROUP}, got {k}")
    groups = weight.float().unflatten(-1, (k // MXFP4_GROUP, MXFP4_GROUP))
    amax = groups.abs().amax(-1)
    expo = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0 ** -126))) - E2M1_EMAX,
                       torch.full_like(amax, -E8M0_BIAS)).clamp(-E8M0_BIAS, E8M0_BIAS)
    v = groups / torch.exp2(expo).unsqueeze(-1)
    a = v.abs().clamp(max=E2M1_MAX)
    bounds = torch.tensor(_BOUNDS, dtype=torch.float32, device=weight.device)
    code = torch.bucketize(a, bounds, right=False)
    for tie in _TIES_UP:
        code = torch.where(a == tie, code + 1, code)
    code = torch.where(v < 0, code | 8, code).flatten(-2)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return packed, (expo + E8M0_BIAS).to(torch.uint8)


def _finish(y, bias, out_dtype, x):
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


def linear_mxfp4(x, weight_packed, weight_scale, bias=None, out_dtype=None):
    """``x @ w^T (+ bias)`` with ``w`` the dequantized MXFP4 weight: x [M, K] float, weight_packed
    uint8 [N, K // 2], weight_scale uint8 [N, K // 32], bias [N] or None; fp32 math, output [M, N]
    in ``out_dtype`` (default ``x.dtype``)."""
    return _finish(x.float() @ dequantize_mxfp4(weight_packed, weight_scale).T, bias, out_dtype, x)


def fused_moe_mxfp4(hidden_states, w13_packed, w13_scale, w2_packed, w2_scale, topk_weights, topk_ids,
                    activation="silu", situ_beta=1.0, situ_linear_beta=None):
    """The gated expert mixture of :func:`kvtier.reference.fused_moe` on MXFP4 experts:
    hidden_states [T, L] (L = the experts' width: H, or the latent width of a latent MoE);
    w13_packed uint8 [E, 2I, L // 2], w13_scale uint8 [E, 2I, L // 32] (gate rows then up rows);
    w2_packed uint8 [E, L, I // 2], w2_scale uint8 [E, L, I // 32]; topk_weights [T, k] fp32;
    topk_ids [T, k] int32; ``activation`` "silu" or "situ" (with ``situ_beta`` /
    ``situ_linear_beta``, :func:`kvtier.reference.activation.gated_act`). fp32 math, output [T, L]
    in ``hidden_states.dtype``."""
    x = hidden_states.float()
    out = torch.zeros_like(x)
    flat_ids = topk_ids.long()
    for e in torch.unique(flat_ids).tolist():
        token_idx, slot = torch.nonzero(flat_ids == e, as_tuple=True)
        gate, up = F.linear(x[token_idx], dequantize_mxfp4(w13_packed[e], w13_scale[e])).chunk(2, dim=-1)
        y = F.linear(gated_act(gate, up, activation, situ_beta, situ_linear_beta),
                     dequantize_mxfp4(w2_packed[e], w2_scale[e]))
        out.index_add_(0, token_idx, y * topk_weights[token_idx, slot, None].float())
    return out.to(hidden_states.dtype)
