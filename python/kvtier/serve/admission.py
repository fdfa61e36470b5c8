"""Admission policies of the scheduler (``EngineConfig.schedule_policy``), selected by name.

A policy answers the scheduler's questions; the scheduler (:mod:`kvtier.serve.scheduler`)
places the work, with the pool's page accounting and the step's budgets
(:mod:`kvtier.serve.step_budget`):

- :meth:`SchedulePolicy.plan`: how many prefill tokens each running prefill may take this step;
- :meth:`SchedulePolicy.order`: in which order waiting requests are tried, and whether one that
  cannot be placed holds the ones behind it (:attr:`SchedulePolicy.hold_line`);
- :meth:`SchedulePolicy.make_room`: whom the best-ranked request blocked on pages preempts;
- :meth:`SchedulePolicy.running_victim`: whom a running sequence short of pages preempts;
- :meth:`SchedulePolicy.end_step`: what the step's left-over budget goes to, and aging.

``fcfs`` is arrival order; ``cache-aware`` ranks by a cost-to-serve deadline (see
:class:`CacheAware`).
"""

from __future__ import annotations

from kvtier.serve.config import SCHEDULE_POLICIES
from kvtier.serve.request import Sequence, SequenceStatus
from kvtier.serve.step_budget import ScheduledBatch, StepBudget, pages_freed

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
INLINE_LOAD_SHARE = 0.1
"""Prefix loads estimated under this share of a full step's time
(``recompute_s(max_num_batched_tokens)``), all of them together in one step, are waited for
at admission, so the request runs in the step that admits it rather than the next."""


class SchedulePolicy:
    """The interface: FCFS answers (no plan, arrival order, no preemption for others, the
    last admitted preempted when a running sequence runs short of pages)."""

    name = ""
    hold_line = True

    def __init__(self, sched):
        self.sched = sched  # kvtier.serve.scheduler.Scheduler

    def step_budget(self) -> StepBudget:
        return StepBudget()

    def begin_step(self) -> None:
        """Called once per step before anything is placed."""

    def plan(self, budget: int) -> dict[int, int] | None:
        """Prefill tokens per running prefill by seq_id (absent: 0); None: no cap."""
        return None

    def order(self) -> list[Sequence]:
        return list(self.sched.waiting)

    def deferred(self, seq: Sequence) -> bool:
        """Whether waiting ``seq`` is not tried this step."""
        return False

    def running_victim(self, seq: Sequence) -> Sequence:
        return self.sched.running[-1]

    def load_inline(self, seq: Sequence) -> float | None:
        """The longest ``seq``'s prefix loads may be waited for at admission (seconds), or None:
        they run while other work goes on."""
        return None

    def urgent(self, seq: Sequence) -> bool:
        return False

    def end_step(self, batch: ScheduledBatch, budget: int, started_loading: list[Sequence]) -> None:
        """Called once per step after admission with the token budget left."""

    def invalidate(self, seq: Sequence) -> None:
        """``seq`` was preempted: what the policy knows of its progress is stale."""

    def forget(self, seq: Sequence) -> None:
        """``seq`` finished or was aborted."""


class FCFS(SchedulePolicy):
    """Running prefills in admission order, then waiting requests in arrival order; the first
    that cannot be placed holds the ones behind it."""

    name = "fcfs"


