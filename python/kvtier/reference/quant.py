"""Quantized-weight references: INT4 group (W4A16) and FP8 block (W8A8) linears and fused MoE.

Weight formats, as the checkpoints ship them:

* **INT4 group** (Kimi K2 Thinking / K2.5 / K2.6 routed experts; compressed-tensors
  ``pack-quantized``, ``num_bits 4``, ``type int``, ``symmetric``, ``strategy group``,
  ``group_size 32``). Per linear of logical shape ``[N, K]``: ``weight_packed`` int32
  ``[N, K // 8]``, ``weight_scale`` ``[N, K // group_size]`` (bf16 in the checkpoints),
  ``weight_shape`` int ``[2] = (N, K)``. Eight consecutive K values per int32, the first in the
  lowest nibble: ``q[n, 8 c + j] = ((weight_packed[n, c] >> 4 j) & 0xF) - 8`` (the nibble holds the
  signed value plus 8, compressed-tensors ``pack_to_int32``), so ``q`` is in ``[-8, 7]``.
  ``w[n, k] = q[n, k] * weight_scale[n, k // group_size]``. Quantization (compressed-tensors
  ``calculate_qparams``, symmetric): ``scale = max(|w| over the group) / 7.5`` (at least fp32 eps),
  ``q = clamp(round(w / scale), -8, 7)``.
* **FP8 block** (Kimi K2 base, DeepSeek-V3): ``weight`` float8 e4m3 ``[N, K]`` (``e4m3fn``; the
  ``e4m3fnuz`` variant of gfx942 is taken too) and ``weight_scale_inv`` fp32
  ``[ceil(N / bn), ceil(K / bk)]`` with ``block_size = (bn, bk) = (128, 128)``:
  ``w[n, k] = weight[n, k] * weight_scale_inv[n // bn, k // bk]``. Activations (W8A8) are
  quantized per token and per ``bk``-wide group of K (DeepSeek-V3 ``act_quant``, vLLM
  ``per_token_group_quant_fp8``): ``s = max(max |x| over the group, 1e-10) / fp8_max``,
  ``x_q = clamp(x / s, -fp8_max, fp8_max)`` rounded to the weight's fp8 dtype (nearest-even),
  ``fp8_max`` = 448 (e4m3fn) or 240 (e4m3fnuz).

The fused MoE references follow :func:`kvtier.reference.fused_moe`: ``w13 = concat(gate, up)``
along the rows, ``out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(gate_e x) * (up_e x))``. In
the W8A8 MoE the gated activation is rounded to ``hidden_states.dtype`` (where it is stored
between the two grouped GEMMs) and then quantized per token group like ``hidden_states``.

Bytes and FLOPs (:func:`int4_group_bytes`, :func:`fp8_block_bytes` give the weight bytes):
linear ``[M, K] x [N, K]^T``: weight bytes + ``M * K`` + ``M * N`` activation elements; FLOPs
``2 * M * N * K``. Fused MoE: the weight bytes of every hit expert (``2 I x H`` and ``H x I``
linears) + ``2 * T * H`` activation elements; FLOPs ``6 * T * top_k * H * I``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

INT4_PER_INT32 = 8  # nibbles per packed int32
INT4_OFFSET = 8  # a nibble holds the signed value + 8
INT4_SCALE_DIVISOR = 7.5  # symmetric 4-bit: amax / ((2**4 - 1) / 2)
ACT_QUANT_EPS = 1e-10  # floor of a token group's amax before its scale is taken


def int4_group_bytes(n: int, k: int, group_size: int = 32, scale_itemsize: int = 2) -> int:
    """Bytes of one INT4-group linear ``[n, k]``: packed nibbles plus scales (bf16: 2 bytes each)."""
    return n * k // 2 + n * (k // group_size) * scale_itemsize


def fp8_block_bytes(n: int, k: int, block_size: tuple[int, int] = (128, 128)) -> int:
    """Bytes of one FP8-block linear ``[n, k]``: one byte per weight plus the fp32 block scales."""
    return n * k + 4 * math.ceil(n / block_size[0]) * math.ceil(k / block_size[1])


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 e4m3 dtype: 448 (``float8_e4m3fn``), 240 (``float8_e4m3fnuz``)."""
    return float(torch.finfo(dtype).max)


