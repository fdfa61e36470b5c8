"""Rotary tables for Kimi K2: plain RoPE or YaRN (Peng et al., 2023, arXiv:2309.00071).

The YaRN frequency blend follows DeepSeek-V3's published formulation (also the one in
transformers' ``_compute_yarn_parameters``): a linear ramp between the correction dims of
``beta_fast`` and ``beta_slow`` rotations, floor/ceil-truncated, mixes interpolated and
extrapolated frequencies; cos/sin are multiplied by the YaRN attention factor.
"""

from __future__ import annotations

import math

import torch

from kvtier.model.config import KimiK2Config


def _correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def rope_inv_freq(config: KimiK2Config) -> torch.Tensor:
    """[qk_rope_head_dim // 2] fp32 inverse frequencies (radians per position)."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolated = 1.0 / pos_freqs
    rs = config.rope_scaling
    if rs is None:
        return extrapolated
    interpolated = 1.0 / (rs.factor * pos_freqs)
    low = math.floor(_correction_dim(rs.beta_fast, dim, base, rs.original_max_position_embeddings))
    high = math.ceil(_correction_dim(rs.beta_slow, dim, base, rs.original_max_position_embeddings))
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep_extrapolated = 1.0 - ramp
    return interpolated * (1 - keep_extrapolated) + extrapolated * keep_extrapolated


def build_cos_sin_cache(config: KimiK2Config, max_position: int | None = None) -> torch.Tensor:
    """[max_position, qk_rope_head_dim] fp32: cos in the first half, sin in the second.

    Both are multiplied by the YaRN attention factor (1 for K2, whose mscale == mscale_all_dim).
    ``max_position`` defaults to ``config.max_position_embeddings``.
    """
    n = config.max_position_embeddings if max_position is None else max_position
    freqs = torch.arange(n, dtype=torch.float32)[:, None] * rope_inv_freq(config)[None, :]
    scale = config.rope_scaling.cos_sin_scale if config.rope_scaling else 1.0
    return torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)
