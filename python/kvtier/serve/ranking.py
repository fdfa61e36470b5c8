"""The order in which the scheduler serves requests: a ranking over a read-only view of its
queues (:class:`kvtier.serve.queues.Queues`).

A ranking answers; it changes no queue, no budget and no page (it counts the steps a request
was passed over on the request, :meth:`ArrivalOrder.count_passed_over`). :class:`ArrivalOrder` (``fcfs``)
tries waiting requests in queue order and caps nothing; :class:`CostRanking` (``cache-aware``)
ranks by a cost-to-serve deadline with aging, keeps a fast lane for short returning turns and
plans how many tokens each running prefill takes.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtier.cache.pool import KVPool
from kvtier.serve.config import EngineConfig
from kvtier.serve.queues import Queues, resumes_by_copy
from kvtier.serve.request import Sequence, SequenceStatus
from kvtier.serve.step_plan import ScheduledBatch, StepBudget, remaining

DEADLINE_STRETCH = 1.0
"""A request's deadline is its arrival plus this many times its estimated cost to serve, so a
cheap request goes ahead of a costly one that arrived up to (this times) the difference in
cost before it, and a costly one is not passed over by later arrivals for longer than about
its own cost."""
CHUNK_SHARE = 0.5
"""Share of each step's token budget the oldest running prefill gets at least."""
DECODE_AGE_FACTOR = 4
"""A sequence past its first token is aged after this many times ``schedule_max_passes``
steps passed over (preemptions included)."""
FAST_LANE_SHARE = 1 / 16
"""Share of each step's token budget kept for requests waiting for their first token that
need at most that many prefill tokens after their cached prefix (returning turns): they are
admitted ahead of the ranked order, beside a long cold prefill whatever its deadline."""


class ArrivalOrder:
    """``fcfs``: waiting requests in queue order (arrival, preempted and loaded ones first), no
    cap on running prefills, nobody aged; the first that cannot be placed holds the ones behind
    it (:attr:`hold_line`).

    Args:
        config: the engine's limits (``max_num_batched_tokens``, ``schedule_max_passes``).
        pool: the page pool, for the cost model (:meth:`KVPool.estimate_prefix`, ``recompute_s``).
        queues: the scheduler's queues, read only.
    """

    hold_line = True

    def __init__(self, config: EngineConfig, pool: KVPool, queues: Queues):
        self.config, self.pool, self.queues = config, pool, queues
        self._estimates: dict[tuple[int, int, int], tuple[int, float, float]] = {}

    def begin_step(self) -> None:
        """Forget the estimates of the step before (loads ended, pages moved)."""
        self._estimates = {}

    def estimate(self, seq: Sequence) -> tuple[int, float, float]:
        """``(tokens to prefill, estimated seconds to serve its prompt, of which its loads)``,
        memoised per step and per preemption (a preempted sequence is estimated afresh)."""
        memo = (seq.seq_id, seq.metrics.num_preemptions, seq.metrics.preemptions_after_first_token)
        got = self._estimates.get(memo)
        if got is None:
            reused, load_s = 0, 0.0
            if seq.status is SequenceStatus.WAITING and not seq.prefix_done and not seq.page_ids:
                reused, load_s = self.pool.estimate_prefix(seq.kv)
            tokens = max(1, remaining(seq) - reused)
            got = self._estimates[memo] = (tokens, load_s + self.pool.recompute_s(tokens), load_s)
        return got

    def urgent(self, seq: Sequence) -> bool:
        """Whether ``seq`` is aged (ranks first and holds admission)."""
        return False

    def resuming(self, seq: Sequence) -> bool:
        """Whether waiting ``seq`` was preempted and comes back by copy
        (:func:`kvtier.serve.queues.resumes_by_copy`): it is not held to the admission watermark
        (it is one of the running sequences the watermark keeps pages for). It ranks as any
        request does: tried ahead of new ones, holding admission when it did not fit, it cost
        their TTFT more than it saved its own wait (docs/benchmarks.md)."""
        return False

    def fast_lane(self, skip: Iterable[int] = ()) -> dict[int, int]:
        """``{seq_id: tokens to prefill}`` of the requests admitted ahead of the ranked order."""
        return {}

    def plan(self, budget: int, fast: dict[int, int]) -> dict[int, int] | None:
        """Prefill tokens per running prefill by seq_id (absent: 0) within ``budget``; None: no cap."""
        return None

    def order(self, first: Sequence | None, fast: dict[int, int]) -> list[Sequence]:
        """The waiting requests in the order admission tries them."""
        return list(self.queues.waiting)

    def overtakes(self, seq: Sequence, chunked: list[Sequence]) -> bool:
        """Whether waiting ``seq`` starts chunking beside the one prefill being chunked."""
        return False

    def leftover(self, batch: ScheduledBatch) -> list[Sequence]:
        """Running prefills that the budget admission left over goes to, in that order."""
        return []

    def count_passed_over(self, batch: ScheduledBatch, started_loading: list[Sequence]) -> None:
        """Count a step passed over on each request a later arrival overtook in ``batch``."""