class CacheAware(SchedulePolicy):
    """Rank: aged requests first, by arrival; then requests waiting for their first token, then
    those past it, each by deadline = arrival + ``DEADLINE_STRETCH`` x estimated cost to serve
    (``load_s + recompute_s(tokens to prefill)``, :meth:`KVPool.estimate_prefix`).
    Preempt: the best-ranked request blocked on pages takes them from running prefills ranked
    behind it, and, when the pool keeps evicted blocks below the device and it waits for its
    first token (or is aged), from decodes and then any prefill; never from a prefill that ends
    within a step or one the preemption would age (passed over ``schedule_max_passes`` steps,
    x ``DECODE_AGE_FACTOR`` after its first token). Aged requests hold admission.
    """

    name = "cache-aware"
    hold_line = False

    def __init__(self, sched):
        super().__init__(sched)
        self._estimates: dict[int, tuple[int, float, float]] = {}
        self._displaced: dict[int, Sequence] = {}  # preempted seq_id -> the request it made room for
        self._made_room_for: Sequence | None = None
        self._fast: dict[int, int] = {}

    # ---- the ranking rule ---------------------------------------------------------------------
    def estimate(self, seq: Sequence) -> tuple[int, float, float]:
        """``(tokens to prefill, estimated seconds to serve its prompt, of which its loads)``,
        memoised per step."""
        got = self._estimates.get(seq.seq_id)
        if got is None:
            s, reused, load_s = self.sched, 0, 0.0
            if seq.status is SequenceStatus.WAITING and not seq.prefix_done and not seq.page_ids:
                reused, load_s = s.pool.estimate_prefix(seq.kv)
            tokens = max(1, s.remaining(seq) - reused)
            got = self._estimates[seq.seq_id] = (tokens, load_s + s.pool.recompute_s(tokens), load_s)
        return got

    def age_limit(self, seq: Sequence) -> int:
        return self.sched.config.schedule_max_passes * (DECODE_AGE_FACTOR if seq.output_token_ids else 1)

    def urgent(self, seq: Sequence) -> bool:
        return seq.num_passed_over >= self.age_limit(seq)

    def key(self, seq: Sequence) -> tuple:
        arrival = seq.metrics.arrival_time
        if self.urgent(seq):
            return 0, arrival, seq.seq_id
        return 1 + bool(seq.output_token_ids), arrival + DEADLINE_STRETCH * self.estimate(seq)[1], seq.seq_id

    def ranked(self, seqs) -> list[Sequence]:
        return sorted(seqs, key=self.key)

    # ---- the step -----------------------------------------------------------------------------
    def step_budget(self) -> StepBudget:
        return StepBudget(self.sched.config.max_num_batched_pairs, INLINE_LOAD_SHARE)

    def begin_step(self) -> None:
        self._estimates = {}
        self._displaced = {i: h for i, h in self._displaced.items() if h.status is SequenceStatus.WAITING}
        self._made_room_for = self.make_room()
        self._fast = self._fast_lane()

    def _fast_lane(self) -> dict[int, int]:
        """``{seq_id: tokens to prefill}`` of the requests admitted ahead of the ranked order
        (:data:`FAST_LANE_SHARE`), in rank order, first fit."""
        left = int(self.sched.config.max_num_batched_tokens * FAST_LANE_SHARE)
        fast = {}
        for seq in self.ranked(s for s in self.sched.waiting if not s.output_token_ids
                               and s.seq_id not in self._displaced and not self.urgent(s)):
            n = self.estimate(seq)[0]
            if n <= left:
                fast[seq.seq_id] = n
                left -= n
        return fast

    def plan(self, budget: int) -> dict[int, int]:
        """The oldest running prefill (the chunked one) gets at least ``CHUNK_SHARE`` of the
        step's budget; then, after the fast lane's tokens, the other prefills and the waiting
        requests in rank order what they need; what admission leaves goes to :meth:`end_step`."""
        s = self.sched
        prefills = [q for q in s.running if s.remaining(q) > 1]
        left = budget - (len(s.running) - len(prefills))
        if not prefills or left <= 0:
            return {}
        oldest = prefills[0]
        reserve = min(s.remaining(oldest), self.chunk_reserve(), left)
        plan = {oldest.seq_id: reserve}
        left -= reserve + sum(self._fast.values())
        for seq in self.ranked(prefills[1:] + [q for q in s.waiting if q.seq_id not in self._fast]):
            if left <= 0:
                break
            give = min(max(self.estimate(seq)[0] - plan.get(seq.seq_id, 0), 0), left)
            if seq.status is SequenceStatus.RUNNING:
                plan[seq.seq_id] = plan.get(seq.seq_id, 0) + give
            left -= give
        return plan

    def chunk_reserve(self) -> int:
        return max(1, int(self.sched.config.max_num_batched_tokens * CHUNK_SHARE))

    def order(self) -> list[Sequence]:
        """Aged requests, those whose prefix is placed (they hold its pages), the one preemptions
        just made room for, the fast lane, then the rest, each in rank order."""
        return sorted(self.ranked(self.sched.waiting),
                      key=lambda q: (not (self.urgent(q) or q.prefix_done), q is not self._made_room_for,
                                     q.seq_id not in self._fast))

    def deferred(self, seq: Sequence) -> bool:
        """Preempted to make room: not re-admitted while the request it made room for waits,
        unless aged or that request now waits behind the chunked prefill."""
        head = self._displaced.get(seq.seq_id)
        return head is not None and not self.urgent(seq) and not self.waits_for_chunk(head)

    def load_inline(self, seq: Sequence) -> float | None:
        s = self.sched
        return s.step.take_inline(self.estimate(seq)[2], s.pool.recompute_s(s.config.max_num_batched_tokens))

    def end_step(self, batch: ScheduledBatch, budget: int, started_loading: list[Sequence]) -> None:
        """Left-over budget to running prefills, cheapest first (no preemption); then each
        request that got no prefill tokens while a later arrival got some (or started its
        loads) counts a step passed over."""
        s = self.sched
        decoding = {q.seq_id for q in batch.decodes}
        for seq in self.ranked(q for q in s.running if q.seq_id not in decoding):
            if budget <= 0:
                break
            budget -= s.grow_chunk(batch, seq, budget)
        served = [q for q, _ in batch.extends] + started_loading
        if served:
            latest = max((q.metrics.arrival_time, q.seq_id) for q in served)
            got = {q.seq_id for q in served} | decoding
            for seq in [*s.waiting, *s.running]:
                if seq.seq_id not in got and (seq.metrics.arrival_time, seq.seq_id) < latest:
                    seq.num_passed_over += 1

    # ---- the preemption rule ------------------------------------------------------------------
    def ends_soon(self, seq: Sequence) -> bool:
        """Whether ``seq`` is a prefill whose prompt can end within one step's token budget."""
        return 1 < self.sched.remaining(seq) <= self.sched.config.max_num_batched_tokens

    def make_room(self) -> Sequence | None:
        """Preempt running sequences for the best-ranked request blocked on pages when their
        pages together let it in (as vLLM's priority scheduling does); each preemption counts
        as a step passed over. Returns the request room was made for, or None."""
        s = self.sched
        blocked = [q for q in s.waiting if q.seq_id in s._blocked and not self.waits_for_chunk(q)]
        if not blocked:
            return None
        head = self.ranked(blocked)[0]
        if head.page_ids:
            return None
        tokens = self.estimate(head)[0]  # its reused prefix and first chunk need pages
        need = s.pool.num_pages_needed(head.kv, head.num_tokens - tokens + min(tokens, s.config.max_num_batched_tokens))
        if s.pool.num_free_pages >= need:
            return None
        chosen = self.victims(head, need - s.pool.num_free_pages)
        for v in chosen or ():
            s.preempt(v)
            v.num_passed_over += 1
            self._displaced[v.seq_id] = head
        return head if chosen else None

    def victims(self, head: Sequence, short: int) -> list[Sequence] | None:
        """Running sequences whose unshared pages free at least ``short`` for ``head`` (None when
        all candidates together do not): prefills ranked behind it, costliest first; then, when
        ``head`` waits for its first token or is aged and the pool keeps evicted blocks below
        the device (the preempted load theirs back), sequences past their first token, most
        tokens left to decode first, then the other prefills, last-ranked first."""
        s, key = self.sched, self.key(head)
        spared = lambda q: q.num_passed_over + 1 >= self.age_limit(q) or self.ends_soon(q)  # noqa: E731
        prefills = [q for q in s.running if s.remaining(q) > 1 and not spared(q)]
        candidates = sorted((q for q in prefills if self.key(q) > key), key=self.key, reverse=True)
        if (not head.output_token_ids or self.urgent(head)) and s.pool.keeps_evicted_blocks:
            taken = {q.seq_id for q in candidates}
            candidates += sorted((q for q in s.running if q.output_token_ids and not spared(q)
                                  and q.seq_id not in taken),
                                 key=lambda q: q.params.max_tokens - len(q.output_token_ids), reverse=True)
            taken |= {q.seq_id for q in candidates}
            candidates += sorted((q for q in prefills if q.seq_id not in taken), key=self.key, reverse=True)
        chosen, freed = [], 0
        for v in candidates:
            if freed >= short:
                break
            chosen.append(v)
            freed += pages_freed(s.pool, v)
        return chosen if freed >= short else None

    def running_victim(self, seq: Sequence) -> Sequence:
        """Of ``seq`` (short of pages) and the running sequences after it, the worst-ranked,
        prefills that end within a step last."""
        later = self.sched.running[self.sched.running.index(seq):]
        return max(later, key=lambda q: (not self.ends_soon(q), self.key(q)))

    # ---- the one chunked prefill --------------------------------------------------------------
    def overtakes(self, seq: Sequence, chunked: list[Sequence]) -> bool:
        """Whether waiting ``seq`` starts chunking beside the one prefill being chunked: it ranks
        ahead of it."""
        return len(chunked) == 1 and self.key(seq) < self.key(chunked[0])

    def waits_for_chunk(self, seq: Sequence) -> bool:
        """Whether waiting ``seq`` would wait this step behind the chunked prefill whatever pages
        were freed: a running prefill will still have prompt tokens left after this step,
        ``seq`` does not overtake it, and its prompt does not fit in the most budget admission
        can have (the step's less the decodes and the smallest chunk :meth:`plan` reserves for
        the oldest prefill). Preempting for it would free pages nobody uses."""
        s, budget = self.sched, self.sched.config.max_num_batched_tokens
        prefills = [q for q in s.running if s.remaining(q) > 1]
        if not prefills:
            return False
        oldest, reserve = prefills[0], self.chunk_reserve()
        chunked = [q for q in prefills if s.remaining(q) > (reserve if q is oldest else budget)]
        if not chunked:
            return False
        left = budget - (len(s.running) - len(prefills)) - s.step.cap(oldest, reserve, share=CHUNK_SHARE)
        return self.estimate(seq)[0] > left and not self.overtakes(seq, chunked)

    def invalidate(self, seq: Sequence) -> None:
        self._estimates.pop(seq.seq_id, None)

    def forget(self, seq: Sequence) -> None:
        self._displaced.pop(seq.seq_id, None)


POLICIES: dict[str, type[SchedulePolicy]] = {p.name: p for p in (CacheAware, FCFS)}
"""Policies by ``EngineConfig.schedule_policy`` name."""
assert tuple(POLICIES) == SCHEDULE_POLICIES, "kvtier.serve.config.SCHEDULE_POLICIES names the policies here"

__all__ = ["CHUNK_SHARE", "DECODE_AGE_FACTOR", "DEADLINE_STRETCH", "FAST_LANE_SHARE", "INLINE_LOAD_SHARE",
           "POLICIES", "CacheAware", "FCFS", "SchedulePolicy"]
