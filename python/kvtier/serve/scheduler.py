"""Continuous-batching scheduler with chunked prefill, asynchronous prefix loads, recompute
preemption and cache-aware admission."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
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


DEADLINE_STRETCH = 1.0
"""Cache-aware rank: a request's deadline is its arrival plus this many times its estimated
cost to serve, so a cheap request goes ahead of a costly one that arrived up to (this times)
the difference in cost before it, and a costly one is not passed over by later arrivals for
longer than about its own cost."""
CHUNK_SHARE = 0.5
"""Share of each step's token budget the chunked prefill gets at least, whatever ranks ahead."""
DECODE_AGE_FACTOR = 4
"""A sequence past its first token (its TTFT is made) is aged after this many times
``schedule_max_passes`` steps passed over, preemptions included: when the pool keeps evicted
blocks below the device, requests waiting for their first token may preempt it that often."""
FAST_LANE_SHARE = 1 / 16
"""Cache-aware: share of each step's token budget kept for requests waiting for their first
token that need at most that many prefill tokens after their cached prefix (a returning turn),
as estimated when the step is scheduled: they are admitted ahead of the ranked order (after
aged requests, those whose prefix is placed and the one preemptions just made room for),
beside a long cold prefill whatever its deadline, so their first token comes in that step
unless their prefix loads in the background. Running prefills are planned this much less; a
steady stream of them takes about this share of a step from the others."""
INLINE_LOAD_SHARE = 0.1
"""Cache-aware: prefix loads the cost model puts under this share of a full step's estimated
time (``recompute_s(max_num_batched_tokens)``), all of them together in one step, are waited
for at admission, so the request runs in the step it was admitted in rather than the next (a
step on a long context takes a few hundred milliseconds on a CPU; a host load of a short prompt takes
milliseconds)."""


