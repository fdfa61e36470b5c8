"""Interleaved (GPT-J style) rotary embedding reference.

Pairs ``(x[2i], x[2i+1])`` rotate by angle ``position * inv_freq[i]``; the output keeps the
interleaved layout. Bytes: read ``T*H*R`` + ``T*R`` (cos/sin), write ``T*H*R``; FLOPs ``3*T*H*R``.
"""

import torch


def rope_interleaved(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """Rotate the last dim of ``x`` by the angles at ``positions``.

    Args:
        x: [num_tokens, num_heads, rope_dim] or [num_tokens, rope_dim], any float dtype.
        positions: [num_tokens] int64, token positions (0-based).
        cos_sin_cache: [max_position, rope_dim] fp32; ``[:, :rope_dim//2]`` = cos (already times
            the YaRN attention factor), ``[:, rope_dim//2:]`` = sin.

    Returns:
        Tensor shaped and typed like ``x``.
    """
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache[positions].float()
    cos, sin = cs[:, :half], cs[:, half:]
    if x.dim() == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return out.to(x.dtype)
