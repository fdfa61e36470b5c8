"""Whom the scheduler preempts: a rule that names victims; it changes no queue and no page.

:class:`PreemptLast` (``fcfs``) preempts nobody for a waiting request and, when a running
sequence is short of pages, the last admitted. :class:`PreemptBehind` (``cache-aware``) lets
the best-ranked request blocked on pages take them from what ranks behind it (or, when its
blocks load back, from decodes). The scheduler preempts the victims
(:meth:`kvtier.serve.queues.Queues.preempt`).

Where a preempted sequence comes back by copy (``EngineConfig.preemption_mode`` ``swap`` over a
pool with a tier below the device, :func:`kvtier.serve.queues.resumes_by_copy`),
:class:`PreemptBehind` weighs each victim's resume cost (:meth:`KVPool.resume_s`: its full
blocks loaded back, its partial last page recomputed): a decode is preempted for a waiting
request only when that costs less than waiting for it to end (its tokens left times the
step-time model's estimate of a step), and a running sequence short of pages preempts a
prefill after it whose resume costs least before any decode. Decodes go least harmed first
(:meth:`PreemptBehind.harm`): by the seconds per output token a preemption would leave them
carrying in waits (their waits so far and the measured wait of a preempted decode until it is
admitted again, :attr:`Queues.decode_wait_s`, plus the resume, over their ``max_tokens - 1``
gaps). On the real engine every request in the time-per-output-token p99 was a decode of a
few tokens preempted once or twice, which spent 86-98% of its decode time waiting to be
admitted again (``perf/preemption_anatomy.py``, docs/scheduling.md): the wait, not the copy,
is what a preemption costs a decode.
"""

from __future__ import annotations

from kvtier.cache.pool import KVPool
from kvtier.serve.config import EngineConfig
from kvtier.serve.queues import Queues, resumes_by_copy
from kvtier.serve.ranking import ArrivalOrder, CostRanking
from kvtier.serve.request import Sequence, SequenceStatus
from kvtier.serve.step_plan import StepBudget, admission_pages, pages_freed, remaining
from kvtier.serve.step_time import StepTimeModel, step_features


# Where preempted sequences come back by copy, a decode with this many tokens left or fewer is
# not preempted for a waiting request: the request waits at most that many steps for its pages,
# while the decode, preempted, waits to be admitted again (seconds on 16 kv-cache-tester sessions,
# against steps of 50-100 ms: docs/scheduling.md) and that wait is its whole time per output token.
SPARED_DECODE_TOKENS = 4


