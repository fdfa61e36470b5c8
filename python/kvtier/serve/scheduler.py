"""Continuous-batching scheduler with chunked prefill, asynchronous prefix loads and recompute
preemption."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvtier.cache.pool import KVPool, PrefixStart
from kvtier.serve.config import EngineConfig
from kvtier.serve.request import Sequence, SequenceStatus


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


class Scheduler:
    """FCFS: running sequences first (decodes and unfinished prefills), then admissions.

    An admitted sequence first gets its cached prefix from the pool; the pool's cost model
    decides how much of it to load from the tiers holding it rather than recompute. While blocks
    load from a lower tier the sequence waits in ``loading`` and the batch goes on without it. A sequence whose loads need more device pages than are free stays
    at the head of ``waiting`` until running sequences free pages; only when nothing else holds
    pages does it load what fits and recompute the rest. A head that failed admission is not
    retried until pages were freed (or its chunk budget shrank). When pages run out, the most
    recently admitted running sequence is preempted: its pages are released into the prefix
    cache, so its full blocks are offloaded rather than lost (an evicted page is copied to the
    host tier when there is one: at once under write-through, at eviction under write-back).
    When it is re-admitted it matches them like any returning prompt and loads them back; its
    last, partial block, and whatever no tier kept or the cost model chose not to load, are
    recomputed.
    """

    def __init__(self, config: EngineConfig, pool: KVPool):
        self.config = config
        self.pool = pool
        self.waiting: deque[Sequence] = deque()
        self.loading: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # The head that failed admission, the free pages then and the token budget it had.
        self._blocked: tuple[Sequence, int, int] | None = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.loading or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.free(seq)
        seq.num_computed_tokens = 0
        seq.prefix_done = False
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _place(self, batch: ScheduledBatch, seq: Sequence, n: int) -> None:
        if n == 1 and seq.num_computed_tokens == seq.num_tokens - 1:
            batch.decodes.append(seq)
        else:
            batch.extends.append((seq, n))

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if seq.num_computed_tokens >= seq.num_tokens:
                # Computed but never sampled (a step was interrupted): recompute the last token.
                seq.num_computed_tokens = seq.num_tokens - 1
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.pool.allocate(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self._place(batch, seq, n)
                budget -= n
        return budget

    def _collect_loaded(self) -> None:
        """Move sequences whose prefix loads ended to the front of the waiting queue, in the order
        they were admitted."""
        ended = [seq for seq in self.loading if self.pool.finish_prefix(seq) is not None]
        for seq in reversed(ended):
            self.loading.remove(seq)
            seq.prefix_done = True
            self.waiting.appendleft(seq)

    def _cap_reuse(self, seq: Sequence) -> None:
        """A re-admitted request that wants prompt logprobs may reuse only tokens whose logprobs
        it already has (or reported as cached), so ``prompt_logprobs`` never has holes."""
        if not (seq.admitted and seq.params.prompt_logprobs):
            return
        entries = seq.prompt_logprobs
        first_missing = next((i for i in range(seq.num_cached_tokens, len(entries)) if entries[i] is None),
                             seq.num_prompt_tokens)
        if seq.num_computed_tokens > first_missing:
            self.pool.truncate(seq, first_missing)

    @staticmethod
    def _record_admission(seq: Sequence) -> None:
        """The first admission that runs defines what the request reports as cached."""
        if not seq.admitted:
            seq.admitted = True
            seq.num_cached_tokens = seq.num_computed_tokens
            seq.cached_tokens_by_tier = dict(seq.prefix_tokens_by_tier)

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) + len(self.loading) < self.config.max_num_seqs:
            seq = self.waiting[0]
            others = bool(self.running or self.loading)  # they will free pages
            if others and self._still_blocked(seq, budget):
                break
            if not seq.prefix_done:
                start = self.pool.begin_prefix(seq, partial=not others)
                if start is PrefixStart.NO_ROOM:
                    self._block(seq, 0)  # its loads need the pages whatever the budget
                    break
                if start is PrefixStart.LOADING:
                    self.waiting.popleft()
                    self.loading.append(seq)
                    self._blocked = None  # it holds pages now: when its loads end it is placed at once
                    continue
                seq.prefix_done = True
            self._cap_reuse(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.pool.allocate(seq, seq.num_computed_tokens + n):
                # No room yet: no waiting sequence keeps pages (their reused blocks stay cached,
                # loaded ones are now device copies), so waiting can never deadlock the pool.
                for w in self.waiting:
                    if w.page_ids or w.prefix_done:
                        self.pool.free(w)
                        w.num_computed_tokens, w.prefix_done = 0, False
                self._block(seq, budget)
                break
            self.waiting.popleft()
            self._blocked = None
            self._record_admission(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._place(batch, seq, n)
            budget -= n

    def _block(self, seq: Sequence, budget: int) -> None:
        self._blocked = (seq, self.pool.num_free_pages, budget)

    def _still_blocked(self, seq: Sequence, budget: int) -> bool:
        """``seq`` failed admission, no page was freed since and its chunk can be no smaller:
        retrying would fail again."""
        if self._blocked is None or self._blocked[0] is not seq:
            return False
        return self.pool.num_free_pages <= self._blocked[1] and budget >= self._blocked[2]

    def schedule(self) -> ScheduledBatch:
        """Pick this step's work within ``max_num_batched_tokens``."""
        self.pool.poll()
        self._collect_loaded()
        batch = ScheduledBatch()
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens)
        self._admit_waiting(batch, budget)
        return batch

    def abort(self, seq: Sequence) -> None:
        """Remove ``seq`` wherever it is and free its pages."""
        for queue in (self.running, self.loading):
            if seq in queue:
                queue.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if self._blocked is not None and self._blocked[0] is seq:
            self._blocked = None
        self.pool.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.running.remove(seq)
        self.pool.free(seq)