class CostRanking(ArrivalOrder):
    """``cache-aware``: aged requests first, by arrival; then requests waiting for their first
    token, then those past it, each by deadline = arrival + ``DEADLINE_STRETCH`` x estimated
    cost to serve (``load_s + recompute_s(tokens to prefill)``, :meth:`KVPool.estimate_prefix`).
    Aged (passed over ``schedule_max_passes`` steps, x ``DECODE_AGE_FACTOR`` after its first
    token) requests hold admission."""

    hold_line = False

    def age_limit(self, seq: Sequence) -> int:
        return self.config.schedule_max_passes * (DECODE_AGE_FACTOR if seq.output_token_ids else 1)

    def urgent(self, seq: Sequence) -> bool:
        return seq.num_passed_over >= self.age_limit(seq)

    def resuming(self, seq: Sequence) -> bool:
        return seq.seq_id in self.queues.preempted and resumes_by_copy(self.config, self.pool)

    def key(self, seq: Sequence) -> tuple:
        arrival = seq.metrics.arrival_time
        if self.urgent(seq):
            return 0, arrival, seq.seq_id
        return 1 + bool(seq.output_token_ids), arrival + DEADLINE_STRETCH * self.estimate(seq)[1], seq.seq_id

    def ranked(self, seqs) -> list[Sequence]:
        return sorted(seqs, key=self.key)

    def fast_lane(self, skip: Iterable[int] = ()) -> dict[int, int]:
        """Requests waiting for their first token, not aged and not in ``skip`` (seq_ids), whose
        tokens to prefill fit in :data:`FAST_LANE_SHARE` of the step's budget, in rank order,
        first fit."""
        skip = set(skip)
        left = int(self.config.max_num_batched_tokens * FAST_LANE_SHARE)
        fast = {}
        for seq in self.ranked(s for s in self.queues.waiting if not s.output_token_ids
                               and s.seq_id not in skip and not self.urgent(s)):
            n = self.estimate(seq)[0]
            if n <= left:
                fast[seq.seq_id] = n
                left -= n
        return fast

    def plan(self, budget: int, fast: dict[int, int]) -> dict[int, int]:
        """The oldest running prefill (the chunked one) gets at least ``CHUNK_SHARE`` of the
        step's budget; then, after the fast lane's tokens, the other prefills and the waiting
        requests in rank order what they need; what admission leaves goes to :meth:`leftover`."""
        running, waiting = self.queues.running, self.queues.waiting
        prefills = [q for q in running if remaining(q) > 1]
        left = budget - (len(running) - len(prefills))
        if not prefills or left <= 0:
            return {}
        oldest = prefills[0]
        reserve = min(remaining(oldest), self.chunk_reserve(), left)
        plan = {oldest.seq_id: reserve}
        left -= reserve + sum(fast.values())
        for seq in self.ranked(prefills[1:] + [q for q in waiting if q.seq_id not in fast]):
            if left <= 0:
                break
            give = min(max(self.estimate(seq)[0] - plan.get(seq.seq_id, 0), 0), left)
            if seq.status is SequenceStatus.RUNNING:
                plan[seq.seq_id] = plan.get(seq.seq_id, 0) + give
            left -= give
        return plan

    def chunk_reserve(self) -> int:
        return max(1, int(self.config.max_num_batched_tokens * CHUNK_SHARE))

    def order(self, first: Sequence | None, fast: dict[int, int]) -> list[Sequence]:
        """Aged requests, those whose prefix is placed (they hold its pages), ``first`` (the one
        preemptions just made room for), the fast lane, then the rest, each in rank order."""
        return sorted(self.ranked(self.queues.waiting),
                      key=lambda q: (not (self.urgent(q) or q.prefix_done), q is not first, q.seq_id not in fast))

    def overtakes(self, seq: Sequence, chunked: list[Sequence]) -> bool:
        """It ranks ahead of the one prefill being chunked."""
        return len(chunked) == 1 and self.key(seq) < self.key(chunked[0])

    def waits_for_chunk(self, seq: Sequence, step: StepBudget) -> bool:
        """Whether waiting ``seq`` would wait this step behind the chunked prefill whatever pages
        were freed: a running prefill will still have prompt tokens left after this step,
        ``seq`` does not overtake it, and its prompt does not fit in the most budget admission
        can have (the step's less the decodes and the smallest chunk :meth:`plan` reserves for
        the oldest prefill, within ``step``'s attention budget). Preempting for it would free
        pages nobody uses."""
        running, budget = self.queues.running, self.config.max_num_batched_tokens
        prefills = [q for q in running if remaining(q) > 1]
        if not prefills:
            return False
        oldest, reserve = prefills[0], self.chunk_reserve()
        chunked = [q for q in prefills if remaining(q) > (reserve if q is oldest else budget)]
        if not chunked:
            return False
        left = budget - (len(running) - len(prefills)) - step.cap(oldest, reserve, share=CHUNK_SHARE)
        return self.estimate(seq)[0] > left and not self.overtakes(seq, chunked)

    def leftover(self, batch: ScheduledBatch) -> list[Sequence]:
        """Running sequences that do not decode this step, cheapest first."""
        decoding = {q.seq_id for q in batch.decodes}
        return self.ranked(q for q in self.queues.running if q.seq_id not in decoding)

    def count_passed_over(self, batch: ScheduledBatch, started_loading: list[Sequence]) -> None:
        """Each request that got no prefill tokens while a later arrival got some (or started its
        loads) counts a step passed over."""
        served = [q for q, _ in batch.extends] + started_loading
        if not served:
            return
        latest = max((q.metrics.arrival_time, q.seq_id) for q in served)
        got = {q.seq_id for q in served} | {q.seq_id for q in batch.decodes}
        for seq in [*self.queues.waiting, *self.queues.running]:
            if seq.seq_id not in got and (seq.metrics.arrival_time, seq.seq_id) < latest:
                seq.num_passed_over += 1


__all__ = ["CHUNK_SHARE", "DEADLINE_STRETCH", "DECODE_AGE_FACTOR", "FAST_LANE_SHARE", "ArrivalOrder", "CostRanking"]
