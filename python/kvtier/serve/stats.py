"""What the scheduler and the engine publish for metrics and reports: frozen snapshots taken on
the engine's thread (:meth:`kvtier.serve.scheduler.Scheduler.stats`,
:meth:`kvtier.serve.engine.Engine.stats`), safe to hand to any other thread."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.cache.pool_stats import PoolSnapshot


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's queues and counters at one instant.

    Attributes:
        waiting: requests queued for admission (preempted ones included).
        loading: admitted requests whose cached prefix is still loading.
        running: requests being prefilled or decoded.
        preemptions: running requests preempted for pages so far.
    """

    waiting: int
    loading: int
    running: int
    preemptions: int


@dataclass(frozen=True)
class EngineStats:
    """One engine at one instant: its scheduler's and its pool's snapshots and its own counters.

    Attributes:
        scheduler: :class:`SchedulerStats`.
        pool: :class:`kvtier.cache.pool_stats.PoolSnapshot`.
        prefill_tokens: tokens run as prefill so far (prompt chunks and recomputation; cached
            prefix tokens are not).
        steps: engine steps completed.
        grammar: the tool-grammar counters (:meth:`kvtier.toolcall.GrammarStats.snapshot`);
            None before the grammar compiler exists (no request with tools yet).
    """

    scheduler: SchedulerStats
    pool: PoolSnapshot
    prefill_tokens: int
    steps: int
    grammar: dict | None = None