class Scheduler:
    """Running sequences first (decodes, then prefill chunks), then admissions.

    Admission order (``EngineConfig.schedule_policy``):

    * ``cache-aware`` (default): every step, unfinished prefills and waiting requests are ranked
      by their estimated cost to serve, ``load_s + recompute_s(tokens to prefill)`` from the
      pool's cost model (:meth:`KVPool.estimate_prefix`), as a deadline: arrival plus
      ``DEADLINE_STRETCH`` times that cost, earliest first, so a returning turn whose prefix is
      cached is placed ahead of, or in the same step as, a long cold prefill, and a long prefill
      is not passed over for much longer than its own cost. As in SGLang's mixed chunked
      prefill, one prefill at a time runs in chunks (a request whose prompt does not fit in
      what is left of the step's budget waits while another is chunked: a partly computed
      prompt holds pages; one that ranks ahead of the chunked one starts chunking beside it,
      so a shorter prompt does not wait for a long cold one to end, but never a third), beside
      any number of prefills that end in the step; the chunked one
      gets at least ``CHUNK_SHARE`` of every step's budget, the others what they need, and it
      whatever they leave. Requests waiting for their first token with at most
      :data:`FAST_LANE_SHARE` of the budget to prefill after their cached prefix are admitted
      ahead of the ranked order (after aged ones, those whose prefix is placed and the one
      preemptions just made room for), within that share; running prefills are planned that
      much less. Requests past their first token (preempted after it) rank after
      those still waiting for one. A
      request that cannot be placed now (its loads need more free pages than there are, or its
      first chunk does not fit) is skipped, not waited on; when it is the best-ranked such
      request (and not one that would wait behind the chunked prefill anyway), running
      prefills ranked behind it are preempted if their pages let it in, and
      so, for a request still waiting for its first token (or aged) when the pool keeps
      evicted blocks in a lower tier, are running
      sequences past their first token, then other prefills (their blocks load back; see
      :meth:`_victims`); a preempted sequence is not re-admitted while the request it made
      room for waits or loads (unless it is aged, or that request now waits behind the chunked
      prefill). Admission tries aged requests first, then
      those whose prefix is placed (their loads ended: they hold its pages), then the rest in
      rank order; one whose placed prefix leaves too few free pages for its first chunk runs
      the chunk the free pages hold instead of giving its pages back. A prefix load estimated
      under :data:`INLINE_LOAD_SHARE` of a step is waited for at admission (the request runs in
      that step). Step bounds: when ``EngineConfig.max_num_batched_pairs`` is set (default:
      not), the chunks of running prefills are cut so that the step's attention work, the
      query-key pairs of its prefill chunks, stays within it (a request's first chunk is
      counted, not cut); a
      running prefill short of pages runs the chunk the free pages hold, and when none is free
      preempts the worst-ranked of itself and the sequences after it, prefills that end within a
      step last (:meth:`_running_victim`); a prefill that ends within a step is never preempted
      to let another request in.
      Aging bounds how long a request can be skipped: a request passed over in
      ``schedule_max_passes`` steps (a step in which a later arrival got prefill tokens and it
      got none; a preemption counts as one) ranks ahead of every request that was not, in
      arrival order, and is not preempted to let others in (nor is one that a preemption would
      age, so a sequence is preempted to let others in fewer than ``schedule_max_passes`` times
      before its first token, and fewer than ``DECODE_AGE_FACTOR`` times as many after it: the
      count restarts at the first token); such a request that cannot be placed stops admission
      behind it until pages are freed. The bound does not cover :meth:`_running_victim`: a
      running prefill with no free page for its chunk preempts the worst-ranked of itself and
      the sequences after it, aged or not.
    * ``fcfs``: unfinished prefills in admission order, then waiting requests in arrival order;
      the first that cannot be placed holds the ones behind it.

    An admitted sequence first gets its cached prefix from the pool; the pool's cost model
    decides how much of it to load from the tiers holding it rather than recompute. While blocks
    load from a lower tier the sequence waits in ``loading`` and the batch goes on without it;
    when they ended it is ranked again (cheaply: only its remaining tokens). Its loads take
    device pages only when all of them fit, unless nothing else holds pages, when it loads what
    fits and recomputes the rest. A request that failed admission is not retried until pages
    were freed (or its chunk budget shrank). When pages run out, the most recently admitted
    running sequence is preempted: its pages are released into the prefix cache, so its full
    blocks are offloaded rather than lost (an evicted page is copied to the host tier when there
    is one: at once under write-through, at eviction under write-back). When it is re-admitted
    it matches them like any returning prompt and loads them back; its last, partial block, and
    whatever no tier kept or the cost model chose not to load, are recomputed.

    ``clock`` gives the times recorded in each request's metrics (``admitted_time``,
    ``loaded_time``), in the same unit and origin as its ``arrival_time``.
    """

    def __init__(self, config: EngineConfig, pool: KVPool, clock: Callable[[], float] = time.perf_counter):
        self.config = config
        self.pool = pool
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.loading: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Requests that failed admission: the free pages then and the token budget they had.
        self._blocked: dict[int, tuple[int, int]] = {}
        self._estimates: dict[int, tuple[int, float]] = {}  # this step's cost estimates by seq_id
        self._aging_restarted: set[int] = set()  # running sequences whose aging restarted at their first token
        # Sequences preempted to make room, by seq_id: the request they made room for. They are
        # not re-admitted while it waits (or loads), unless they are aged.
        self._displaced: dict[int, Sequence] = {}
        self._pairs_budget: int | None = None  # this step's attention budget (None: none)
        self._pairs_left: int | None = None
        self._inline_left = 0.0  # this step's share left for inline loads

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.loading or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.free(seq.kv)
        if seq.output_token_ids:
            seq.metrics.preemptions_after_first_token += 1
        else:
            seq.metrics.num_preemptions += 1
        self._estimates.pop(seq.seq_id, None)
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
            self._charge(seq, n)

    @staticmethod
    def _remaining(seq: Sequence) -> int:
        return seq.num_tokens - seq.num_computed_tokens

    def _ends_soon(self, seq: Sequence) -> bool:
        """Whether ``seq`` is a prefill whose prompt can end within one step's token budget."""
        return 1 < self._remaining(seq) <= self.config.max_num_batched_tokens

    def _fit_pages(self, seq: Sequence) -> int:
        """Tokens ``seq`` can run with the pages it holds and the free ones."""
        return (len(seq.page_ids) + self.pool.num_free_pages) * self.pool.config.page_size - seq.num_computed_tokens

    @staticmethod
    def _pairs(context: int, n: int) -> int:
        """Query-key pairs of a causal chunk of ``n`` tokens after ``context`` tokens:
        ``n * context + n * (n + 1) / 2`` (each token attends to the context and to itself and
        the chunk's tokens before it)."""
        return n * context + n * (n + 1) // 2

    def _pair_cap(self, seq: Sequence, n: int, have: int = 0, share: float = 1.0) -> int:
        """``n`` prefill tokens of ``seq`` (``have`` of them already placed this step) cut so
        the step's attention work stays within ``max_num_batched_pairs``, of which this chunk
        takes at most ``share``: the largest ``m`` with ``_pairs(context, m) <= pairs left``,
        from the quadratic formula; a step's first chunk gets at least one token."""
        if self._pairs_left is None:
            return n
        c = seq.num_computed_tokens + have
        b = 2 * c + 1
        left = min(self._pairs_left, int(share * self._pairs_budget))
        m = int((math.isqrt(b * b + 8 * max(left, 0)) - b) // 2)
        if m < 1 and self._pairs_left == self._pairs_budget:
            m = 1
        return max(0, min(n, m))

    def _charge(self, seq: Sequence, n: int, have: int = 0) -> None:
        """Count a placed prefill chunk's attention work against the step's budget."""
        if self._pairs_left is not None:
            self._pairs_left -= self._pairs(seq.num_computed_tokens + have, n)

    def _schedule_running(self, batch: ScheduledBatch, budget: int, plan: dict[int, int] | None) -> int:
        """Place running sequences in admission order; ``plan`` (None: no cap) caps each prefill
        chunk (a sequence with more than one token to run) by its seq_id, 0 when absent. When it
        plans more than one prefill, each takes at most ``CHUNK_SHARE`` of the step's attention
        budget here (what is left goes to them cheapest first in :meth:`_top_up`)."""
        share = CHUNK_SHARE if plan is not None and sum(v > 0 for v in plan.values()) > 1 else 1.0
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if seq.num_computed_tokens >= seq.num_tokens:
                # Computed but never sampled (a step was interrupted): recompute the last token.
                seq.num_computed_tokens = seq.num_tokens - 1
            n = min(self._remaining(seq), budget)
            if plan is not None and n > 1:
                n = min(n, plan.get(seq.seq_id, 0))
                if n == 0:
                    continue
            if self._remaining(seq) > 1:
                n = self._pair_cap(seq, n, share=share)
                if n == 0:
                    continue
            while not self.pool.allocate(seq.kv, seq.num_computed_tokens + n):
                if plan is None:
                    victim = self.running[-1]  # fcfs: the last admitted
                else:
                    fit = self._fit_pages(seq)
                    if n > 1 and 1 <= fit < n:  # a prefill runs the chunk the pages hold
                        n = fit
                        continue
                    victim = self._running_victim(seq)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self._place(batch, seq, n)
                budget -= n
        return budget

    def _running_victim(self, seq: Sequence) -> Sequence:
        """Cache-aware: whom ``seq``, a running sequence short of pages for its chunk (or
        token), preempts: of itself and the running sequences not yet placed this step, the
        worst-ranked (:meth:`_key`), prefills whose prompt can end in this step last (the most
        recently admitted, as fcfs takes, is often a cached turn a step from its first token)."""
        later = self.running[self.running.index(seq):]
        return max(later, key=lambda s: (not self._ends_soon(s), self._key(s)))

    # ---- cache-aware ranking ------------------------------------------------------------------
    def _estimate(self, seq: Sequence) -> tuple[int, float, float]:
        """``(tokens to prefill, estimated seconds to serve its prompt, of which its loads)``,
        memoised per step."""
        got = self._estimates.get(seq.seq_id)
        if got is None:
            reused, load_s = 0, 0.0
            if seq.status is SequenceStatus.WAITING and not seq.prefix_done and not seq.page_ids:
                reused, load_s = self.pool.estimate_prefix(seq.kv)
            tokens = max(1, self._remaining(seq) - reused)
            got = self._estimates[seq.seq_id] = (tokens, load_s + self.pool.cost_model.recompute_s(tokens), load_s)
        return got

    def _urgent(self, seq: Sequence) -> bool:
        return self.config.schedule_policy != "fcfs" and seq.num_passed_over >= self._age_limit(seq)

    def _age_limit(self, seq: Sequence) -> int:
        """Steps passed over after which ``seq`` is aged (see :data:`DECODE_AGE_FACTOR`)."""
        return self.config.schedule_max_passes * (DECODE_AGE_FACTOR if seq.output_token_ids else 1)

    @staticmethod
    def _arrival(seq: Sequence) -> tuple[float, int]:
        return seq.metrics.arrival_time, seq.seq_id

    def _key(self, seq: Sequence) -> tuple:
        """Rank key: aged requests first, by arrival; then requests still waiting for their first
        token, then those past it (preempted after it: their TTFT is made), each by deadline,
        arrival plus ``DEADLINE_STRETCH`` times the estimated cost to serve (seconds)."""
        arrival, seq_id = self._arrival(seq)
        if self._urgent(seq):
            return 0, arrival, seq_id
        return 1 + bool(seq.output_token_ids), arrival + DEADLINE_STRETCH * self._estimate(seq)[1], seq_id

    def _ranked(self, seqs: list[Sequence]) -> list[Sequence]:
        """``seqs`` in cache-aware order (see :meth:`_key`)."""
        return sorted(seqs, key=self._key)

    def _fast_lane(self) -> dict[int, int]:
        """The waiting requests admitted ahead of the ranked order (see :data:`FAST_LANE_SHARE`):
        ``{seq_id: tokens to prefill}``, in rank order, each one whose tokens fit in what is left
        of the lane (first fit)."""
        left = int(self.config.max_num_batched_tokens * FAST_LANE_SHARE)
        fast = {}
        for seq in self._ranked([s for s in self.waiting if not s.output_token_ids
                                 and s.seq_id not in self._displaced and not self._urgent(s)]):
            n = self._estimate(seq)[0]
            if n <= left:
                fast[seq.seq_id] = n
                left -= n
        return fast

    def _plan(self, budget: int, fast: dict[int, int]) -> dict[int, int]:
        """Prefill tokens each running prefill may take this step: the oldest (the chunked one)
        at least ``CHUNK_SHARE`` of the step's budget, the others, in rank order with the waiting
        requests outside the fast lane (``fast``, from :meth:`_fast_lane`), what they need, after
        the lane's tokens; budget left after admission goes to them in :meth:`_top_up`."""
        prefills = [s for s in self.running if self._remaining(s) > 1]
        left = budget - (len(self.running) - len(prefills))
        if not prefills or left <= 0:
            return {}
        oldest = prefills[0]
        reserve = min(self._remaining(oldest), self._chunk_reserve(), left)
        plan = {oldest.seq_id: reserve}
        left -= reserve + sum(fast.values())
        for seq in self._ranked(prefills[1:] + [s for s in self.waiting if s.seq_id not in fast]):
            if left <= 0:
                break
            give = min(max(self._estimate(seq)[0] - plan.get(seq.seq_id, 0), 0), left)
            if seq.status is SequenceStatus.RUNNING:
                plan[seq.seq_id] = plan.get(seq.seq_id, 0) + give
            left -= give
        return plan

    def _top_up(self, batch: ScheduledBatch, budget: int) -> None:
        """Give budget no admission took to running prefills, cheapest first, without preempting."""
        placed = {s.seq_id: i for i, (s, _) in enumerate(batch.extends)}
        decoding = {s.seq_id for s in batch.decodes}
        for seq in self._ranked([s for s in self.running if s.seq_id not in decoding]):
            if budget <= 0:
                break
            i = placed.get(seq.seq_id)
            have = 0 if i is None else batch.extends[i][1]
            extra = self._pair_cap(seq, min(self._remaining(seq) - have, budget), have)
            if extra <= 0 or not self._grow_chunk(batch, seq, i, have, extra):
                continue
            budget -= extra

    def _age(self, batch: ScheduledBatch, started_loading: list[Sequence]) -> None:
        """Count a step passed over for each request that got no prefill tokens while a later
        arrival got some (or started its loads)."""
        served = [s for s, _ in batch.extends] + started_loading
        if not served:
            return
        latest = max(self._arrival(s) for s in served)
        got = {s.seq_id for s in served} | {s.seq_id for s in batch.decodes}
        for seq in [*self.waiting, *self.running]:
            if seq.seq_id not in got and self._arrival(seq) < latest:
                seq.num_passed_over += 1

    def _make_room(self) -> Sequence | None:
        """Preempt running sequences to let in the best-ranked request blocked on pages, when
        their pages together let it in (vLLM's priority scheduling preempts the same way); see
        :meth:`_victims` for which. Each preemption counts as a step passed over, so aging
        bounds how often one request is preempted. Returns the request room was made for (None:
        no preemption), which admission then tries before the fast lane."""
        self._restart_aging()
        blocked = [s for s in self.waiting if s.seq_id in self._blocked and not self._waits_for_chunk(s)]
        if not blocked:
            return None
        head = self._ranked(blocked)[0]
        if head.page_ids:
            return None
        tokens = self._estimate(head)[0]  # its reused prefix and first chunk need pages
        need = self.pool.num_pages_needed(head.kv, head.num_tokens - tokens + min(tokens, self.config.max_num_batched_tokens))
        if self.pool.num_free_pages >= need:
            return None
        chosen = self._victims(head, need - self.pool.num_free_pages)
        for v in chosen or ():
            self._preempt(v)
            v.num_passed_over += 1
            self._displaced[v.seq_id] = head
        return head if chosen else None

    def _waits_for_chunk(self, seq: Sequence) -> bool:
        """Whether waiting ``seq`` would wait this step behind the one chunked prefill whatever
        pages were freed (see :meth:`_admit_waiting`): a running prefill will still have prompt
        tokens left when admission runs, ``seq`` does not overtake it, and ``seq``'s prompt does
        not fit in the most budget admission can have, the step's less the decodes and the chunk
        :meth:`_plan` reserves for the oldest prefill (cut by the attention budget as
        :meth:`_schedule_running` may cut it, with ``CHUNK_SHARE`` of it: the smallest chunk,
        so the most budget left). Preempting for it would free pages nobody uses while the
        preempted wait for it."""
        budget = self.config.max_num_batched_tokens
        prefills = [s for s in self.running if self._remaining(s) > 1]
        if not prefills:
            return False
        oldest, reserve = prefills[0], self._chunk_reserve()
        chunked = [s for s in prefills if self._remaining(s) > (reserve if s is oldest else budget)]
        if not chunked:
            return False
        left = budget - (len(self.running) - len(prefills)) - self._pair_cap(oldest, reserve, share=CHUNK_SHARE)
        return self._estimate(seq)[0] > left and not self._overtakes(seq, chunked)

    def _chunk_reserve(self) -> int:
        """Prefill tokens the oldest running prefill is planned at least, when it has that many
        left (see :meth:`_plan`)."""
        return max(1, int(self.config.max_num_batched_tokens * CHUNK_SHARE))

    def _restart_aging(self) -> None:
        """A request's first token ends the wait aging bounds (its TTFT): its count of steps
        passed over starts again from 0, once, so that a request that waited long before it is
        not spared for the rest of its decode; from then on it is passed over (preemptions
        included) in at most ``DECODE_AGE_FACTOR * schedule_max_passes`` steps before it is aged
        again."""
        for seq in self.running:
            if seq.output_token_ids and seq.seq_id not in self._aging_restarted:
                self._aging_restarted.add(seq.seq_id)
                seq.num_passed_over = 0

    def _victims(self, head: Sequence, short: int) -> list[Sequence] | None:
        """Running sequences whose pages (those no other sequence shares) free at least
        ``short`` for ``head``, or None when all candidates together do not.

        Candidates, in the order they are taken: prefills that rank behind ``head``, most
        expensive first; then, when ``head`` waits for its first token or is aged (a request
        preempted before its first token, or aged, is not left behind decodes that may run for
        seconds; an aged one that cannot be placed holds admission) and the pool keeps evicted
        blocks in a lower tier
        (:attr:`KVPool.keeps_evicted_blocks`), so that whatever is preempted loads its computed
        blocks back when it is re-admitted: sequences past their first token, those with the
        most tokens left to decode first (their TTFT is made: a request waiting for its first
        token goes before another's next token, as the tail of TTFT is what agents wait on),
        then the other prefills, last-ranked first (a cached turn does not wait for a long cold
        prefill to end; it delays that prefill by about its own short service).

        A sequence the preemption would age (passed over in ``_age_limit`` steps, counting this
        one) is never taken: aged, it would rank first and take its pages back at once; so a
        sequence is preempted for others fewer than ``schedule_max_passes`` times before its
        first token, and fewer than ``DECODE_AGE_FACTOR`` times that after it.
        """
        key = self._key(head)
        spared = lambda s: s.num_passed_over + 1 >= self._age_limit(s) or self._ends_soon(s)  # noqa: E731
        left = lambda s: s.params.max_tokens - len(s.output_token_ids)  # noqa: E731
        candidates = sorted((s for s in self.running if self._remaining(s) > 1 and not spared(s)
                             and self._key(s) > key), key=self._key, reverse=True)
        if self._displaces_running(head):
            taken = {s.seq_id for s in candidates}
            candidates += sorted((s for s in self.running if s.output_token_ids and not spared(s)
                                  and s.seq_id not in taken),
                                 key=left, reverse=True)
            taken |= {s.seq_id for s in candidates}
            candidates += sorted((s for s in self.running if self._remaining(s) > 1 and not spared(s)
                                  and s.seq_id not in taken), key=self._key, reverse=True)
        chosen, freed = [], 0
        for v in candidates:
            if freed >= short:
                break
            chosen.append(v)
            freed += sum(self.pool.ref_counts[p] == 1 for p in v.page_ids)
        return chosen if freed >= short else None

    def _displaces_running(self, head: Sequence) -> bool:
        """Whether ``head`` may preempt sequences past their first token and prefills that rank
        ahead of it (see :meth:`_victims`): it waits for its first token, or is aged, and the
        preempted load their blocks back."""
        return (not head.output_token_ids or self._urgent(head)) and self.pool.keeps_evicted_blocks

    # ---- admission ----------------------------------------------------------------------------
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

    @staticmethod
    def _record_admission(seq: Sequence) -> None:
        """The first admission that runs defines what the request reports as cached."""
        if not seq.admitted:
            seq.admitted = True
            seq.num_cached_tokens = seq.num_computed_tokens
            seq.cached_tokens_by_tier = dict(seq.kv.prefix_tokens_by_tier)

    def _admit_waiting(self, batch: ScheduledBatch, budget: int, order: list[Sequence], hold_line: bool) -> int:
        """Admit ``order``'s waiting requests while budget and sequence slots last; one that cannot
        be placed stops the rest when ``hold_line`` (or it is aged), else it is skipped."""
        chunked = [] if hold_line else self._chunked(batch)
        for seq in order:
            if budget <= 0 or len(self.running) + len(self.loading) >= self.config.max_num_seqs:
                break
            head = self._displaced.get(seq.seq_id)
            if head is not None and not self._urgent(seq) and not self._waits_for_chunk(head):
                continue  # preempted to make room: the request it made room for goes first
            if chunked and self._estimate(seq)[0] > budget and not self._overtakes(seq, chunked):
                ended = self._end_chunked(batch, chunked, budget)
                if not ended:
                    continue  # one chunked prefill at a time: it would hold pages while it waits for budget
                budget -= ended
            n = self._admit(batch, seq, budget)
            if n is None:
                if hold_line or self._urgent(seq):
                    break
                continue
            budget -= n
            if not hold_line and 0 < n and seq.num_computed_tokens + n < seq.num_tokens - 1:
                chunked.append(seq)
        return budget

    def _end_chunked(self, batch: ScheduledBatch, chunked: list[Sequence], budget: int) -> int:
        """Place the rest of the prompt of the one chunked prefill now, when it fits in ``budget``
        with a token to spare (its pages and attention budget too), so a waiting prompt longer
        than the budget left can start its chunks beside it: the planned chunk of the oldest
        prefill is only ``CHUNK_SHARE`` of the step, :meth:`_top_up` would give it the rest
        anyway, and refusing every prompt longer than what is left ran the last chunk of each
        long prompt in a half-empty step. Returns the tokens placed (0: nothing changed)."""
        if len(chunked) != 1:
            return 0
        seq = chunked[0]
        i = next((k for k, (s, _) in enumerate(batch.extends) if s is seq), None)
        have = 0 if i is None else batch.extends[i][1]
        rest = self._remaining(seq) - have
        if not 0 < rest < budget or self._pair_cap(seq, rest, have) < rest:
            return 0
        if not self._grow_chunk(batch, seq, i, have, rest):
            return 0
        chunked.remove(seq)
        return rest

    def _grow_chunk(self, batch: ScheduledBatch, seq: Sequence, i: int | None, have: int, extra: int) -> bool:
        """Add ``extra`` prefill tokens to running ``seq``'s chunk in ``batch`` (``batch.extends[i]``
        holding ``have`` tokens; ``i`` None: no chunk yet), with their pages and attention work;
        False (nothing changed) when its pages do not fit."""
        if not self.pool.allocate(seq.kv, seq.num_computed_tokens + have + extra):
            return False
        if i is None:
            self._place(batch, seq, extra)  # charges the chunk
        else:
            self._charge(seq, extra, have)
            batch.extends[i] = (seq, have + extra)
        return True

    def _overtakes(self, seq: Sequence, chunked: list[Sequence]) -> bool:
        """Whether waiting ``seq``, whose prompt does not fit in the step's budget left, starts
        chunking beside the one prefill being chunked: when it ranks ahead of it (a shorter
        prompt, or a cached one, would otherwise wait for a long cold prompt to end)."""
        return len(chunked) == 1 and self._key(seq) < self._key(chunked[0])

    def _chunked(self, batch: ScheduledBatch) -> list[Sequence]:
        """Running sequences that will still have prompt tokens to run after this step."""
        placed = {s.seq_id: n for s, n in batch.extends}
        placed.update((s.seq_id, 1) for s in batch.decodes)
        return [s for s in self.running if s.num_computed_tokens + placed.get(s.seq_id, 0) < s.num_tokens - 1]

    def _admit(self, batch: ScheduledBatch, seq: Sequence, budget: int) -> int | None:
        """Start ``seq``'s loads (0) or place its first chunk (its tokens); None: it cannot be
        placed now."""
        others = bool(self.running or self.loading)  # they will free pages
        if others and self._still_blocked(seq, budget):
            return None
        if not seq.prefix_done:
            start = self.pool.begin_prefix(seq.kv, partial=not others)
            if start is PrefixStart.NO_ROOM:
                self._block(seq, 0)  # its loads need the pages whatever the budget
                return None
            if start is PrefixStart.LOADING and self.config.schedule_policy != "fcfs" and self._load_inline(seq):
                self._mark(seq, "admitted_time")
                self.pool.wait_prefix(seq.kv)
                start = PrefixStart.READY
            if start is PrefixStart.LOADING:
                self._mark(seq, "admitted_time")
                self.waiting.remove(seq)
                self.loading.append(seq)
                self._blocked.pop(seq.seq_id, None)  # it holds pages now: when its loads end it is placed at once
                return 0
            seq.num_computed_tokens = self.pool.finish_prefix(seq.kv)  # READY: the prefix it placed
            seq.prefix_done = True
        self._cap_reuse(seq)
        n = min(self._remaining(seq), budget)
        ok = self.pool.allocate(seq.kv, seq.num_computed_tokens + n)
        if not ok and seq.page_ids and self.config.schedule_policy != "fcfs":
            # Its placed prefix holds pages: run the chunk the free pages hold rather than give
            # them back (and load or match the prefix again later).
            fit = self._fit_pages(seq)
            if fit >= 1:
                n = min(n, fit)
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
        self._record_admission(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._place(batch, seq, n)
        return n

    def _load_inline(self, seq: Sequence) -> bool:
        """Whether to wait for ``seq``'s prefix loads now (see :data:`INLINE_LOAD_SHARE`); takes
        their estimated time from this step's share."""
        load_s = self._estimate(seq)[2]
        step_s = self.pool.cost_model.recompute_s(self.config.max_num_batched_tokens)
        if load_s > self._inline_left * step_s:
            return False
        self._inline_left -= load_s / step_s
        return True

    def _block(self, seq: Sequence, budget: int) -> None:
        self._blocked[seq.seq_id] = (self.pool.num_free_pages, budget)

    def _still_blocked(self, seq: Sequence, budget: int) -> bool:
        """``seq`` failed admission, no page was freed since and its chunk can be no smaller:
        retrying would fail again."""
        blocked = self._blocked.get(seq.seq_id)
        return blocked is not None and self.pool.num_free_pages <= blocked[0] and budget >= blocked[1]

    def schedule(self) -> ScheduledBatch:
        """Pick this step's work within ``max_num_batched_tokens``."""
        self.pool.poll()
        self._collect_loaded()
        self._estimates = {}
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        self._pairs_budget = self._pairs_left = None
        self._inline_left = INLINE_LOAD_SHARE
        if self.config.schedule_policy == "fcfs":
            budget = self._schedule_running(batch, budget, None)
            self._admit_waiting(batch, budget, list(self.waiting), hold_line=True)
            return batch
        self._pairs_budget = self._pairs_left = self.config.max_num_batched_pairs
        self._displaced = {i: h for i, h in self._displaced.items() if h.status is SequenceStatus.WAITING}
        made_room_for = self._make_room()
        fast = self._fast_lane()
        budget = self._schedule_running(batch, budget, self._plan(budget, fast))
        num_loading = len(self.loading)
        # Aged requests, then those whose prefix is placed (they hold its pages), then the one
        # preemptions just made room for (the freed pages are its), then the fast lane, then the rest.
        order = sorted(self._ranked(list(self.waiting)),
                       key=lambda s: (not (self._urgent(s) or s.prefix_done), s is not made_room_for,
                                      s.seq_id not in fast))
        budget = self._admit_waiting(batch, budget, order, hold_line=False)
        self._top_up(batch, budget)
        self._age(batch, self.loading[num_loading:])
        return batch

    def abort(self, seq: Sequence) -> None:
        """Remove ``seq`` wherever it is and free its pages."""
        for queue in (self.running, self.loading):
            if seq in queue:
                queue.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._blocked.pop(seq.seq_id, None)
        self._aging_restarted.discard(seq.seq_id)
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
        self._aging_restarted.discard(seq.seq_id)
        self.pool.free(seq.kv)