def unpack_int4(weight_packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., N, C]`` -> int8 ``[..., N, 8 C]`` signed values in ``[-8, 7]`` (module docstring)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=weight_packed.device)
    nibbles = (weight_packed.unsqueeze(-1) >> shifts) & 0xF
    return (nibbles - INT4_OFFSET).to(torch.int8).flatten(-2)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Signed values ``[..., N, K]`` in ``[-8, 7]`` (K a multiple of 8) -> int32 ``[..., N, K // 8]``."""
    if q.shape[-1] % INT4_PER_INT32:
        raise ValueError(f"q's last dim must be a multiple of {INT4_PER_INT32}, got {q.shape[-1]}")
    if q.numel() and (int(q.min()) < -8 or int(q.max()) > 7):
        raise ValueError(f"q must be in [-8, 7], got range [{int(q.min())}, {int(q.max())}]")
    nibbles = (q.to(torch.int64) + INT4_OFFSET).unflatten(-1, (-1, INT4_PER_INT32))
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
    packed = (nibbles << shifts).sum(-1)  # < 2**32: reinterpret the top bit as int32's sign
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def quantize_int4_group(weight: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Float ``[..., N, K]`` -> (weight_packed int32 ``[..., N, K // 8]``, weight_scale fp32
    ``[..., N, K // group_size]``), symmetric as compressed-tensors quantizes (module docstring).
    Cast the scale to bf16 for the checkpoint layout (and quantize with the bf16 scale if the
    packed values must match it exactly)."""
    k = weight.shape[-1]
    if k % group_size or group_size % INT4_PER_INT32:
        raise ValueError(f"group_size must be a multiple of {INT4_PER_INT32} dividing K={k}, got {group_size}")
    groups = weight.float().unflatten(-1, (k // group_size, group_size))
    scale = (groups.abs().amax(-1) / INT4_SCALE_DIVISOR).clamp(min=torch.finfo(torch.float32).eps)
    q = torch.round(groups / scale.unsqueeze(-1)).clamp(-8, 7).flatten(-2)
    return pack_int4(q), scale


def dequantize_int4_group(weight_packed, weight_scale, weight_shape=None, group_size=32):
    """``w[n, k] = q[n, k] * weight_scale[n, k // group_size]`` -> fp32 ``[..., N, K]``, K = 8 * cols
    (``weight_shape`` is checked by :func:`kvtier.ops.dequantize_int4_group`, not used here)."""
    q = unpack_int4(weight_packed).float()
    return q * weight_scale.float().repeat_interleave(group_size, -1)


def dequantize_fp8_block(weight, weight_scale_inv, block_size=(128, 128)):
    """``w[n, k] = weight[n, k] * weight_scale_inv[n // bn, k // bk]`` -> fp32 ``[..., N, K]``."""
    n, k = weight.shape[-2:]
    scale = weight_scale_inv.float().repeat_interleave(block_size[0], -2)[..., :n, :]
    return weight.float() * scale.repeat_interleave(block_size[1], -1)[..., :k]


def per_token_group_quant_fp8(x: torch.Tensor, group_size: int, dtype: torch.dtype = torch.float8_e4m3fn):
    """Per row, per ``group_size`` columns (the last group may be shorter): ``s = max(amax, 1e-10) /
    fp8_max``, ``x_q = clamp(x / s, -fp8_max, fp8_max)`` in ``dtype``.

    x: [M, K] float. Returns (x_q [M, K] ``dtype``, s [M, ceil(K / group_size)] fp32).
    """
    m, k = x.shape
    groups = math.ceil(k / group_size)
    padded = F.pad(x.float(), (0, groups * group_size - k)).view(m, groups, group_size)
    top = fp8_max(dtype)
    scale = padded.abs().amax(-1).clamp(min=ACT_QUANT_EPS) / top
    q = (padded / scale.unsqueeze(-1)).clamp(-top, top).view(m, groups * group_size)[:, :k]
    return q.to(dtype), scale


_fp8_act_quant = True  # set by fp8_activation_quant


@contextlib.contextmanager
def fp8_activation_quant(enabled: bool) -> Iterator[None]:
    """Switch the activation quantization of the W8A8 references (:func:`linear_fp8_block`,
    :func:`fused_moe_fp8_block`) on or off within a ``with`` block (on outside any block).

    Off, they multiply the activations as they are (fp32) by the dequantized weights, so an FP8
    model on the torch backend computes with its weights' values alone: what a test of weight
    placement and scales compares. Process-wide, not per thread; the Triton kernels always
    quantize. The previous setting comes back on exit.

    Example:
        >>> x = torch.tensor([[1.0, 0.3]])
        >>> w, s = torch.ones(1, 2, dtype=torch.float8_e4m3fn), torch.ones(1, 1)
        >>> with fp8_activation_quant(False):
        ...     float(linear_fp8_block(x, w, s))
        1.2999999523162842
        >>> float(linear_fp8_block(x, w, s))  # scale 1 / 448: 0.3 -> 134.4 -> e4m3 128 -> 0.2857
        1.2857142686843872
    """
    global _fp8_act_quant
    before, _fp8_act_quant = _fp8_act_quant, bool(enabled)
    try:
        yield
    finally:
        _fp8_act_quant = before


def _fake_quant_fp8(x: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """fp32 values of ``x`` after per-token-group fp8 quantization (x_q * s); ``x`` in fp32 when
    :func:`fp8_activation_quant` has switched the quantization off."""
    if not _fp8_act_quant:
        return x.float()
    q, s = per_token_group_quant_fp8(x, group_size, dtype)
    return q.float() * s.repeat_interleave(group_size, -1)[:, :x.shape[1]]


def _finish(y, bias, out_dtype, x):
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


def linear_w4a16(x, weight_packed, weight_scale, group_size=32, bias=None, out_dtype=None):
    """``x @ w^T (+ bias)`` with ``w`` the dequantized INT4 weight: x [M, K] float, weight_packed
    int32 [N, K // 8], weight_scale [N, K // group_size], bias [N] or None; fp32 math, output
    [M, N] in ``out_dtype`` (default ``x.dtype``)."""
    w = dequantize_int4_group(weight_packed, weight_scale, group_size=group_size)
    return _finish(x.float() @ w.T, bias, out_dtype, x)


def linear_fp8_block(x, weight, weight_scale_inv, block_size=(128, 128), bias=None, out_dtype=None):
    """W8A8 block: ``x`` quantized per token per ``bk`` group to ``weight.dtype``, times the
    dequantized weight, fp32 math: x [M, K] float, weight fp8 [N, K], weight_scale_inv fp32
    [ceil(N / bn), ceil(K / bk)], bias [N] or None -> [M, N] in ``out_dtype`` (default ``x.dtype``)."""
    xd = _fake_quant_fp8(x, block_size[1], weight.dtype)
    return _finish(xd @ dequantize_fp8_block(weight, weight_scale_inv, block_size).T, bias, out_dtype, x)


def _moe(hidden_states, topk_weights, topk_ids, w13_of, w2_of, act_hook):
    x = hidden_states.float()
    out = torch.zeros_like(x)
    flat_ids = topk_ids.long()
    for e in torch.unique(flat_ids).tolist():
        token_idx, slot = torch.nonzero(flat_ids == e, as_tuple=True)
        gate, up = (act_hook(x[token_idx], "x") @ w13_of(e).T).chunk(2, dim=-1)
        y = act_hook(F.silu(gate) * up, "act") @ w2_of(e).T
        out.index_add_(0, token_idx, y * topk_weights[token_idx, slot, None].float())
    return out.to(hidden_states.dtype)


def fused_moe_w4a16(hidden_states, w13_packed, w13_scale, w2_packed, w2_scale, topk_weights, topk_ids,
                    group_size=32):
    """The SiLU-gated expert mixture of :func:`kvtier.reference.fused_moe` on INT4-group experts:
    hidden_states [T, H]; w13_packed int32 [E, 2I, H // 8], w13_scale [E, 2I, H // group_size];
    w2_packed int32 [E, H, I // 8], w2_scale [E, H, I // group_size]; topk_weights [T, k] fp32;
    topk_ids [T, k] int32. fp32 math, output [T, H] in ``hidden_states.dtype``."""
    return _moe(hidden_states, topk_weights, topk_ids,
                lambda e: dequantize_int4_group(w13_packed[e], w13_scale[e], group_size=group_size),
                lambda e: dequantize_int4_group(w2_packed[e], w2_scale[e], group_size=group_size),
                lambda t, _: t)


def fused_moe_fp8_block(hidden_states, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids,
                        block_size=(128, 128)):
    """W8A8-block expert mixture: w13 fp8 [E, 2I, H], w13_scale_inv fp32 [E, ceil(2I / bn),
    ceil(H / bk)], w2 fp8 [E, H, I], w2_scale_inv fp32 [E, ceil(H / bn), ceil(I / bk)]. Both GEMMs'
    activations are quantized per token per ``bk`` group to ``w13.dtype``; the gated activation is
    first rounded to ``hidden_states.dtype`` (module docstring). Output [T, H] in
    ``hidden_states.dtype``."""
    bk, dtype = block_size[1], w13.dtype

    def quant(t, which):
        if which == "act":
            t = t.to(hidden_states.dtype).float()
        return _fake_quant_fp8(t, bk, dtype)

    return _moe(hidden_states, topk_weights, topk_ids,
                lambda e: dequantize_fp8_block(w13[e], w13_scale_inv[e], block_size),
                lambda e: dequantize_fp8_block(w2[e], w2_scale_inv[e], block_size), quant)
