"""Whom the scheduler preempts: a rule that names victims; it changes no queue and no page.

:class:`PreemptLast` (``fcfs``) preempts nobody for a waiting request and, when a running
sequence is short of pages, the last admitted. :class:`PreemptBehind` (``cache-aware``) lets
the best-ranked request blocked on pages take them from what ranks behind it (or, when its
blocks load back, from decodes). The scheduler preempts the victims
(:meth:`kvtier.serve.queues.Queues.preempt`).
"""

from __future__ import annotations

from kvtier.cache.pool import KVPool
from kvtier.serve.config import EngineConfig
from kvtier.serve.queues import Queues
from kvtier.serve.ranking import ArrivalOrder, CostRanking
from kvtier.serve.request import Sequence, SequenceStatus
from kvtier.serve.step_plan import StepBudget, pages_freed, remaining


class PreemptLast:
    """Nobody is preempted for a waiting request; a running sequence short of pages preempts
    the last admitted.

    Args:
        ranking: the ranking it preempts by.
        config: the engine's limits.
        pool: the page pool (what a preemption frees).
        queues: the scheduler's queues, read only.
    """

    def __init__(self, ranking: ArrivalOrder, config: EngineConfig, pool: KVPool, queues: Queues):
        self.ranking, self.config, self.pool, self.queues = ranking, config, pool, queues
        self.displaced: dict[int, Sequence] = {}  # preempted seq_id -> the request it made room for

    def begin_step(self) -> None:
        """Forget the displaced whose request is no longer waiting."""
        self.displaced = {i: h for i, h in self.displaced.items() if h.status is SequenceStatus.WAITING}

    def make_room(self, step: StepBudget) -> tuple[Sequence, list[Sequence]] | None:
        """``(request, victims)``: running sequences to preempt so the best-ranked request blocked
        on pages gets in; None: nobody."""
        return None

    def running_victim(self, seq: Sequence) -> Sequence:
        """Whom running ``seq``, short of pages for its chunk, preempts (itself included)."""
        return self.queues.running[-1]

    def deferred(self, seq: Sequence, step: StepBudget) -> bool:
        """Whether waiting ``seq`` is not tried this step."""
        return False

    def forget(self, seq: Sequence) -> None:
        """``seq`` finished or was aborted."""
        self.displaced.pop(seq.seq_id, None)


class PreemptBehind(PreemptLast):
    """The best-ranked request blocked on pages takes them from running prefills ranked behind
    it, and, when the pool keeps evicted blocks below the device and it waits for its first
    token (or is aged), from decodes and then any prefill; never from a prefill that ends
    within a step or one the preemption would age. A running sequence short of pages preempts
    the worst-ranked of itself and those after it. A preempted request is not re-admitted while
    the request it made room for waits (unless aged, or that request waits behind the chunked
    prefill)."""

    ranking: CostRanking

    def ends_soon(self, seq: Sequence) -> bool:
        """Whether ``seq`` is a prefill whose prompt can end within one step's token budget."""
        return 1 < remaining(seq) <= self.config.max_num_batched_tokens

    def make_room(self, step: StepBudget) -> tuple[Sequence, list[Sequence]] | None:
        """Preempt running sequences for the best-ranked request blocked on pages when their
        pages together let it in (as vLLM's priority scheduling does); the victims are recorded
        as displaced by it, and each counts a step passed over."""
        r, pool = self.ranking, self.pool
        blocked = [q for q in self.queues.waiting if q.seq_id in self.queues.blocked
                   and not r.waits_for_chunk(q, step)]
        if not blocked:
            return None
        head = r.ranked(blocked)[0]
        if head.page_ids:
            return None
        tokens = r.estimate(head)[0]  # its reused prefix and first chunk need pages
        need = pool.num_pages_needed(head.kv, head.num_tokens - tokens + min(tokens, self.config.max_num_batched_tokens))
        if pool.num_free_pages >= need:
            return None
        chosen = self.victims(head, need - pool.num_free_pages)
        if not chosen:
            return None
        for v in chosen:
            v.num_passed_over += 1
            self.displaced[v.seq_id] = head
        return head, chosen

    def victims(self, head: Sequence, short: int) -> list[Sequence] | None:
        """Running sequences whose unshared pages free at least ``short`` for ``head`` (None when
        all candidates together do not): prefills ranked behind it, costliest first; then, when
        ``head`` waits for its first token or is aged and the pool keeps evicted blocks below
        the device (the preempted load theirs back), sequences past their first token, most
        tokens left to decode first, then the other prefills, last-ranked first."""
        r, running = self.ranking, self.queues.running
        key = r.key(head)
        spared = lambda q: q.num_passed_over + 1 >= r.age_limit(q) or self.ends_soon(q)  # noqa: E731
        prefills = [q for q in running if remaining(q) > 1 and not spared(q)]
        candidates = sorted((q for q in prefills if r.key(q) > key), key=r.key, reverse=True)
        if (not head.output_token_ids or r.urgent(head)) and self.pool.keeps_evicted_blocks:
            taken = {q.seq_id for q in candidates}
            candidates += sorted((q for q in running if q.output_token_ids and not spared(q)
                                  and q.seq_id not in taken),
                                 key=lambda q: q.params.max_tokens - len(q.output_token_ids), reverse=True)
            taken |= {q.seq_id for q in candidates}
            candidates += sorted((q for q in prefills if q.seq_id not in taken), key=r.key, reverse=True)
        chosen, freed = [], 0
        for v in candidates:
            if freed >= short:
                break
            chosen.append(v)
            freed += pages_freed(self.pool, v)
        return chosen if freed >= short else None

    def running_victim(self, seq: Sequence) -> Sequence:
        """Of ``seq`` (short of pages) and the running sequences after it, the worst-ranked,
        prefills that end within a step last."""
        running = self.queues.running
        later = running[running.index(seq):]
        return max(later, key=lambda q: (not self.ends_soon(q), self.ranking.key(q)))

    def deferred(self, seq: Sequence, step: StepBudget) -> bool:
        """Preempted to make room: not re-admitted while the request it made room for waits,
        unless aged or that request now waits behind the chunked prefill."""
        head = self.displaced.get(seq.seq_id)
        return head is not None and not self.ranking.urgent(seq) and not self.ranking.waits_for_chunk(head, step)


__all__ = ["PreemptBehind", "PreemptLast"]
