"""Continuous-batching scheduler with chunked prefill, asynchronous prefix loads, preemption
(a preempted sequence's blocks load back, or are recomputed: ``EngineConfig.preemption_mode``)
and an admission watermark; the admission order is a policy chosen by name
(:mod:`kvtier.serve.admission`)."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvtier.cache.pool import KVPool, PrefixStart
from kvtier.serve.admission import POLICIES
from kvtier.serve.config import EngineConfig
from kvtier.serve.queues import Queues
from kvtier.serve.request import Sequence, SequenceStatus
from kvtier.serve.stats import SchedulerStats
from kvtier.serve.step_plan import ScheduledBatch, StepPlan, Verdict, admission_pages, remaining
from kvtier.serve.step_time import ResumeBound, StepTimeModel


class Scheduler:
    """Each step: running sequences (decodes, then prefill chunks as the ranking plans them),
    then waiting requests in the ranking's order, within ``max_num_batched_tokens``. The policy
    (``EngineConfig.schedule_policy``, :data:`kvtier.serve.admission.POLICIES`) is a ranking
    (:mod:`kvtier.serve.ranking`) and a preemption rule (:mod:`kvtier.serve.preemption`) that
    answer; the step plan (:mod:`kvtier.serve.step_plan`) places chunks and answers with a
    verdict; requests move between the queues (:mod:`kvtier.serve.queues`) by their methods, called
    from here alone. docs/scheduling.md lists each rule's place.

    Resume target (:meth:`set_resume_target`): a step that gives a request its first token, or
    that runs while a session is due back from a tool wait, is kept under
    ``RESUME_STEP_SHARE`` of the target by its estimated time
    (:func:`kvtier.serve.step_time.bound_step`).

    Watermark: while other sequences run or load, a new request is admitted only when its pages
    leave ``admission_watermark`` of the device pages free (:attr:`reserve`), the headroom the
    running sequences' next pages come from; a preempted request coming back is not held to it.
    """

    def __init__(self, config: EngineConfig, pool: KVPool, clock: Callable[[], float] = time.perf_counter):
        self.config = config
        self.pool = pool
        self.clock = clock  # the times in each request's metrics, in its arrival_time's unit and origin
        self.queues = Queues()
        self.waiting, self.loading, self.running = self.queues.waiting, self.queues.loading, self.queues.running
        self.policy = POLICIES[config.schedule_policy]
        self.step_time = StepTimeModel()  # fed by the engine with every step's measured seconds
        # device pages a new request leaves free while others run (the admission watermark;
        # rounded down, as vLLM's block manager does: a pool of a few pages keeps none)
        self.reserve = int(config.admission_watermark * pool.config.num_device_pages)
        self.ranking = self.policy.ranking(config, pool, self.queues)
        self.preemption = self.policy.preemption(self.ranking, config, pool, self.queues, self.step_time, self.reserve)
        # The step being scheduled.
        self.plan = StepPlan(pool, config.max_num_batched_tokens, self.policy.step_budget(config))
        self.resume = ResumeBound()  # the resume target, and the steps it shortened

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.loading or self.running)

    def stats(self) -> SchedulerStats:
        """Queue lengths and preemptions now, as a frozen copy (call it on the engine's thread)."""
        return SchedulerStats(len(self.waiting), len(self.loading), len(self.running), self.num_preemptions)

    @property
    def num_preemptions(self) -> int:
        """Preemptions since the scheduler started."""
        return self.queues.num_preemptions

    def set_resume_target(self, resume_ttft_s: float | None) -> None:
        """Bound steps for a resume TTFT of ``resume_ttft_s`` seconds (None: no bound; see
        :class:`~kvtier.serve.step_time.ResumeBound`; ValueError for one not finite > 0)."""
        self.resume.set_target(resume_ttft_s)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's work within ``max_num_batched_tokens``: one pass down the rules of
        docs/scheduling.md. The objects it calls answer (the ranking, the preemption rule, the step
        plan's verdicts) or move a request between queues; none calls back into this
        class."""
        self.pool.poll()
        self.queues.collect_loaded(self.pool, self.clock)
        config = self.config
        plan = self.plan = StepPlan(self.pool, config.max_num_batched_tokens, self.policy.step_budget(config))
        self.ranking.begin_step()
        self.preemption.begin_step()
        made = self.preemption.make_room(plan.budget)  # (the best-ranked request blocked on pages, victims)
        for victim in made[1] if made else ():
            self.queues.preempt(victim, self.pool, self.clock())
        fast = self.ranking.fast_lane(self.preemption.displaced)
        caps = self.ranking.plan(plan.tokens_left, fast)

        # Running sequences in admission order; one short of pages runs the chunk the pages hold
        # (under a chunk plan), else preempts the preemption rule's victim (itself included).
        for seq in list(self.queues.running):
            if plan.tokens_left <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if seq.num_computed_tokens >= seq.num_tokens:
                # Computed but never sampled (a step was interrupted): recompute the last token.
                seq.num_computed_tokens = seq.num_tokens - 1
            while plan.add(seq, plan.chunk(seq, caps), shrink=caps is not None) is Verdict.NO_PAGES:
                victim = self.preemption.running_victim(seq)
                self.queues.preempt(victim, self.pool, self.clock())
                if victim is seq:
                    break

        # Waiting requests in the ranking's order, while budget and sequence slots last. One
        # prefill at a time is chunked: a prompt longer than the budget left waits unless it
        # ranks ahead of the chunked one (two at most). One that cannot be placed stops the rest
        # when the ranking holds the line (or it is aged), else it is skipped.
        num_loading, hold = len(self.queues.loading), self.ranking.hold_line
        chunked = [] if hold else plan.chunked(self.queues.running)
        for seq in self.ranking.order(made[0] if made else None, fast):
            if plan.tokens_left <= 0 or len(self.queues.running) + len(self.queues.loading) >= config.max_num_seqs:
                break
            if self.preemption.deferred(seq, plan.budget):
                continue
            if (chunked and self.ranking.estimate(seq)[0] > plan.tokens_left
                    and not self.ranking.overtakes(seq, chunked) and not plan.end_chunked(chunked)):
                continue
            others = bool(self.queues.running or self.queues.loading)  # they will free pages
            if others and self.queues.still_blocked(seq, self.pool.num_free_pages, plan.tokens_left):
                verdict = Verdict.NO_PAGES
            elif others and self.under_watermark(seq, plan.tokens_left):
                self.queues.block(seq, self.pool.num_free_pages, plan.tokens_left)
                verdict = Verdict.NO_PAGES
            else:
                # Its loads take device pages only when all fit, unless nothing else holds pages
                # (then it loads what fits and recomputes the rest).
                start = plan.start_prefix(seq, not others, self.clock,
                                          self.ranking.estimate if self.policy.inline_share else None)
                if start is PrefixStart.LOADING:
                    self.queues.start_loading(seq, self.clock)
                    continue
                if start is PrefixStart.NO_ROOM:
                    self.queues.block(seq, self.pool.num_free_pages, 0)  # its loads need the pages whatever the budget
                    verdict = Verdict.NO_PAGES
                else:
                    # A placed prefix holding pages runs the chunk the free pages hold rather than
                    # give them back (and load or match the prefix again later).
                    verdict = plan.add(seq, min(remaining(seq), plan.tokens_left),
                                       shrink=bool(seq.page_ids) and not hold)
                    if verdict is Verdict.NO_PAGES:
                        # No waiting sequence keeps pages, so waiting can never deadlock the pool.
                        self.queues.release_waiting(self.pool)
                        self.queues.block(seq, self.pool.num_free_pages, plan.tokens_left)
            if verdict is Verdict.PLACED:
                self.queues.start_running(seq, self.clock)
                if not hold:
                    chunked += plan.chunked([seq])
            elif hold or self.ranking.urgent(seq):
                break

        for seq in self.ranking.leftover(plan.batch):  # left-over budget to running prefills
            if plan.tokens_left <= 0:
                break
            plan.grow(seq, plan.tokens_left)
        self.ranking.count_passed_over(plan.batch, self.queues.loading[num_loading:])
        self.resume.apply(plan.batch, self.step_time, config.pool.page_size, self.clock, self.pool.returns_within)
        return plan.batch

    def under_watermark(self, seq: Sequence, tokens_left: int) -> bool:
        """Whether admitting waiting ``seq`` (a new request: holding no pages, not preempted)
        would leave fewer than :attr:`reserve` device pages free."""
        if not self.reserve or seq.page_ids or seq.prefix_done or self.ranking.resuming(seq):
            return False
        need = admission_pages(self.pool, seq, self.ranking.estimate(seq)[0], tokens_left)
        return self.pool.num_free_pages - need < self.reserve

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
        self.queues.finish(seq)
        self.preemption.forget(seq)
        self.pool.free(seq.kv)


__all__ = ["Scheduler"]
