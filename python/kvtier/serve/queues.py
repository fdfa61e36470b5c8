"""The scheduler's queues: who waits, who loads its prefix, who runs, and who failed admission.

A request moves between them through :class:`Queues`' methods alone (admission, loads ended,
preemption), which the scheduler (:mod:`kvtier.serve.scheduler`) calls; the ranking and the
preemption rule (:mod:`kvtier.serve.ranking`, :mod:`kvtier.serve.preemption`) read them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.cache.pool import KVPool
from kvtier.serve.config import EngineConfig
from kvtier.serve.request import Sequence, SequenceStatus


WAIT_WEIGHT = 0.25  # weight of the latest wait in Queues.decode_wait_s's moving average


def resumes_by_copy(config: EngineConfig, pool: KVPool) -> bool:
    """Whether a preempted sequence comes back by copy: ``preemption_mode`` is ``swap`` and the
    pool keeps evicted blocks below the device (:attr:`KVPool.keeps_evicted_blocks`: under
    write-back a reused page's block is copied to the host tier first, and a returning request
    loads it back). Then the preemption rule picks victims by :meth:`KVPool.resume_s` and the
    admission watermark does not hold it back."""
    return config.preemption_mode == "swap" and pool.keeps_evicted_blocks


@dataclass
class Queues:
    """``waiting`` (arrival order, preempted and loaded requests at the head), ``loading`` (their
    prefix loads run in the background), ``running`` (admission order), and ``blocked``: the
    requests that failed admission, by seq_id, with the free pages then and the token budget they
    had (not retried until pages were freed or the budget shrank). ``num_preemptions`` counts
    :meth:`preempt` calls; ``preempted``: the seq_ids of the preempted requests not admitted
    again yet.

    What a decode's preemption costs it, measured: ``decode_wait_s`` is the mean seconds a
    sequence preempted after its first token waited until admitted again (an exponential moving
    average with weight :data:`WAIT_WEIGHT` on the latest; 0 before the first), and
    ``waited_s`` each unfinished sequence's seconds waited so far after its first token (what its
    time per output token already carries), both read from the clock passed to
    :meth:`preempt` and the admissions."""

    waiting: deque[Sequence] = field(default_factory=deque)
    loading: list[Sequence] = field(default_factory=list)
    running: list[Sequence] = field(default_factory=list)
    blocked: dict[int, tuple[int, int]] = field(default_factory=dict)
    num_preemptions: int = 0
    preempted: set[int] = field(default_factory=set)
    decode_wait_s: float = 0.0
    waited_s: dict[int, float] = field(default_factory=dict)
    _decode_preempted_at: dict[int, float] = field(default_factory=dict)

    def start_loading(self, seq: Sequence, clock: Callable[[], float]) -> None:
        """Waiting ``seq`` is admitted and its prefix loads run: it holds pages now, so it is
        placed as soon as they end (:meth:`collect_loaded`)."""
        mark(seq, "admitted_time", clock)
        self.waiting.remove(seq)
        self.loading.append(seq)
        self.unblock(seq)
        self.preempted.discard(seq.seq_id)
        self._readmitted(seq, clock)

    def start_running(self, seq: Sequence, clock: Callable[[], float]) -> None:
        """Waiting ``seq``'s first chunk was placed: it runs. Its first admission that runs
        defines what it reports as cached (``num_cached_tokens``, ``cached_tokens_by_tier``)."""
        self.waiting.remove(seq)
        self.unblock(seq)
        self.preempted.discard(seq.seq_id)
        self._readmitted(seq, clock)
        mark(seq, "admitted_time", clock)
        mark(seq, "loaded_time", clock)
        if not seq.admitted:
            seq.admitted = True
            seq.num_cached_tokens = seq.num_computed_tokens
            seq.cached_tokens_by_tier = dict(seq.kv.prefix_tokens_by_tier)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def preempt(self, seq: Sequence, pool: KVPool, now: float | None = None) -> None:
        """Running ``seq``'s pages go back to the prefix cache (its full blocks stay cached, and
        are copied down a tier when their pages are reused, where the pool keeps evicted blocks),
        and it waits at the queue's head; when re-admitted it matches and loads them like any
        returning prompt, and recomputes the tokens past its last full block (the partial last
        page: fewer than ``page_size`` tokens, and at least its last token). ``now``: the
        scheduler's clock, from which a decode's wait is measured (None: not measured)."""
        self.running.remove(seq)
        pool.free(seq.kv)
        if seq.output_token_ids:
            seq.metrics.preemptions_after_first_token += 1
            if now is not None:
                self._decode_preempted_at[seq.seq_id] = now
        else:
            seq.metrics.num_preemptions += 1
        seq.num_computed_tokens = 0
        seq.prefix_done = False
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        self.preempted.add(seq.seq_id)

    def _readmitted(self, seq: Sequence, clock: Callable[[], float]) -> None:
        """``seq`` is admitted again: the wait of a decode preempted since goes into
        :attr:`decode_wait_s` and its :attr:`waited_s`."""
        at = self._decode_preempted_at.pop(seq.seq_id, None)
        if at is not None:
            wait = max(0.0, clock() - at)
            self.waited_s[seq.seq_id] = self.waited_s.get(seq.seq_id, 0.0) + wait
            self.decode_wait_s += WAIT_WEIGHT * (wait - self.decode_wait_s) if self.decode_wait_s else wait

    def finish(self, seq: Sequence) -> None:
        """Running ``seq`` ended: it leaves the running queue and its waits are forgotten."""
        self.running.remove(seq)
        self.waited_s.pop(seq.seq_id, None)

    def block(self, seq: Sequence, free_pages: int, budget: int) -> None:
        self.blocked[seq.seq_id] = (free_pages, budget)

    def still_blocked(self, seq: Sequence, free_pages: int, budget: int) -> bool:
        """``seq`` failed admission, no page was freed since and its chunk can be no smaller."""
        got = self.blocked.get(seq.seq_id)
        return got is not None and free_pages <= got[0] and budget >= got[1]

    def unblock(self, seq: Sequence) -> None:
        self.blocked.pop(seq.seq_id, None)

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out of whichever queue holds it."""
        for queue in (self.running, self.loading):
            if seq in queue:
                queue.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.unblock(seq)
        self.preempted.discard(seq.seq_id)
        self.waited_s.pop(seq.seq_id, None)
        self._decode_preempted_at.pop(seq.seq_id, None)

    def collect_loaded(self, pool: KVPool, clock: Callable[[], float]) -> None:
        """Move sequences whose prefix loads ended to the front of the waiting queue, in the order
        they were admitted (their ``loaded_time`` read from ``clock``)."""
        ended = []
        for seq in self.loading:
            tokens = pool.finish_prefix(seq.kv)
            if tokens is not None:
                seq.num_computed_tokens = tokens
                ended.append(seq)
        for seq in reversed(ended):
            self.loading.remove(seq)
            seq.prefix_done = True
            mark(seq, "loaded_time", clock)
            self.waiting.appendleft(seq)

    def release_waiting(self, pool: KVPool) -> None:
        """No waiting sequence keeps pages (their reused blocks stay cached, loaded ones are now
        device copies), so waiting can never deadlock the pool."""
        for w in self.waiting:
            if w.page_ids or w.prefix_done:
                pool.free(w.kv)
                w.num_computed_tokens, w.prefix_done = 0, False


def mark(seq: Sequence, name: str, clock: Callable[[], float]) -> None:
    """Set ``seq.metrics.<name>`` to ``clock()`` unless it is set already."""
    if getattr(seq.metrics, name) is None:
        setattr(seq.metrics, name, clock())


__all__ = ["WAIT_WEIGHT", "Queues", "mark", "resumes_by_copy"]
