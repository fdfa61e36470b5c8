"""Policies are a ranking and a preemption rule under one name, selected by
``EngineConfig.schedule_policy``."""

import torch

from kvtier.cache.config import PoolConfig
from kvtier.cache.pool import KVPool
from kvtier.serve.admission import CACHE_AWARE, FCFS, POLICIES
from kvtier.serve.config import SCHEDULE_POLICIES, EngineConfig
from kvtier.serve.preemption import PreemptBehind, PreemptLast
from kvtier.serve.ranking import ArrivalOrder, CostRanking
from kvtier.serve.scheduler import Scheduler
from kvtier.serve.step_plan import StepBudget, pairs


def test_the_scheduler_selects_its_policy_by_name():
    assert tuple(POLICIES) == SCHEDULE_POLICIES == ("cache-aware", "fcfs")
    pool_cfg = PoolConfig(page_size=1, num_device_pages=8)
    for name, policy, ranking, preemption in (("cache-aware", CACHE_AWARE, CostRanking, PreemptBehind),
                                              ("fcfs", FCFS, ArrivalOrder, PreemptLast)):
        sched = Scheduler(EngineConfig(pool=pool_cfg, schedule_policy=name), KVPool(pool_cfg, [torch.zeros(8, 1, 8)]))
        assert sched.policy is policy and policy.name == name
        assert type(sched.ranking) is ranking and type(sched.preemption) is preemption
        assert sched.preemption.ranking is sched.ranking
    assert ArrivalOrder.hold_line and not CostRanking.hold_line


def test_fcfs_steps_have_no_attention_budget_and_wait_for_no_load():
    config = EngineConfig(pool=PoolConfig(page_size=1, num_device_pages=8), max_num_batched_pairs=100)
    fcfs, aware = FCFS.step_budget(config), CACHE_AWARE.step_budget(config)
    assert fcfs.pairs_budget is None and fcfs.inline_left == 0.0
    assert aware.pairs_budget == 100 and aware.inline_left > 0


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


def test_what_the_scheduler_calls_never_imports_it():
    """The ranking, the preemption rule, the queues and the step plan answer the scheduler; none
    imports it (or the engine above it), so ``schedule()`` only ever calls down."""
    import ast
    import importlib

    for name in ("admission", "ranking", "preemption", "queues", "step_plan", "step_time"):
        module = importlib.import_module(f"kvtier.serve.{name}")
        with open(module.__file__) as f:
            tree = ast.parse(f.read())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not imported & {"kvtier.serve.scheduler", "kvtier.serve.engine"}, (name, imported)
