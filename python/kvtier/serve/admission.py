"""Admission policies of the scheduler (``EngineConfig.schedule_policy``), selected by name.

A policy is a pair: a ranking (:mod:`kvtier.serve.ranking`: in which order requests are tried
and how many tokens each running prefill takes) and a preemption rule
(:mod:`kvtier.serve.preemption`: whom to preempt), plus the step budgets it schedules within
(:mod:`kvtier.serve.step_plan`). ``fcfs`` is arrival order and preempt-last; ``cache-aware``
ranks by a cost-to-serve deadline and preempts what ranks behind.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.serve.config import SCHEDULE_POLICIES, EngineConfig
from kvtier.serve.preemption import PreemptBehind, PreemptLast
from kvtier.serve.ranking import ArrivalOrder, CostRanking
from kvtier.serve.step_plan import INLINE_LOAD_SHARE, StepBudget


@dataclass(frozen=True)
class AdmissionPolicy:
    """A ranking and a preemption rule under one name.

    Attributes:
        name: the ``EngineConfig.schedule_policy`` value.
        ranking: the ranking class (built over the scheduler's config, pool and queues).
        preemption: the preemption rule class (built over that ranking, config, pool, queues).
        attention_budget: whether steps honour ``EngineConfig.max_num_batched_pairs``.
        inline_share: share of a full step's time short prefix loads may be waited for at
            admission (0: never).
    """

    name: str
    ranking: type[ArrivalOrder]
    preemption: type[PreemptLast]
    attention_budget: bool = False
    inline_share: float = 0.0

    def step_budget(self, config: EngineConfig) -> StepBudget:
        """A fresh budget for one step."""
        return StepBudget(config.max_num_batched_pairs if self.attention_budget else None, self.inline_share)


CACHE_AWARE = AdmissionPolicy("cache-aware", CostRanking, PreemptBehind, attention_budget=True,
                              inline_share=INLINE_LOAD_SHARE)
FCFS = AdmissionPolicy("fcfs", ArrivalOrder, PreemptLast)

POLICIES: dict[str, AdmissionPolicy] = {p.name: p for p in (CACHE_AWARE, FCFS)}
"""Policies by ``EngineConfig.schedule_policy`` name."""
assert tuple(POLICIES) == SCHEDULE_POLICIES, "kvtier.serve.config.SCHEDULE_POLICIES names the policies here"

__all__ = ["AdmissionPolicy", "CACHE_AWARE", "FCFS", "POLICIES"]
