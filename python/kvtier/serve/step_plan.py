"""Mechanisms the scheduler's policies call: one step's budgets, and the batch they fill.

A :class:`StepBudget` holds what is left of one step besides its token budget: the attention
work of its prefill chunks (``EngineConfig.max_num_batched_pairs``, query-key pairs) and the
share of a full step's estimated time the step may spend waiting for short prefix loads at
admission. Page accounting (which pages a sequence holds, which are free, what preempting it
frees) is the pool's (:class:`kvtier.cache.pool.KVPool`); :func:`fit_tokens` and
:func:`pages_freed` read it for the scheduler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvtier.cache.pool import KVPool
from kvtier.serve.request import Sequence


@dataclass
class ScheduledBatch:
    """One step's work: ``extends`` (sequence, new tokens) chunks, then one token per ``decodes``."""

    extends: list[tuple[Sequence, int]] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.extends) + len(self.decodes)

    def __bool__(self) -> bool:
        return bool(self.extends or self.decodes)


def pairs(context: int, n: int) -> int:
    """Query-key pairs of a causal chunk of ``n`` tokens after ``context`` tokens:
    ``n * context + n * (n + 1) / 2`` (each token attends to the context and to itself and the
    chunk's tokens before it)."""
    return n * context + n * (n + 1) // 2


class StepBudget:
    """What one step has left of its attention budget and of its inline-load share.

    Args:
        pairs_budget: query-key pairs the step's prefill chunks may take (None: no bound).
        inline_share: share of a full step's estimated time that prefix loads waited for at
            admission may take together (0: none is waited for).
    """

    def __init__(self, pairs_budget: int | None = None, inline_share: float = 0.0):
        self.pairs_budget = self.pairs_left = pairs_budget
        self.inline_left = inline_share
        self._inline_taken = (0.0, 1.0)  # (estimate, step) of the last load let in

    def cap(self, seq: Sequence, n: int, have: int = 0, share: float = 1.0) -> int:
        """``n`` prefill tokens of ``seq`` (``have`` of them already placed this step) cut so the
        step's attention work stays within its budget, of which this chunk takes at most
        ``share``: the largest ``m`` with ``pairs(context, m) <= pairs left``, from the quadratic
        formula; a step's first chunk gets at least one token."""
        if self.pairs_left is None:
            return n
        b = 2 * (seq.num_computed_tokens + have) + 1
        left = min(self.pairs_left, int(share * self.pairs_budget))
        m = int((math.isqrt(b * b + 8 * max(left, 0)) - b) // 2)
        if m < 1 and self.pairs_left == self.pairs_budget:
            m = 1
        return max(0, min(n, m))

    def charge(self, seq: Sequence, n: int, have: int = 0) -> None:
        """Count a placed prefill chunk's attention work against the step's budget."""
        if self.pairs_left is not None:
            self.pairs_left -= pairs(seq.num_computed_tokens + have, n)

    def take_inline(self, load_s: float, step_s: float) -> float | None:
        """Whether a prefix load estimated at ``load_s`` fits in the inline share left of a step
        estimated at ``step_s`` (seconds); when it does, it takes that share.

        Returns:
            None when it does not fit; else the longest the caller may wait for it, in seconds:
            the whole share left before it (an estimate that was too low is cut off there, and
            :meth:`waited_inline` charges what the wait really took).
        """
        if step_s <= 0 or load_s > self.inline_left * step_s:
            return None
        limit = self.inline_left * step_s
        self.inline_left -= load_s / step_s
        self._inline_taken = (load_s, step_s)
        return limit

    def waited_inline(self, waited_s: float) -> None:
        """Charge the wait for the load :meth:`take_inline` last let in: ``waited_s`` seconds,
        beyond the estimate it already took."""
        load_s, step_s = self._inline_taken
        if waited_s > load_s:
            self.inline_left = max(0.0, self.inline_left - (waited_s - load_s) / step_s)


def fit_tokens(pool: KVPool, seq: Sequence) -> int:
    """Tokens ``seq`` can run with the pages it holds and the free ones."""
    return (len(seq.page_ids) + pool.num_free_pages) * pool.config.page_size - seq.num_computed_tokens


def pages_freed(pool: KVPool, seq: Sequence) -> int:
    """Device pages that preempting ``seq`` frees: those no other sequence shares."""
    return pool.num_private_pages(seq.kv)


__all__ = ["ScheduledBatch", "StepBudget", "fit_tokens", "pages_freed", "pairs"]
