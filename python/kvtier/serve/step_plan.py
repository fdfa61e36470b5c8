"""One step's plan: the batch it fills and the budgets it fills it within.

A :class:`StepPlan` holds the step's :class:`ScheduledBatch`, the step's token budget
(``max_num_batched_tokens``, :attr:`StepPlan.tokens_left`) and a :class:`StepBudget`: the
attention work of its prefill chunks (``EngineConfig.max_num_batched_pairs``, query-key pairs)
and the share of a full step's estimated time the step may spend waiting for short prefix loads
at admission. It starts a waiting request's prefix (:meth:`StepPlan.start_prefix`), cuts a
chunk to the budgets (:meth:`StepPlan.chunk`) and answers :meth:`StepPlan.add` with a
:class:`Verdict`; :meth:`StepPlan.grow` and :meth:`StepPlan.end_chunked` add to placed chunks.
It writes no queue: what a verdict means for the queues is the scheduler's. Page accounting
(which pages a sequence holds, which are free, what preempting it frees) is the pool's
(:class:`kvtier.cache.pool.KVPool`); :func:`fit_tokens` and :func:`pages_freed` read it.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.cache.checkpoints.index import Checkpoint
from kvtier.cache.pool import KVPool, PrefixStart
from kvtier.serve.queues import mark
from kvtier.serve.request import Sequence

INLINE_LOAD_SHARE = 0.1
"""Prefix loads estimated under this share of a full step's time
(``recompute_s(max_num_batched_tokens)``), all of them together in one step, are waited for
at admission under ``cache-aware``, so the request runs in the step that admits it rather than
the next."""


@dataclass
class ScheduledBatch:
    """One step's work: ``extends`` (sequence, new tokens) chunks, then one token per ``decodes``;
    ``restores``: by ``seq_id``, the recurrent-state checkpoint a hybrid sequence's first chunk
    starts from (:meth:`KVPool.take_restore`: its cached prefix's end)."""

    extends: list[tuple[Sequence, int]] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    restores: dict[int, Checkpoint] = field(default_factory=dict)

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


def remaining(seq: Sequence) -> int:
    """Tokens of ``seq`` not computed yet (its prompt's rest, or 1 for a decode)."""
    return seq.num_tokens - seq.num_computed_tokens


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


class Verdict(enum.Enum):
    """What :meth:`StepPlan.add` did with a sequence's chunk."""

    PLACED = "placed"  # its pages are allocated and the chunk is in the batch: go on
    NO_TOKENS = "no tokens"  # the budgets leave it no token this step: nothing changed
    NO_PAGES = "no pages"  # too few free pages for its chunk: nothing changed


class StepPlan:
    """The batch of one step as it is filled, and the budgets it is filled within.

    Args:
        pool: the page pool the chunks' pages come from.
        tokens: the step's token budget (``max_num_batched_tokens``).
        budget: the step's attention and inline-load budget (a fresh one per step; None: no
            attention bound, no inline waits).
    """

    def __init__(self, pool: KVPool, tokens: int, budget: StepBudget | None = None):
        self.pool = pool
        self.budget = budget if budget is not None else StepBudget()
        self.tokens = self.tokens_left = tokens
        self.batch = ScheduledBatch()

    def chunk(self, seq: Sequence, caps: dict[int, int] | None = None) -> int:
        """Tokens running ``seq`` may run this step: its rest (1 for a decode) within the token
        budget left, its cap in ``caps`` (the ranking's chunk plan by seq_id, absent: 0; None: no
        cap; a decode is never capped) and the attention budget."""
        n = min(remaining(seq), self.tokens_left)
        if caps is not None and n > 1:
            n = min(n, caps.get(seq.seq_id, 0))
        if remaining(seq) > 1:
            n = self.budget.cap(seq, n)
        return n

    def add(self, seq: Sequence, n: int, shrink: bool = False) -> Verdict:
        """Allocate ``seq``'s pages for ``n`` more tokens and place them (:meth:`place`).

        Args:
            seq: a running sequence, or a waiting one whose prefix :meth:`start_prefix` placed.
            n: its chunk (<= 0: :attr:`Verdict.NO_TOKENS`).
            shrink: when the pages for ``n`` are short, place the chunk its held and the free
                pages do hold (:func:`fit_tokens`), if at least one token.

        Returns:
            ``PLACED``, ``NO_TOKENS`` or ``NO_PAGES`` (nothing allocated or placed).
        """
        if n <= 0:
            return Verdict.NO_TOKENS
        if not self.pool.allocate(seq.kv, seq.num_computed_tokens + n):
            fit = fit_tokens(self.pool, seq)
            if not (shrink and 1 <= fit < n and self.pool.allocate(seq.kv, seq.num_computed_tokens + fit)):
                return Verdict.NO_PAGES
            n = fit
        self.place(seq, n)
        return Verdict.PLACED

    def start_prefix(self, seq: Sequence, partial: bool, clock: Callable[[], float],
                     estimate: Callable[[Sequence], tuple[int, float, float]] | None = None) -> PrefixStart:
        """Give waiting ``seq`` its cached prefix (:meth:`KVPool.begin_prefix`) unless placed
        already. Loads estimated (``estimate(seq)[2]`` seconds, the ranking's
        :meth:`~kvtier.serve.ranking.ArrivalOrder.estimate`; None: never waited for) to fit in
        the step's inline share are waited for now, at most that share
        (:meth:`StepBudget.take_inline`); ``seq`` is admitted (its ``admitted_time`` read from
        ``clock``) before the wait.

        Returns:
            ``READY``: its ``num_computed_tokens`` is the prefix placed (cut by :func:`cap_reuse`);
            ``LOADING``: its loads run on; ``NO_ROOM``: the loads need more free pages and
            ``partial`` was False (nothing taken).
        """
        pool = self.pool
        if not seq.prefix_done:
            start = pool.begin_prefix(seq.kv, partial=partial)
            if start is PrefixStart.LOADING and estimate is not None:
                limit = self.budget.take_inline(estimate(seq)[2], pool.recompute_s(self.tokens))
                if limit is not None:
                    # Bounded: a load slower than its estimate goes on as any other (``loading``).
                    mark(seq, "admitted_time", clock)
                    began = clock()
                    if pool.wait_prefix(seq.kv, timeout_s=limit) is not None:
                        start = PrefixStart.READY
                    self.budget.waited_inline(clock() - began)
            if start is not PrefixStart.READY:
                return start
            seq.num_computed_tokens = pool.finish_prefix(seq.kv)  # the prefix it placed
            seq.prefix_done = True
        cap_reuse(pool, seq)
        return PrefixStart.READY

    def place(self, seq: Sequence, n: int) -> None:
        """Add ``n`` tokens of ``seq`` (its pages allocated): a decode, or a prefill chunk whose
        attention work is charged; both are charged to the token budget."""
        self.tokens_left -= n
        if n == 1 and seq.num_computed_tokens == seq.num_tokens - 1:
            self.batch.decodes.append(seq)
        else:
            self.batch.extends.append((seq, n))
            self.budget.charge(seq, n)
        restore = self.pool.take_restore(seq.kv)
        if restore is not None:
            self.batch.restores[seq.seq_id] = restore

    def grow(self, seq: Sequence, tokens: int, exact: bool = False) -> int:
        """Add up to ``tokens`` prefill tokens to running ``seq``'s chunk (within its prompt, the
        attention budget and the pages; ``exact``: all ``tokens`` or none); returns the tokens
        added (0: nothing changed)."""
        batch = self.batch
        i = next((k for k, (q, _) in enumerate(batch.extends) if q is seq), None)
        have = 0 if i is None else batch.extends[i][1]
        extra = self.budget.cap(seq, min(remaining(seq) - have, tokens), have)
        if extra <= 0 or (exact and extra < tokens):
            return 0
        if not self.pool.allocate(seq.kv, seq.num_computed_tokens + have + extra):
            return 0
        if i is None:
            self.place(seq, extra)  # charges the chunk
        else:
            self.tokens_left -= extra
            self.budget.charge(seq, extra, have)
            batch.extends[i] = (seq, have + extra)
        return extra

    def chunked(self, running: list[Sequence]) -> list[Sequence]:
        """Those of ``running`` that will still have prompt tokens to run after this step."""
        placed = {s.seq_id: n for s, n in self.batch.extends}
        placed.update((s.seq_id, 1) for s in self.batch.decodes)
        return [s for s in running if s.num_computed_tokens + placed.get(s.seq_id, 0) < s.num_tokens - 1]

    def end_chunked(self, chunked: list[Sequence]) -> int:
        """Place the rest of the prompt of the one chunked prefill now, when it fits in the token
        budget left with a token to spare, so a waiting prompt longer than the budget left can
        start its chunks beside it (the step is not left half empty). Returns the tokens placed."""
        if len(chunked) != 1:
            return 0
        seq = chunked[0]
        have = next((n for q, n in self.batch.extends if q is seq), 0)
        rest = remaining(seq) - have
        if not 0 < rest < self.tokens_left:
            return 0
        placed = self.grow(seq, rest, exact=True)
        if placed:
            chunked.remove(seq)
        return placed


def cap_reuse(pool: KVPool, seq: Sequence) -> None:
    """A re-admitted request that wants prompt logprobs may reuse only tokens whose logprobs
    it already has (or reported as cached), so ``prompt_logprobs`` never has holes: its placed
    prefix is cut back (:meth:`KVPool.truncate`) to the first position without one."""
    if not (seq.admitted and seq.params.prompt_logprobs):
        return
    entries = seq.prompt_logprobs
    first_missing = next((i for i in range(seq.num_cached_tokens, len(entries)) if entries[i] is None),
                         seq.num_prompt_tokens)
    if seq.num_computed_tokens > first_missing:
        seq.num_computed_tokens = min(seq.num_computed_tokens, pool.truncate(seq.kv, first_missing))


def fit_tokens(pool: KVPool, seq: Sequence) -> int:
    """Tokens ``seq`` can run with the pages it holds and the free ones."""
    return (len(seq.page_ids) + pool.num_free_pages) * pool.config.page_size - seq.num_computed_tokens


def admission_pages(pool: KVPool, seq: Sequence, prefill_tokens: int, budget: int) -> int:
    """Free device pages waiting ``seq`` takes to be admitted: its reused prefix (the prompt
    less its ``prefill_tokens`` to prefill; resident pages counted as taken) and a first chunk
    of at most ``budget`` tokens, less the pages it holds."""
    return pool.num_pages_needed(seq.kv, seq.num_tokens - prefill_tokens + min(prefill_tokens, budget))


def pages_freed(pool: KVPool, seq: Sequence) -> int:
    """Device pages that preempting ``seq`` frees: those no other sequence shares."""
    return pool.num_private_pages(seq.kv)


__all__ = ["INLINE_LOAD_SHARE", "ScheduledBatch", "StepBudget", "StepPlan", "Verdict", "admission_pages", "cap_reuse",
           "fit_tokens", "pages_freed", "pairs", "remaining"]
