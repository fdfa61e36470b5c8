"""Token ids of a workload turn: deterministic, and equal exactly where block ids are equal."""

from __future__ import annotations

import math

import numpy as np
from kvtier.bench.workload.types import Turn

# ---------------------------------------------------------------------------------------------
# Token ids

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer on a uint64 array (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


def _multiplier(span: int) -> int:
    a = 0x9E3779B1 % span or 1
    while math.gcd(a, span) != 1:
        a += 1
    return a


def prompt_token_ids(turn: Turn, block_size: int, vocab_size: int, *, low: int = 0) -> list[int]:
    """The prompt of ``turn`` as token ids: block id -> ``block_size`` tokens, concatenated.

    Each block's tokens are a pure function of (block id, position in block, ``vocab_size``,
    ``low``), so equal ids give equal tokens in every turn and session. The first token is
    ``low + (a * id + c) mod span`` with ``span = vocab_size - low`` and ``a`` coprime to
    ``span``: a bijection, so ids that differ by less than ``span`` (every id of a workload
    with fewer than ``span`` distinct blocks, ids being dense from 0) are guaranteed distinct
    blocks. The other tokens are a splitmix64 hash of (id, position) reduced mod ``span``;
    two ids that share a first token (ids ``span`` apart) are equal blocks with probability
    about ``span ** -(block_size - 1)``.

    Args:
        turn: its ``block_ids`` ``[ceil(input_tokens / block_size)]`` and ``input_tokens``.
        block_size: tokens per block, ``Workload.block_size``.
        vocab_size: tokens are in ``[low, vocab_size)``; ``vocab_size <= 2**32``.
        low: smallest token id to use (e.g. to skip special tokens).

    Returns:
        ``input_tokens`` ints (the last block cut short).

    Raises:
        ValueError: ``low >= vocab_size``, or ``len(turn.block_ids)`` does not match
            ``ceil(turn.input_tokens / block_size)``.

    Example:
        >>> t = Turn(input_tokens=5, output_tokens=1, block_ids=(7, 3), think_time_s=0.0, stop="")
        >>> len(prompt_token_ids(t, 4, 1000))
        5
    """
    span = vocab_size - low
    if low < 0 or span < 1 or vocab_size > 2**32:
        raise ValueError(f"need 0 <= low < vocab_size <= 2**32, got low={low}, vocab_size={vocab_size}")
    if block_size < 1 or len(turn.block_ids) != -(-turn.input_tokens // block_size):
        raise ValueError(f"turn has {len(turn.block_ids)} block ids for {turn.input_tokens} tokens; "
                         f"block_size={block_size} needs {-(-turn.input_tokens // max(block_size, 1))}")
    ids = np.asarray(turn.block_ids, dtype=np.uint64)
    span64 = np.uint64(span)
    first = (ids % span64) * np.uint64(_multiplier(span)) + np.uint64(0x7F4A7C15 % span)
    pos = np.arange(block_size, dtype=np.uint64)
    tokens = _mix64(ids[:, None] * _GOLDEN + (pos + np.uint64(1)) * _MIX2) % span64
    tokens[:, 0] = first % span64
    return (tokens.ravel()[: turn.input_tokens] + np.uint64(low)).astype(np.int64).tolist()
