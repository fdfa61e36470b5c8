"""The step plan's verdicts (``StepPlan.add``, ``StepPlan.chunk``) and the queues' moves
(``Queues.preempt``, ``start_running``), on a bare pool without a model."""

import pytest
import torch

from kvtier.cache.config import PoolConfig
from kvtier.cache.pool import KVPool, PrefixStart
from kvtier.serve.params import RequestMetrics, SamplingParams
from kvtier.serve.queues import Queues
from kvtier.serve.request import Sequence, SequenceStatus
from kvtier.serve.step_plan import StepBudget, StepPlan, Verdict

PS = 4


def _pool(pages: int) -> KVPool:
    return KVPool(PoolConfig(page_size=PS, num_device_pages=pages), [torch.zeros(pages, PS, 8)])


def _seq(seq_id: int, tokens: int) -> Sequence:
    return Sequence(seq_id, list(range(100 * seq_id, 100 * seq_id + tokens)), SamplingParams(max_tokens=4),
                    RequestMetrics(0.0))


def test_add_places_a_chunk_and_charges_the_token_budget():
    pool = _pool(8)
    plan = StepPlan(pool, tokens=10)
    seq = _seq(1, 12)
    assert plan.add(seq, plan.chunk(seq)) is Verdict.PLACED
    assert plan.batch.extends == [(seq, 10)] and plan.tokens_left == 0
    assert len(seq.page_ids) == 3  # ceil(10 / 4)
    assert plan.chunk(_seq(2, 5)) == 0 and plan.add(_seq(2, 5), 0) is Verdict.NO_TOKENS


def test_no_pages_changes_nothing_and_shrink_runs_what_the_pages_hold():
    pool = _pool(2)
    plan = StepPlan(pool, tokens=64)
    seq = _seq(1, 20)
    assert plan.add(seq, 20) is Verdict.NO_PAGES
    assert not seq.page_ids and not plan.batch and plan.tokens_left == 64 and pool.num_free_pages == 2
    assert plan.add(seq, 20, shrink=True) is Verdict.PLACED
    assert plan.batch.extends == [(seq, 8)] and plan.tokens_left == 56 and pool.num_free_pages == 0


def test_chunk_keeps_to_the_chunk_plan_and_the_attention_budget_but_never_caps_a_decode():
    pool = _pool(64)
    seq = _seq(1, 40)
    assert StepPlan(pool, tokens=64).chunk(seq, {1: 12}) == 12
    assert StepPlan(pool, tokens=64).chunk(seq, {}) == 0  # absent from a plan: no prefill tokens
    # 36 query-key pairs hold a causal chunk of 8 tokens (8 * 9 / 2) from position 0.
    assert StepPlan(pool, 64, StepBudget(pairs_budget=36)).chunk(seq) == 8
    decode = _seq(2, 9)
    decode.num_computed_tokens = 8
    assert StepPlan(pool, 64, StepBudget(pairs_budget=1)).chunk(decode, {}) == 1


def test_a_preempted_sequence_waits_at_the_head_with_its_pages_freed():
    pool = _pool(8)
    queues, plan = Queues(), StepPlan(pool, tokens=64)
    first, second = _seq(1, 6), _seq(2, 6)
    clock = iter(range(100)).__next__
    for seq in (first, second):
        queues.waiting.append(seq)
        assert plan.start_prefix(seq, partial=True, clock=clock) is PrefixStart.READY
        assert plan.add(seq, 6) is Verdict.PLACED
        queues.start_running(seq, clock)
    assert queues.running == [first, second] and not queues.waiting and first.admitted
    assert first.status is SequenceStatus.RUNNING and first.metrics.admitted_time is not None
    free = pool.num_free_pages
    queues.preempt(second, pool)
    assert queues.running == [first] and list(queues.waiting) == [second] and queues.num_preemptions == 1
    assert second.status is SequenceStatus.WAITING and second.num_computed_tokens == 0 and not second.prefix_done
    assert pool.num_free_pages == free + 2 and second.metrics.num_preemptions == 1


@pytest.mark.parametrize("bad", [-3, 0])
def test_add_of_no_tokens_allocates_nothing(bad):
    pool = _pool(4)
    seq = _seq(1, 8)
    assert StepPlan(pool, tokens=64).add(seq, bad) is Verdict.NO_TOKENS and not seq.page_ids
