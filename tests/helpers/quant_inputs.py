"""Quantized weights, routings and float64 oracles of the quantized-op tests."""

from __future__ import annotations

import math

import numpy as np
import torch

from kvtier.reference import quant as rq


def unpack_oracle(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., N, C] -> float64 [..., N, 8 C] through the little-endian bytes: byte b of an
    int32 holds k = 2b (low nibble) and 2b + 1 (high nibble), each as q + 8."""
    raw = np.ascontiguousarray(packed.numpy()).view(np.uint8).astype(np.int64)  # [..., N, 4 C]
    low, high = raw & 0xF, raw >> 4
    out = np.stack([low, high], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 8)
    return torch.from_numpy(out - 8).double()


def int4_oracle_weight(packed, scale, group_size):
    """float64 dequantized weight: q * scale[n, k // group_size]."""
    q = unpack_oracle(packed)
    k = q.shape[-1]
    idx = torch.arange(k) // group_size
    return q * scale.double()[..., idx]


def fp8_oracle_weight(weight, scale_inv, block_size):
    n, k = weight.shape[-2:]
    rows, cols = torch.arange(n) // block_size[0], torch.arange(k) // block_size[1]
    return weight.double() * scale_inv.double()[..., rows[:, None], cols[None, :]]


def act_quant_oracle(x: torch.Tensor, group: int, dtype) -> torch.Tensor:
    """Per row, per ``group`` columns: s = max(amax, 1e-10) / fp8_max (fp32), q = clamp(x / s) in
    ``dtype``; returns q * s in float64."""
    top = float(torch.finfo(dtype).max)
    x = x.float()
    out = torch.empty(x.shape, dtype=torch.float64)
    for m in range(x.shape[0]):
        for g0 in range(0, x.shape[1], group):
            seg = x[m, g0:g0 + group]
            s = torch.clamp(seg.abs().max(), min=1e-10) / top
            q = torch.clamp(seg / s, -top, top).to(dtype)
            out[m, g0:g0 + group] = q.double() * s.double()
    return out


def make_int4(shape, group_size, gen, outliers=False, scale_dtype=torch.bfloat16, outlier_factor=300.0):
    """Random INT4-group weight [*lead, N, K]: (packed int32, scale in ``scale_dtype``). With
    ``outliers``, a few groups get scales ``outlier_factor`` x the rest (as real checkpoints'
    outlier channels)."""
    w = torch.randn(*shape, generator=gen) / math.sqrt(shape[-1])
    packed, scale = rq.quantize_int4_group(w, group_size)
    if outliers:
        flat = scale.view(-1)
        hit = torch.randperm(flat.numel(), generator=gen)[:max(1, flat.numel() // 17)]
        flat[hit] *= outlier_factor
    return packed, scale.to(scale_dtype)


def make_fp8(shape, block_size, gen, dtype=torch.float8_e4m3fn, outliers=False, outlier_factor=1000.0):
    """Random FP8-block weight [*lead, N, K]: (fp8 weight, fp32 scale_inv) with every block's
    amax at the fp8 maximum; ``outliers`` scales a few blocks by ``outlier_factor``."""
    w = torch.randn(*shape, generator=gen) / math.sqrt(shape[-1])
    n, k = shape[-2:]
    bn, bk = block_size
    rows, cols = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.zeros(*shape[:-2], rows * bn, cols * bk)
    padded[..., :n, :k] = w
    blocks = padded.unflatten(-1, (cols, bk)).unflatten(-3, (rows, bn))  # [..., rows, bn, cols, bk]
    amax = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12)
    top = float(torch.finfo(dtype).max)
    scale_inv = amax / top
    q = (blocks / scale_inv[..., :, None, :, None]).flatten(-2).flatten(-3, -2)[..., :n, :k]
    if outliers:
        flat = scale_inv.view(-1)
        hit = torch.randperm(flat.numel(), generator=gen)[:max(1, flat.numel() // 7)]
        flat[hit] *= outlier_factor
    return q.clamp(-top, top).to(dtype), scale_inv


def routing(num_tokens, num_experts, top_k, gen, mode="random"):
    """(topk_weights fp32, topk_ids int32): ``random`` distinct experts (the last one never chosen:
    an empty expert), ``one`` every token's first choice is expert 0."""
    if num_tokens == 0:
        return torch.empty(0, top_k), torch.empty(0, top_k, dtype=torch.int32)
    ids = torch.stack([torch.randperm(num_experts - 1, generator=gen)[:top_k] for _ in range(num_tokens)])
    if mode == "one":
        ids = torch.stack([torch.cat([torch.zeros(1, dtype=torch.long),
                                      1 + torch.randperm(num_experts - 2, generator=gen)[:top_k - 1]])
                           for _ in range(num_tokens)])
    return torch.rand(num_tokens, top_k, generator=gen), ids.to(torch.int32)


def moe_oracle(x, w13, w2, topk_weights, topk_ids, act_quant=None):
    """float64 dense loop over (token, choice); ``act_quant(t [1, K]) -> float64`` applied to each
    GEMM's input (W8A8)."""
    x = x.double()
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    q = act_quant or (lambda t: t)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = q(x[t:t + 1])[0]
            gate, up = w13[e, :inter] @ h, w13[e, inter:] @ h
            act = gate / (1.0 + torch.exp(-gate)) * up
            out[t] += float(topk_weights[t, j]) * (w2[e] @ q(act[None])[0])
    return out
