"""Continuous-batching scheduler with chunked prefill, asynchronous prefix loads and recompute
preemption; the admission order is a policy chosen by name (:mod:`kvtier.serve.admission`)."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvtier.cache.pool import KVPool, PrefixStart
from kvtier.serve.admission import POLICIES
from kvtier.serve.config import EngineConfig
from kvtier.serve.queues import Queues, mark
from kvtier.serve.request import Sequence, SequenceStatus
from kvtier.serve.stats import SchedulerStats
from kvtier.serve.step_plan import ScheduledBatch, StepPlan, cap_reuse, fit_tokens, remaining
from kvtier.serve.step_time import ResumeBound, StepTimeModel


class Scheduler:
    """Each step: running sequences (decodes, then prefill chunks as the ranking plans them),
    then waiting requests in the ranking's order, within ``max_num_batched_tokens``. The policy
    (``EngineConfig.schedule_policy``, :data:`kvtier.serve.admission.POLICIES`) is a ranking
    (:mod:`kvtier.serve.ranking`) and a preemption rule (:mod:`kvtier.serve.preemption`) that
    answer; this class is the queues' one writer. docs/scheduling.md lists each rule's place.

    Resume target (:meth:`set_resume_target`): a step that gives a request its first token, or
    that runs while a session is due back from a tool wait, is kept under
    ``RESUME_STEP_SHARE`` of the target by its estimated time
    (:func:`kvtier.serve.step_time.bound_step`).
    """

    def __init__(self, config: EngineConfig, pool: KVPool, clock: Callable[[], float] = time.perf_counter):
        self.config = config
        self.pool = pool
        self.clock = clock  # the times in each request's metrics, in its arrival_time's unit and origin
        self.queues = Queues()
        self.waiting, self.loading, self.running = self.queues.waiting, self.queues.loading, self.queues.running
        self.num_preemptions = 0
        self.policy = POLICIES[config.schedule_policy]
        self.ranking = self.policy.ranking(config, pool, self.queues)
        self.preemption = self.policy.preemption(self.ranking, config, pool, self.queues)
        self.plan = StepPlan(pool, self.policy.step_budget(config))  # the step being scheduled
        self.step_time = StepTimeModel()  # fed by the engine with every step's measured seconds
        self.resume = ResumeBound()  # the resume target, and the steps it shortened

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.loading or self.running)

    def stats(self) -> SchedulerStats:
        """Queue lengths and preemptions now, as a frozen copy (call it on the engine's thread)."""
        return SchedulerStats(len(self.waiting), len(self.loading), len(self.running), self.num_preemptions)

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: ``seq``'s pages go back to the prefix cache (its full blocks stay
        cached, or are copied down a tier when evicted), and it waits at the queue's head; when
        re-admitted it matches and loads them like any returning prompt."""
        self.running.remove(seq)
        self.pool.free(seq.kv)
        if seq.output_token_ids:
            seq.metrics.preemptions_after_first_token += 1
        else:
            seq.metrics.num_preemptions += 1
        self.ranking.invalidate(seq)
        seq.num_computed_tokens = 0
        seq.prefix_done = False
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> ScheduledBatch:
        """Pick this step's work within ``max_num_batched_tokens``."""
        self.pool.poll()
        self.queues.collect_loaded(self.pool, self.clock)
        plan = self.plan = StepPlan(self.pool, self.policy.step_budget(self.config))
        self.ranking.begin_step()
        self.preemption.begin_step()
        first = self.make_room()
        fast = self.ranking.fast_lane(self.preemption.displaced)
        tokens = self.config.max_num_batched_tokens
        tokens = self._schedule_running(tokens, self.ranking.plan(tokens, fast))
        num_loading = len(self.loading)
        tokens = self._admit_waiting(tokens, self.ranking.order(first, fast))
        for seq in self.ranking.leftover(plan.batch):  # left-over budget to running prefills
            if tokens <= 0:
                break
            tokens -= plan.grow(seq, tokens)
        self.ranking.count_passed_over(plan.batch, self.loading[num_loading:])
        self.resume.apply(plan.batch, self.step_time, self.config.pool.page_size, self.clock, self.pool.returns_within)
        return plan.batch

    def make_room(self) -> Sequence | None:
        """Preempt the victims the preemption rule names for the best-ranked request blocked on
        pages; returns that request, or None."""
        made = self.preemption.make_room(self.plan.budget)
        for victim in made[1] if made else ():
            self.preempt(victim)
        return made[0] if made else None

    def set_resume_target(self, resume_ttft_s: float | None) -> None:
        """Bound steps for a resume TTFT of ``resume_ttft_s`` seconds (None: no bound; see
        :class:`~kvtier.serve.step_time.ResumeBound`; ValueError for one not finite > 0)."""
        self.resume.set_target(resume_ttft_s)

    def _schedule_running(self, budget: int, plan: dict[int, int] | None) -> int:
        """Place running sequences in admission order; ``plan`` (None: no cap) caps each prefill
        chunk by seq_id (absent: 0). One short of pages runs the chunk the pages hold (under a
        plan), else preempts the preemption rule's ``running_victim``."""
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if seq.num_computed_tokens >= seq.num_tokens:
                # Computed but never sampled (a step was interrupted): recompute the last token.
                seq.num_computed_tokens = seq.num_tokens - 1
            n = min(remaining(seq), budget)
            if plan is not None and n > 1:
                n = min(n, plan.get(seq.seq_id, 0))
            if remaining(seq) > 1:
                n = self.plan.budget.cap(seq, n)
            if n == 0:
                continue
            while not self.pool.allocate(seq.kv, seq.num_computed_tokens + n):
                fit = fit_tokens(self.pool, seq)
                if plan is not None and n > 1 and 1 <= fit < n:
                    n = fit
                    continue
                victim = self.preemption.running_victim(seq)
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self.plan.place(seq, n)
                budget -= n
        return budget

    def _admit_waiting(self, budget: int, order: list[Sequence]) -> int:
        """Admit ``order``'s requests while budget and sequence slots last. One prefill at a time
        is chunked (a partly computed prompt holds pages): a prompt longer than the budget left
        waits unless it ranks ahead of the chunked one (two at most). One that cannot be placed
        stops the rest when the ranking holds the line (or it is aged), else it is skipped."""
        hold, plan = self.ranking.hold_line, self.plan
        chunked = [] if hold else plan.chunked(self.running)
        for seq in order:
            if budget <= 0 or len(self.running) + len(self.loading) >= self.config.max_num_seqs:
                break
            if self.preemption.deferred(seq, plan.budget):
                continue
            if chunked and self.ranking.estimate(seq)[0] > budget and not self.ranking.overtakes(seq, chunked):
                ended = plan.end_chunked(chunked, budget)
                if not ended:
                    continue
                budget -= ended
            n = self._admit(seq, budget)
            if n is None:
                if hold or self.ranking.urgent(seq):
                    break
                continue
            budget -= n
            if not hold and 0 < n and seq.num_computed_tokens + n < seq.num_tokens - 1:
                chunked.append(seq)
        return budget

    def _admit(self, seq: Sequence, budget: int) -> int | None:
        """Start ``seq``'s loads (0) or place its first chunk (its tokens); None: it cannot be
        placed now. Its loads take device pages only when all fit, unless nothing else holds
        pages (then it loads what fits and recomputes the rest)."""
        pool, queues = self.pool, self.queues
        others = bool(self.running or self.loading)  # they will free pages
        if others and queues.still_blocked(seq, pool.num_free_pages, budget):
            return None
        if not seq.prefix_done:
            start = pool.begin_prefix(seq.kv, partial=not others)
            if start is PrefixStart.NO_ROOM:
                queues.block(seq, pool.num_free_pages, 0)  # its loads need the pages whatever the budget
                return None
            if start is PrefixStart.LOADING and self.policy.inline_share:
                limit = self.plan.budget.take_inline(self.ranking.estimate(seq)[2],
                                                     pool.recompute_s(self.config.max_num_batched_tokens))
                if limit is not None:
                    # Bounded: a load slower than its estimate goes on as any other (``loading``).
                    self._mark(seq, "admitted_time")
                    began = self.clock()
                    if pool.wait_prefix(seq.kv, timeout_s=limit) is not None:
                        start = PrefixStart.READY
                    self.plan.budget.waited_inline(self.clock() - began)
            if start is PrefixStart.LOADING:
                self._mark(seq, "admitted_time")
                self.waiting.remove(seq)
                self.loading.append(seq)
                queues.unblock(seq)  # it holds pages now: when its loads end it is placed at once
                return 0
            seq.num_computed_tokens = pool.finish_prefix(seq.kv)  # READY: the prefix it placed
            seq.prefix_done = True
        cap_reuse(pool, seq)
        n = min(remaining(seq), budget)
        ok = pool.allocate(seq.kv, seq.num_computed_tokens + n)
        if not ok and seq.page_ids and not self.ranking.hold_line and fit_tokens(pool, seq) >= 1:
            # Its placed prefix holds pages: run the chunk the free pages hold rather than give
            # them back (and load or match the prefix again later).
            n = min(n, fit_tokens(pool, seq))
            ok = pool.allocate(seq.kv, seq.num_computed_tokens + n)
        if not ok:
            # No room yet: no waiting sequence keeps pages (their reused blocks stay cached,
            # loaded ones are now device copies), so waiting can never deadlock the pool.
            queues.release_waiting(pool)
            queues.block(seq, pool.num_free_pages, budget)
            return None
        self.waiting.remove(seq)
        queues.unblock(seq)
        self._mark(seq, "admitted_time")
        self._mark(seq, "loaded_time")
        if not seq.admitted:  # the first admission that runs defines what it reports as cached
            seq.admitted = True
            seq.num_cached_tokens = seq.num_computed_tokens
            seq.cached_tokens_by_tier = dict(seq.kv.prefix_tokens_by_tier)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self.plan.place(seq, n)
        return n

    def _mark(self, seq: Sequence, name: str) -> None:
        mark(seq, name, self.clock)

    def abort(self, seq: Sequence) -> None:
        """Remove ``seq`` wherever it is and free its pages."""
        self.queues.remove(seq)
        self.preemption.forget(seq)
        self.pool.free(seq.kv)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"

    def advance(self, seq: Sequence, num_tokens: int) -> None:
        """``num_tokens`` more of ``seq``'s tokens ran: its progress moves on (this scheduler is
        the one owner of ``num_computed_tokens``) and the pool indexes its newly full blocks."""
        seq.num_computed_tokens += num_tokens
        self.pool.register_computed(seq.kv)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.running.remove(seq)
        self.preemption.forget(seq)
        self.pool.free(seq.kv)


__all__ = ["Scheduler"]
