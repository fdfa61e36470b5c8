"""What bounds one step under cache-aware scheduling: the attention work of its prefill chunks
(``max_num_batched_pairs``), the short prefix loads it waits for at admission, and whom a
prefill short of pages preempts. Each also runs FCFS, which has none of them."""

import math

import pytest

from kvtier import LLM
from kvtier.cache.cost_model import TierCost
from kvtier.cache.prefix_index import Tier
from kvtier.serve.config import EngineConfig
from kvtier.serve.request import SequenceStatus
from kvtier.serve.scheduler import Scheduler
from tests.helpers.serving import N, ONE, PS, host_cached, prompt
from tests.helpers.scheduling import reconfigure

BUDGET = 64


from kvtier.serve.step_plan import pairs as _pairs  # query-key pairs of a chunk of n tokens after `context`


def _record_steps(engine) -> list[list[tuple[int, int, int]]]:
    """Wrap the scheduler: each step's prefill chunks as ``(seq_id, context, tokens)``."""
    steps = []
    schedule = engine.scheduler.schedule

    def recording():
        batch = schedule()
        steps.append([(s.seq_id, s.num_computed_tokens, n) for s, n in batch.extends])
        return batch

    engine.scheduler.schedule = recording
    return steps


FRESH_CHUNK_PAIRS = BUDGET * (BUDGET + 1) // 2  # the attention work of a first chunk of a fresh prompt


