"""Normalisation, activation and rotary-embedding ops."""

from __future__ import annotations

import torch

from kvtier import reference
from kvtier.ops.checks import FLOAT_DTYPES, check_tensor
from kvtier.ops.dispatch import resolve_backend


def rms_norm(x, weight, eps, *, backend="auto"):
    """RMSNorm over the last dim. x: [..., D]; weight: [D]. Returns x's shape and dtype.

    Raises:
        ValueError: ``weight`` is not [D] or ``eps <= 0``.
    """
    check_tensor(x, "x", dtypes=FLOAT_DTYPES)
    check_tensor(weight, "weight", shape=[x.shape[-1]], dtypes=FLOAT_DTYPES)
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    resolve_backend("rms_norm", backend, x.device, x.dtype)
    return reference.rms_norm(x, weight, eps)


def silu_and_mul(x, *, backend="auto"):
    """x: [..., 2*I] = [gate | up] -> ``silu(gate) * up`` [..., I] in x.dtype.

    Raises:
        ValueError: odd last dim.
    """
    check_tensor(x, "x", dtypes=FLOAT_DTYPES)
    if x.shape[-1] % 2:
        raise ValueError(f"x last dim must be even ([gate | up]), got {x.shape[-1]}")
    resolve_backend("silu_and_mul", backend, x.device, x.dtype)
    return reference.silu_and_mul(x)


def rope_interleaved(x, positions, cos_sin_cache, *, validate=True, backend="auto"):
    """Interleaved (GPT-J style) rotary embedding of the last dim.

    Args:
        x: [num_tokens, num_heads, rope_dim] or [num_tokens, rope_dim].
        positions: [num_tokens] int64 token positions.
        cos_sin_cache: [max_position, rope_dim] fp32, cos (times the YaRN attention factor) in
            the first half, sin in the second (:func:`kvtier.model.rope.build_cos_sin_cache`).
        validate: check the position values (one host read); a caller that checked the step's
            positions once (:func:`check_positions`) passes False in its layers.

    Returns:
        Rotated tensor shaped and typed like x (pairs stay interleaved).

    Raises:
        ValueError: mismatched sizes, or a position >= max_position.
    """
    check_tensor(x, "x", dtypes=FLOAT_DTYPES)
    if x.dim() not in (2, 3) or x.shape[-1] % 2:
        raise ValueError(f"x must be [num_tokens, rope_dim] or [num_tokens, num_heads, rope_dim] with an even "
                         f"rope_dim, got shape {tuple(x.shape)}")
    check_tensor(positions, "positions", shape=[x.shape[0]], dtypes=[torch.int64], device=x.device)
    check_tensor(cos_sin_cache, "cos_sin_cache", shape=[None, x.shape[-1]], dtypes=[torch.float32], device=x.device)
    if validate:
        check_positions(positions, cos_sin_cache.shape[0])
    resolve_backend("rope_interleaved", backend, x.device, x.dtype)
    return reference.rope_interleaved(x, positions, cos_sin_cache)


def check_positions(positions: torch.Tensor, max_position: int) -> None:
    """Raise ValueError unless every position is in ``[0, max_position)`` (one host read)."""
    if positions.numel():
        lo, hi = torch.stack([positions.min(), positions.max()]).tolist()
        if lo < 0 or hi >= max_position:
            raise ValueError(f"positions must be in [0, max_position={max_position}), got range [{lo}, {hi}]")
