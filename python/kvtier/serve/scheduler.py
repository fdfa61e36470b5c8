"""Continuous-batching scheduler with chunked prefill, asynchronous prefix loads and recompute
preemption; the admission order is a policy chosen by name (:mod:`kvtier.serve.policy`)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from kvtier.cache.pool import KVPool, PrefixStart
from kvtier.serve.config import EngineConfig
from kvtier.serve.policy import POLICIES, SchedulePolicy
from kvtier.serve.request import Sequence, SequenceStatus
from kvtier.serve.stats import SchedulerStats
from kvtier.serve.step_budget import ScheduledBatch, StepBudget, fit_tokens, pairs
from kvtier.serve.step_time import RESUME_STEP_SHARE, StepTimeModel, batch_features


class Scheduler:
    """Each step: running sequences (decodes, then prefill chunks as the policy plans them),
    then waiting requests in the policy's order, within ``max_num_batched_tokens``.

    Policy (``EngineConfig.schedule_policy``, :data:`kvtier.serve.policy.POLICIES`): one
    ranking rule orders waiting requests and running prefills, one preemption rule says whom
    the best-ranked request blocked on pages may preempt; ``fcfs`` ranks by arrival and
    preempts nobody for others, ``cache-aware`` ranks by arrival + estimated cost to serve
    and preempts what ranks behind (or, when its blocks load back, decodes) - see
    :class:`~kvtier.serve.policy.CacheAware`. Bound: a request passed over in
    ``schedule_max_passes`` steps ranks first and is not preempted for others.

    Resume target (:meth:`set_resume_target`): a step that gives a request its first token, or
    that runs while a session is due back from a tool wait, is kept under
    ``RESUME_STEP_SHARE`` of the target by its estimated time (:meth:`bound_step`).
    """

    def __init__(self, config: EngineConfig, pool: KVPool, clock: Callable[[], float] = time.perf_counter):
        self.config = config
        self.pool = pool
        self.clock = clock  # the times in each request's metrics, in its arrival_time's unit and origin
        self.waiting: deque[Sequence] = deque()
        self.loading: list[Sequence] = []  # their prefix loads run in the background
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Requests that failed admission: the free pages then and the token budget they had; not
        # retried until pages were freed (or the budget shrank).
        self._blocked: dict[int, tuple[int, int]] = {}
        self.policy: SchedulePolicy = POLICIES[config.schedule_policy](self)
        self.step = StepBudget()
        self.step_time = StepTimeModel()  # fed by the engine with every step's measured seconds
        self.resume_ttft_s: float | None = None
        self.num_bounded_steps = 0  # steps bound_step shortened

    _pairs = staticmethod(pairs)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.loading or self.running)

    def stats(self) -> SchedulerStats:
        """Queue lengths and preemptions now, as a frozen copy (call it on the engine's thread)."""
        return SchedulerStats(len(self.waiting), len(self.loading), len(self.running), self.num_preemptions)

    @staticmethod
    def remaining(seq: Sequence) -> int:
        return seq.num_tokens - seq.num_computed_tokens

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
        self.policy.invalidate(seq)
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
            self.step.charge(seq, n)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's work within ``max_num_batched_tokens``."""
        self.pool.poll()
        self._collect_loaded()
        batch = ScheduledBatch()
        self.step = self.policy.step_budget()
        self.policy.begin_step()
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens,
                                        self.policy.plan(self.config.max_num_batched_tokens))
        num_loading = len(self.loading)
        budget = self._admit_waiting(batch, budget, self.policy.order())
        self.policy.end_step(batch, budget, self.loading[num_loading:])
        self.bound_step(batch)
        return batch

    # ---- the resume target --------------------------------------------------------------------
    def set_resume_target(self, resume_ttft_s: float | None) -> None:
        """Bound steps for a resume TTFT of ``resume_ttft_s`` seconds (None: no bound); see
        :meth:`bound_step`.

        Raises:
            ValueError: a target that is not a finite number > 0.
        """
        if resume_ttft_s is not None and not (isinstance(resume_ttft_s, (int, float)) and not isinstance(
                resume_ttft_s, bool) and 0 < resume_ttft_s < float("inf")):
            raise ValueError(f"resume_ttft_s must be a finite number of seconds > 0 or None, got {resume_ttft_s!r}")
        self.resume_ttft_s = resume_ttft_s

    def bound_step(self, batch: ScheduledBatch) -> None:
        """Shorten ``batch`` to ``RESUME_STEP_SHARE * resume_ttft_s`` seconds of estimated time
        (:class:`~kvtier.serve.step_time.StepTimeModel`) when it gives a request its first token or
        a session is due back from a tool wait (expected from ``resume_ttft_s`` ago to the step's
        end, :meth:`KVPool.returns_within`): prefill chunks are cut, the largest first, to no less
        than a page each (each keeps making progress). Never cut: decodes, and a chunk that ends its
        prompt and, in a step with the decodes alone, would fit the bound or give its request its
        first token within the target of its arrival. No target, no fit yet, or a step already
        short: unchanged."""
        target = self.resume_ttft_s
        if target is None or not batch.extends:
            return
        est = self.step_time.estimate_s(batch_features(batch))
        bound = RESUME_STEP_SHARE * target
        if est is None or est <= bound:
            return
        ends = [s.num_computed_tokens + n >= s.num_tokens for s, n in batch.extends]
        if not any(ends) and not self.pool.returns_within(target, est):
            return
        floor = self.config.pool.page_size
        decodes = batch_features(ScheduledBatch(decodes=batch.decodes)) - batch_features(ScheduledBatch())

        def alone_s(seq: Sequence, n: int) -> float:  # a step of this chunk and the decodes
            return self.step_time.estimate_s(decodes + batch_features(ScheduledBatch(extends=[(seq, n)])))

        now = self.clock()

        def kept(seq: Sequence, n: int) -> bool:  # ends its prompt within the bound, or within its target
            t = alone_s(seq, n)
            return t <= bound or (not seq.output_token_ids and now - seq.metrics.arrival_time + t <= target)

        order = sorted((i for i, ((s, n), end) in enumerate(zip(batch.extends, ends))
                        if n > floor and not (end and kept(s, n))), key=lambda i: -batch.extends[i][1])
        for i in order:
            seq, n = batch.extends[i]
            lo, hi = floor, n  # the largest chunk in [floor, n] within the bound, by bisection
            batch.extends[i] = (seq, lo)
            if self.step_time.estimate_s(batch_features(batch)) <= bound:
                while hi - lo > floor:
                    mid = lo + max(floor, (hi - lo) // 2 // floor * floor)
                    batch.extends[i] = (seq, mid)
                    if self.step_time.estimate_s(batch_features(batch)) <= bound:
                        lo = mid
                    else:
                        hi = mid
                batch.extends[i] = (seq, lo)
                break
        self.num_bounded_steps += 1

    # ---- running sequences --------------------------------------------------------------------
    def _schedule_running(self, batch: ScheduledBatch, budget: int, plan: dict[int, int] | None) -> int:
        """Place running sequences in admission order; ``plan`` (None: no cap) caps each prefill
        chunk by seq_id (absent: 0). One short of pages runs the chunk the pages hold (under a
        plan), else preempts the policy's :meth:`~SchedulePolicy.running_victim`."""
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if seq.num_computed_tokens >= seq.num_tokens:
                # Computed but never sampled (a step was interrupted): recompute the last token.
                seq.num_computed_tokens = seq.num_tokens - 1
            n = min(self.remaining(seq), budget)
            if plan is not None and n > 1:
                n = min(n, plan.get(seq.seq_id, 0))
            if self.remaining(seq) > 1:
                n = self.step.cap(seq, n)
            if n == 0:
                continue
            while not self.pool.allocate(seq.kv, seq.num_computed_tokens + n):
                fit = fit_tokens(self.pool, seq)
                if plan is not None and n > 1 and 1 <= fit < n:
                    n = fit
                    continue
                victim = self.policy.running_victim(seq)
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self._place(batch, seq, n)
                budget -= n
        return budget

    def grow_chunk(self, batch: ScheduledBatch, seq: Sequence, budget: int, exact: bool = False) -> int:
        """Add up to ``budget`` prefill tokens to running ``seq``'s chunk in ``batch`` (within its
        prompt, the attention budget and the pages; ``exact``: all ``budget`` or none); returns
        the tokens added (0: nothing changed)."""
        i = next((k for k, (q, _) in enumerate(batch.extends) if q is seq), None)
        have = 0 if i is None else batch.extends[i][1]
        extra = self.step.cap(seq, min(self.remaining(seq) - have, budget), have)
        if extra <= 0 or (exact and extra < budget):
            return 0
        if not self.pool.allocate(seq.kv, seq.num_computed_tokens + have + extra):
            return 0
        if i is None:
            self._place(batch, seq, extra)  # charges the chunk
        else:
            self.step.charge(seq, extra, have)
            batch.extends[i] = (seq, have + extra)
        return extra

    def _chunked(self, batch: ScheduledBatch) -> list[Sequence]:
        """Running sequences that will still have prompt tokens to run after this step."""
        placed = {s.seq_id: n for s, n in batch.extends}
        placed.update((s.seq_id, 1) for s in batch.decodes)
        return [s for s in self.running if s.num_computed_tokens + placed.get(s.seq_id, 0) < s.num_tokens - 1]

    def _end_chunked(self, batch: ScheduledBatch, chunked: list[Sequence], budget: int) -> int:
        """Place the rest of the prompt of the one chunked prefill now, when it fits in ``budget``
        with a token to spare, so a waiting prompt longer than the budget left can start its
        chunks beside it (the step is not left half empty). Returns the tokens placed."""
        if len(chunked) != 1:
            return 0
        seq = chunked[0]
        have = next((n for q, n in batch.extends if q is seq), 0)
        rest = self.remaining(seq) - have
        if not 0 < rest < budget:
            return 0
        placed = self.grow_chunk(batch, seq, rest, exact=True)
        if placed:
            chunked.remove(seq)
        return placed

    # ---- admission ----------------------------------------------------------------------------
    def _admit_waiting(self, batch: ScheduledBatch, budget: int, order: list[Sequence]) -> int:
        """Admit ``order``'s requests while budget and sequence slots last. One prefill at a time
        is chunked (a partly computed prompt holds pages): a prompt longer than the budget left
        waits unless it ranks ahead of the chunked one (two at most). One that cannot be placed
        stops the rest when the policy holds the line (or it is aged), else it is skipped."""
        hold = self.policy.hold_line
        chunked = [] if hold else self._chunked(batch)
        for seq in order:
            if budget <= 0 or len(self.running) + len(self.loading) >= self.config.max_num_seqs:
                break
            if self.policy.deferred(seq):
                continue
            if chunked and self.policy.estimate(seq)[0] > budget and not self.policy.overtakes(seq, chunked):
                ended = self._end_chunked(batch, chunked, budget)
                if not ended:
                    continue
                budget -= ended
            n = self._admit(batch, seq, budget)
            if n is None:
                if hold or self.policy.urgent(seq):
                    break
                continue
            budget -= n
            if not hold and 0 < n and seq.num_computed_tokens + n < seq.num_tokens - 1:
                chunked.append(seq)
        return budget

    def _admit(self, batch: ScheduledBatch, seq: Sequence, budget: int) -> int | None:
        """Start ``seq``'s loads (0) or place its first chunk (its tokens); None: it cannot be
        placed now. Its loads take device pages only when all fit, unless nothing else holds
        pages (then it loads what fits and recomputes the rest)."""
        others = bool(self.running or self.loading)  # they will free pages
        if others and self._still_blocked(seq, budget):
            return None
        if not seq.prefix_done:
            start = self.pool.begin_prefix(seq.kv, partial=not others)
            if start is PrefixStart.NO_ROOM:
                self._block(seq, 0)  # its loads need the pages whatever the budget
                return None
            limit = self.policy.load_inline(seq) if start is PrefixStart.LOADING else None
            if limit is not None:
                # Bounded: a load slower than its estimate goes on as any other (``loading``).
                self._mark(seq, "admitted_time")
                began = self.clock()
                if self.pool.wait_prefix(seq.kv, timeout_s=limit) is not None:
                    start = PrefixStart.READY
                self.step.waited_inline(self.clock() - began)
            if start is PrefixStart.LOADING:
                self._mark(seq, "admitted_time")
                self.waiting.remove(seq)
                self.loading.append(seq)
                self._blocked.pop(seq.seq_id, None)  # it holds pages now: when its loads end it is placed at once
                return 0
            seq.num_computed_tokens = self.pool.finish_prefix(seq.kv)  # READY: the prefix it placed
            seq.prefix_done = True
        self._cap_reuse(seq)
        n = min(self.remaining(seq), budget)
        ok = self.pool.allocate(seq.kv, seq.num_computed_tokens + n)
        if not ok and seq.page_ids and not self.policy.hold_line and fit_tokens(self.pool, seq) >= 1:
            # Its placed prefix holds pages: run the chunk the free pages hold rather than give
            # them back (and load or match the prefix again later).
            n = min(n, fit_tokens(self.pool, seq))
            ok = self.pool.allocate(seq.kv, seq.num_computed_tokens + n)
        if not ok:
            # No room yet: no waiting sequence keeps pages (their reused blocks stay cached,
            # loaded ones are now device copies), so waiting can never deadlock the pool.
            for w in self.waiting:
                if w.page_ids or w.prefix_done:
                    self.pool.free(w.kv)
                    w.num_computed_tokens, w.prefix_done = 0, False
            self._block(seq, budget)
            return None
        self.waiting.remove(seq)
        self._blocked.pop(seq.seq_id, None)
        self._mark(seq, "admitted_time")
        self._mark(seq, "loaded_time")
        if not seq.admitted:  # the first admission that runs defines what it reports as cached
            seq.admitted = True
            seq.num_cached_tokens = seq.num_computed_tokens
            seq.cached_tokens_by_tier = dict(seq.kv.prefix_tokens_by_tier)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._place(batch, seq, n)
        return n

    def _mark(self, seq: Sequence, name: str) -> None:
        if getattr(seq.metrics, name) is None:
            setattr(seq.metrics, name, self.clock())

    def _collect_loaded(self) -> None:
        """Move sequences whose prefix loads ended to the front of the waiting queue, in the order
        they were admitted."""
        ended = []
        for seq in self.loading:
            tokens = self.pool.finish_prefix(seq.kv)
            if tokens is not None:
                seq.num_computed_tokens = tokens
                ended.append(seq)
        for seq in reversed(ended):
            self.loading.remove(seq)
            seq.prefix_done = True
            self._mark(seq, "loaded_time")
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
            seq.num_computed_tokens = min(seq.num_computed_tokens, self.pool.truncate(seq.kv, first_missing))

    def _block(self, seq: Sequence, budget: int) -> None:
        self._blocked[seq.seq_id] = (self.pool.num_free_pages, budget)

    def _still_blocked(self, seq: Sequence, budget: int) -> bool:
        """``seq`` failed admission, no page was freed since and its chunk can be no smaller."""
        blocked = self._blocked.get(seq.seq_id)
        return blocked is not None and self.pool.num_free_pages <= blocked[0] and budget >= blocked[1]

    # ---- the engine's calls -------------------------------------------------------------------
    def abort(self, seq: Sequence) -> None:
        """Remove ``seq`` wherever it is and free its pages."""
        for queue in (self.running, self.loading):
            if seq in queue:
                queue.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._blocked.pop(seq.seq_id, None)
        self.policy.forget(seq)
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
        self.policy.forget(seq)
        self.pool.free(seq.kv)


__all__ = ["ScheduledBatch", "Scheduler"]