class PreemptLast:
    """Nobody is preempted for a waiting request; a running sequence short of pages preempts
    the last admitted.

    Args:
        ranking: the ranking it preempts by.
        config: the engine's limits.
        pool: the page pool (what a preemption frees).
        queues: the scheduler's queues, read only.
        step_time: the scheduler's step-time model (what waiting for a decode to end costs);
            None: no estimate (a decode's resume cost is then not weighed).
        reserve: device pages admission keeps free for the running sequences
            (``EngineConfig.admission_watermark``); making room for a new request frees them too.
    """

    def __init__(self, ranking: ArrivalOrder, config: EngineConfig, pool: KVPool, queues: Queues,
                 step_time: StepTimeModel | None = None, reserve: int = 0):
        self.ranking, self.config, self.pool, self.queues = ranking, config, pool, queues
        self.step_time, self.reserve = step_time, reserve
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
        # its reused prefix and first chunk need pages; a new request leaves the reserve free
        need = admission_pages(pool, head, r.estimate(head)[0], self.config.max_num_batched_tokens)
        if not r.resuming(head):
            need += self.reserve
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
        tokens left to decode first (where they come back by copy: only those
        :meth:`cheap_decodes` names, in its order), then the other prefills, last-ranked first."""
        r, running = self.ranking, self.queues.running
        key = r.key(head)
        spared = lambda q: q.num_passed_over + 1 >= r.age_limit(q) or self.ends_soon(q)  # noqa: E731
        prefills = [q for q in running if remaining(q) > 1 and not spared(q)]
        candidates = sorted((q for q in prefills if r.key(q) > key), key=r.key, reverse=True)
        if (not head.output_token_ids or r.urgent(head)) and self.pool.keeps_evicted_blocks:
            taken = {q.seq_id for q in candidates}
            decodes = [q for q in running if q.output_token_ids and not spared(q) and q.seq_id not in taken]
            if resumes_by_copy(self.config, self.pool):
                candidates += self.cheap_decodes(decodes)
            else:
                candidates += sorted(decodes, key=tokens_left, reverse=True)
            taken |= {q.seq_id for q in candidates}
            candidates += sorted((q for q in prefills if q.seq_id not in taken), key=r.key, reverse=True)
        chosen, freed = [], 0
        for v in candidates:
            if freed >= short:
                break
            chosen.append(v)
            freed += pages_freed(self.pool, v)
        return chosen if freed >= short else None

    def cheap_decodes(self, decodes: list[Sequence]) -> list[Sequence]:
        """Those of ``decodes`` with more than :data:`SPARED_DECODE_TOKENS` tokens left whose
        resume costs less than waiting for them to end (:meth:`KVPool.resume_s` < tokens left x
        :meth:`step_s`), the least harmed by a preemption first (:meth:`harm`); all of them,
        most tokens left first, before the step-time model has an estimate. (The measured wait
        is left out of the filter: with it, decodes of dozens of tokens were not preempted and
        new turns waited for them, 1.8x the TTFT p90 in the simulator on 32 kv-cache-tester
        sessions; docs/scheduling.md.)"""
        decodes = [q for q in decodes if tokens_left(q) > SPARED_DECODE_TOKENS]
        step_s = self.step_s()
        if step_s is None:
            return sorted(decodes, key=tokens_left, reverse=True)
        resume = {q.seq_id: self.pool.resume_s(q.kv) for q in decodes}
        return sorted((q for q in decodes if resume[q.seq_id] < tokens_left(q) * step_s),
                      key=lambda q: self.harm(q, resume[q.seq_id]))

    def harm(self, seq: Sequence, resume_s: float) -> float:
        """The seconds per output token decode ``seq`` would carry in waits if preempted now
        (what its time per output token, ``(finish - first token) / (max_tokens - 1)``, grows by
        over a run without preemption): its waits so far (:attr:`Queues.waited_s`), the measured
        wait of a preempted decode until admitted again (:attr:`Queues.decode_wait_s`) and its
        resume ``resume_s`` (seconds, :meth:`KVPool.resume_s`), over its ``max_tokens - 1`` gaps.
        A decode resumed a moment ago, or one with few tokens to spread a wait over, is harmed
        most."""
        waits = self.queues.waited_s.get(seq.seq_id, 0.0) + self.queues.decode_wait_s + resume_s
        return waits / max(1, seq.params.max_tokens - 1)

    def step_s(self) -> float | None:
        """The step-time model's estimate of a step of the running sequences: their decodes and
        up to a step's budget of their prefill tokens (None before its first fit)."""
        if self.step_time is None:
            return None
        running = self.queues.running
        decodes = [q for q in running if remaining(q) <= 1]
        prefill = min(sum(remaining(q) for q in running if remaining(q) > 1), self.config.max_num_batched_tokens)
        return self.step_time.estimate_s(step_features([(prefill, 0)] if prefill else [], len(decodes),
                                                       sum(q.num_computed_tokens + 1 for q in decodes)))

    def running_victim(self, seq: Sequence) -> Sequence:
        """Of ``seq`` (short of pages) and the running sequences after it, the worst-ranked,
        prefills that end within a step last; where preempted sequences come back by copy,
        prefills before decodes (a decode's wait lengthens its time per output token) and those
        that end within a step last, a prefill whose resume costs least
        (:meth:`KVPool.resume_s`), a decode least harmed (:meth:`harm`)."""
        running = self.queues.running
        later = running[running.index(seq):]
        if resumes_by_copy(self.config, self.pool):
            def key(q):
                if q.output_token_ids:
                    return self.ends_soon(q), True, self.harm(q, self.pool.resume_s(q.kv))
                return self.ends_soon(q), False, self.pool.resume_s(q.kv)
            return min(later, key=key)
        return max(later, key=lambda q: (not self.ends_soon(q), self.ranking.key(q)))

    def deferred(self, seq: Sequence, step: StepBudget) -> bool:
        """Preempted to make room: not re-admitted while the request it made room for waits,
        unless aged or that request now waits behind the chunked prefill."""
        head = self.displaced.get(seq.seq_id)
        return head is not None and not self.ranking.urgent(seq) and not self.ranking.waits_for_chunk(head, step)


def tokens_left(seq: Sequence) -> int:
    """Output tokens ``seq`` may still produce (``max_tokens`` less those out)."""
    return seq.params.max_tokens - len(seq.output_token_ids)


__all__ = ["SPARED_DECODE_TOKENS", "PreemptBehind", "PreemptLast", "tokens_left"]
