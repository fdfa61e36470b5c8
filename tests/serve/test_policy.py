"""Policies are small classes behind one interface, selected by ``EngineConfig.schedule_policy``."""

import torch

from kvtier.cache.config import PoolConfig
from kvtier.cache.pool import KVPool
from kvtier.serve.config import SCHEDULE_POLICIES, EngineConfig
from kvtier.serve.policy import POLICIES, FCFS, CacheAware, SchedulePolicy
from kvtier.serve.scheduler import Scheduler
from kvtier.serve.step_budget import StepBudget, pairs


def test_the_scheduler_selects_its_policy_by_name():
    assert tuple(POLICIES) == SCHEDULE_POLICIES == ("cache-aware", "fcfs")
    pool_cfg = PoolConfig(page_size=1, num_device_pages=8)
    for name, cls in (("cache-aware", CacheAware), ("fcfs", FCFS)):
        sched = Scheduler(EngineConfig(pool=pool_cfg, schedule_policy=name), KVPool(pool_cfg, [torch.zeros(8, 1, 8)]))
        assert type(sched.policy) is cls and isinstance(sched.policy, SchedulePolicy) and cls.name == name
    assert FCFS.hold_line and not CacheAware.hold_line


def test_step_budget_caps_chunks_to_the_pairs_left_and_takes_inline_shares():
    class Seq:
        num_computed_tokens = 10

    step = StepBudget(pairs_budget=100)
    m = step.cap(Seq(), 50)
    assert pairs(10, m) <= 100 < pairs(10, m + 1)  # the largest chunk within the budget
    step.charge(Seq(), m)
    assert step.pairs_left == 100 - pairs(10, m)
    assert StepBudget(None).cap(Seq(), 50) == 50  # no attention budget: no cut
    inline = StepBudget(inline_share=0.1)
    assert inline.take_inline(0.05, 1.0) and not inline.take_inline(0.06, 1.0) and inline.take_inline(0.05, 1.0)