def test_max_num_batched_pairs_defaults_to_no_attention_budget_and_is_checked():
    """By default only the token budget bounds a step (as in vLLM and SGLang): a lone 512-token
    prompt runs in 64-token chunks however deep its context."""
    assert EngineConfig(max_num_batched_tokens=64).max_num_batched_pairs is None
    llm = LLM("tiny", page_size=PS, num_device_pages=256, max_num_batched_tokens=BUDGET)
    steps = _record_steps(llm.engine)
    llm.engine.add_request(prompt(512, 5), ONE)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert [n for step in steps for _, _, n in step] == [BUDGET] * (512 // BUDGET)
    for bad in (0, -1, 1.5, "8"):
        with pytest.raises(ValueError, match="max_num_batched_pairs"):
            EngineConfig(max_num_batched_pairs=bad)


@pytest.mark.parametrize("policy", ["cache-aware", "fcfs"])
def test_chunks_deep_in_a_long_prompt_are_cut_to_the_step_attention_budget(policy):
    """A 512-token cold prompt beside a decode, 64-token budget, an attention budget of
    ``B (B + 1) / 2`` query-key pairs (the first chunk of a fresh prompt): under cache-aware each
    step's prefill chunks see at most that many, so chunks shrink as the context grows, and the prompt still ends within
    ``ceil(L / B) + ceil(L (L + 1) / 2 / (P - L))`` steps (a cut chunk takes at least
    ``P - L`` pairs); FCFS runs whole 64-token chunks. Outputs equal a run without caching."""
    llm = LLM("tiny", page_size=PS, num_device_pages=256, max_num_batched_tokens=BUDGET, schedule_policy=policy,
              max_num_batched_pairs=FRESH_CHUNK_PAIRS)
    engine = llm.engine
    steps = _record_steps(engine)
    length = 512
    long_prompt = prompt(length, 5)
    rid = engine.add_request(long_prompt, ONE)
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    budget = FRESH_CHUNK_PAIRS
    chunks = [n for step in steps for _, _, n in step]
    assert sum(chunks) == length
    if policy == "cache-aware":
        for step in steps:
            assert sum(_pairs(c, n) for _, c, n in step) <= budget or (len(step) == 1 and step[0][2] == 1)
        assert min(chunks) < BUDGET // 4  # deep chunks really were cut
        assert len(steps) <= math.ceil(length / BUDGET) + math.ceil(length * (length + 1) / 2 / (budget - length))
    else:
        assert chunks == [BUDGET] * (length // BUDGET)
    plain = LLM("tiny", page_size=PS, num_device_pages=256, enable_prefix_caching=False)
    assert outs[rid].token_ids == plain.generate(prompt_token_ids=[long_prompt], sampling_params=ONE)[0].token_ids


def test_a_running_prefill_gets_a_token_a_step_whatever_the_budget():
    """With a budget of 1 pair, a 100-token prompt's first chunk (at admission: counted, not cut)
    is the 64-token budget, and each later step still runs one token of it."""
    llm = LLM("tiny", page_size=PS, num_device_pages=256, max_num_batched_tokens=BUDGET, max_num_batched_pairs=1)
    engine = llm.engine
    steps = _record_steps(engine)
    rid = engine.add_request(prompt(100, 6), ONE)
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    # ... the last prompt token runs as a decode does (one token, sampled)
    assert [n for step in steps for _, _, n in step] == [BUDGET] + [1] * (100 - BUDGET - 1)
    assert outs[rid].token_ids


def _frozen_costs(engine, host_bandwidth_Bps: float) -> None:
    """1,000 prefill tokens/s and the given host bandwidth, whatever steps and copies take."""
    cm = engine.pool.tiers.cost_model
    cm.alpha = 0.0
    cm.prefill_tok_s = 1000.0
    cm.tiers[Tier.HOST] = TierCost(latency_s=1e-5, bandwidth_Bps=host_bandwidth_Bps)


@pytest.mark.parametrize("policy,bandwidth,same_step", [("cache-aware", 1e10, True), ("cache-aware", 2e6, False),
                                                        ("fcfs", 1e10, False)])
def test_a_short_host_load_is_waited_for_in_the_step_that_admits_it(policy, bandwidth, same_step):
    """A turn whose 8 blocks are in the host tier, on an idle engine with a 256-token budget (a
    full step estimated at 0.256 s). Cache-aware waits at admission for a load estimated under
    ``INLINE_LOAD_SHARE`` of that (here ~12 us at 10 GB/s) and the turn's first token comes in
    its first step; a load estimated at ~60 ms (2 MB/s), or under FCFS, runs in the background
    and the turn runs in the step after the load ended. Both reuse the whole cached prefix."""
    b = prompt(N, 2)
    llm = host_cached(b, num_device_pages=16, schedule_policy=policy)
    engine = llm.engine
    reconfigure(engine.scheduler, max_num_batched_tokens=256)
    _frozen_costs(engine, bandwidth)
    rid = engine.add_request(b, ONE)
    outs = engine.step()
    if same_step:
        assert [o.request_id for o in outs] == [rid]
    else:
        assert outs == [] and engine._sequences[rid] in engine.scheduler.loading
        while not outs:
            engine.pool.wait_for_loads(0.05)
            outs = engine.step()
    assert outs[0].num_cached_tokens == 8 * PS and outs[0].cached_tokens_by_tier["host"] == 8 * PS


def _running(engine, tokens: int, computed: int, seed: int):
    """A running sequence of ``tokens`` prompt tokens with ``computed`` of them in its pages."""
    rid = engine.add_request(prompt(tokens, seed), ONE)
    sched = engine.scheduler
    seq = engine._sequences[rid]
    sched.waiting.remove(seq)
    assert engine.pool.allocate(seq.kv, computed)
    seq.num_computed_tokens, seq.prefix_done, seq.admitted = computed, True, True
    seq.status = SequenceStatus.RUNNING
    sched.running.append(seq)
    return seq


def test_a_prefill_short_of_pages_preempts_itself_before_a_turn_its_step_would_end():
    """Whom a running prefill that finds no page for its chunk preempts (cache-aware): of itself
    and the sequences after it, the worst-ranked, prefills whose prompt ends within a step last
    (FCFS takes the last admitted, which is often such a turn)."""
    engine = LLM("tiny", page_size=PS, num_device_pages=256, max_num_batched_tokens=BUDGET).engine
    engine.pool.tiers.cost_model.alpha = 0.0
    sched: Scheduler = engine.scheduler
    cold = _running(engine, 40 * PS, 30 * PS, 1)  # 160 tokens left
    turn = _running(engine, 20 * PS, 20 * PS - 40, 2)  # admitted later, its prompt ends this step
    other = _running(engine, 60 * PS, PS, 3)  # admitted last, 944 tokens left: the costliest
    assert sched.preemption.running_victim(cold) is other
    sched.running.remove(other)
    assert sched.preemption.running_victim(cold) is cold
    assert sched.preemption.running_victim(turn) is turn


def test_a_head_never_preempts_a_prefill_whose_prompt_ends_within_a_step():
    """``victims`` (pages, not tokens): a blocked new turn takes pages from a running prefill far
    from its end, never from one whose prompt ends within a step, however many pages it holds
    (it gets its first token now; preempted, it would load them all back)."""
    engine = LLM("tiny", page_size=PS, num_device_pages=256, max_num_batched_tokens=BUDGET,
                 host_cache_bytes=64 * 15360).engine
    engine.pool.tiers.cost_model.alpha = 0.0
    sched = engine.scheduler
    assert engine.pool.keeps_evicted_blocks  # so a new turn may preempt prefills ranked ahead of it
    ending = _running(engine, 60 * PS, 60 * PS - 30, 1)  # 58 pages, 30 tokens from its first token
    far = _running(engine, 12 * PS, 2 * PS, 2)  # 2 pages, 160 tokens to go
    head = engine._sequences[engine.add_request(prompt(4 * PS, 3), ONE)]
    assert sched.preemption.ends_soon(ending) and not sched.preemption.ends_soon(far)
    assert sched.preemption.victims(head, 1) == [far]
    assert sched.preemption.victims(head, 3) is None  # `far` frees 2 pages; `ending` is spared


def test_the_last_chunk_of_a_long_prompt_shares_its_step_with_the_next_long_prompt():
    """Two cold prompts longer than the 64-token budget: the second starts its chunks in the step
    where the first one's last chunk (48 tokens, more than the ``CHUNK_SHARE`` planned for it)
    runs, so no step runs under budget until the last one. (Before, every prompt longer than the
    budget left after the planned chunk waited, and that step ran 48 tokens.) Outputs equal FCFS's."""
    outs = {}
    for policy in ("cache-aware", "fcfs"):
        llm = LLM("tiny", page_size=PS, num_device_pages=256, max_num_batched_tokens=BUDGET, schedule_policy=policy)
        steps = _record_steps(llm.engine)
        rids = [llm.engine.add_request(prompt(n, seed), ONE) for n, seed in ((112, 3), (200, 4))]
        got = {}
        while llm.engine.has_unfinished():
            got.update({o.request_id: o.token_ids for o in llm.engine.step()})
        outs[policy] = [got[r] for r in rids]
        totals = [sum(n for _, _, n in step) for step in steps if step]
        assert sum(totals) == 312
        if policy == "cache-aware":
            assert totals[:-1] == [BUDGET] * (len(totals) - 1), totals
    assert outs["cache-aware"] == outs["fcfs"]


def test_placing_the_rest_of_the_chunked_prefill_charges_its_attention_work_once():
    """``StepPlan.end_chunked`` placing a running prefill's rest that had no chunk yet this step
    charges that chunk's query-key pairs once (``place`` charges it; an extra charge took them
    twice, leaving the rest of the step less attention budget)."""
    import torch

    from kvtier.cache.config import PoolConfig
    from kvtier.cache.pool import KVPool
    from kvtier.serve.params import RequestMetrics, SamplingParams
    from kvtier.serve.request import Sequence
    from kvtier.serve.step_plan import StepBudget, StepPlan

    config = PoolConfig(page_size=1, num_device_pages=64)
    plan = StepPlan(KVPool(config, [torch.zeros(64, 1, 8)]), 64, StepBudget(10_000))
    seq = Sequence(1, list(range(20)), SamplingParams(max_tokens=1), RequestMetrics(0.0))
    seq.status = SequenceStatus.RUNNING
    assert plan.end_chunked([seq]) == 20 and plan.tokens_left == 44
    assert plan.batch.extends == [(seq, 20)] and 10_000 - plan.budget.pairs_left == _pairs(0, 20)
