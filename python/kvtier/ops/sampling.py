"""Token sampling op."""

from __future__ import annotations

import torch

from kvtier import reference
from kvtier.ops.checks import FLOAT_DTYPES, check_tensor
from kvtier.ops.dispatch import resolve_backend


def sample(logits, temperature, top_p, token_bitmask=None, generator=None, *, backend="auto"):
    """Greedy / temperature / top-p sampling with an optional packed allowed-token bitmask.

    Args:
        logits: [batch, vocab] float.
        temperature: [batch] fp32; ``<= 0`` means greedy (argmax).
        top_p: [batch] fp32 in (0, 1]; keeps the smallest set of tokens whose mass reaches top_p.
        token_bitmask: optional [batch, ceil(vocab / 32)] int32; bit ``j % 32`` of word ``j // 32``
            set means token j is allowed (the layout grammar engines produce).
        generator: optional ``torch.Generator`` for reproducible draws.

    Returns:
        [batch] int64 token ids.

    Raises:
        ValueError: misshaped arguments, top_p outside (0, 1], or a bitmask row allowing no token.
    """
    check_tensor(logits, "logits", ndim=2, dtypes=FLOAT_DTYPES)
    batch, vocab = logits.shape
    check_tensor(temperature, "temperature", shape=[batch], dtypes=[torch.float32])
    check_tensor(top_p, "top_p", shape=[batch], dtypes=[torch.float32])
    if batch and not bool(((top_p > 0) & (top_p <= 1)).all()):
        raise ValueError(f"top_p must be in (0, 1], got {top_p.tolist()}")
    if token_bitmask is not None:
        check_tensor(token_bitmask, "token_bitmask", shape=[batch, (vocab + 31) // 32], dtypes=[torch.int32])
        tail = vocab % 32
        usable = token_bitmask.clone()
        if tail:
            usable[:, -1] &= (1 << tail) - 1
        empty = torch.nonzero((usable != 0).sum(-1) == 0).flatten().tolist()
        if empty:
            raise ValueError(f"token_bitmask allows no token in row(s) {empty}")
    resolve_backend("sample", backend, logits.device, logits.dtype)
    return reference.sample(logits, temperature, top_p, token_bitmask, generator)
