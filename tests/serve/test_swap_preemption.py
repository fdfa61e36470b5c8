"""Preemption that costs a reload, not the decode tail (``EngineConfig.preemption_mode``,
``admission_watermark``): a preempted sequence's full blocks go down to the host tier when
their pages are reused and load back, only its partial last page is recomputed; it is not
held to the admission watermark; a decode is preempted for a waiting request only when its resume costs
less than waiting for it to end; and a new request leaves the watermark's pages free.

Engines here run the real scheduler, engine step and pool over the model-free runner of
:mod:`tests.helpers.engines`; outputs are compared with each request run alone."""

import numpy as np
import pytest
import torch

from kvtier import SamplingParams
from kvtier.cache.cost_model import CostModel, TierCost
from kvtier.cache.config import PoolConfig
from kvtier.cache.kv_state import KVState, TokenList
from kvtier.cache.pool import KVPool
from kvtier.cache.prefix_index import Tier
from kvtier.serve.config import EngineConfig
from kvtier.serve.preemption import SPARED_DECODE_TOKENS
from kvtier.serve.step_time import FEATURES
from tests.helpers.engines import StandInLLM
from tests.helpers.scheduling import reconfigure
from tests.helpers.serving import BLOCK, N, PS, always_load, host_cached, occupy, prompt

LONG = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
TWO = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def alone(p, params):
    """What ``p`` produces on its own."""
    plain = StandInLLM("tiny", page_size=PS, num_device_pages=64, enable_prefix_caching=False)
    return plain.generate(prompt_token_ids=[p], sampling_params=params)[0].token_ids


def run(engine, step_s=None, max_steps=500):
    """Step until idle, the step-time model's estimate held at ``step_s`` seconds a step when
    given; ``{request_id: output}``."""
    outs, steps = {}, 0
    while engine.has_unfinished():
        if step_s is not None:
            fix_step_s(engine, step_s)
        outs.update({o.request_id: o for o in engine.step()})
        steps += 1
        assert steps < max_steps, "did not finish"
    return outs


def fix_step_s(engine, step_s):
    """Make the scheduler's step-time model estimate every step at ``step_s`` seconds."""
    engine.scheduler.step_time.weights = np.array([step_s] + [0.0] * (len(FEATURES) - 1))


@pytest.mark.parametrize("field, value", [("preemption_mode", "drop"), ("preemption_mode", None),
                                          ("admission_watermark", -0.1), ("admission_watermark", 0.9),
                                          ("admission_watermark", float("nan")), ("admission_watermark", True)])
def test_bad_preemption_options_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


@pytest.mark.parametrize("host", [True, False])
def test_resume_cost_loads_full_blocks_and_recomputes_the_partial_page(host):
    """``KVPool.resume_s``: the indexed full blocks at the host tier's load cost (or recomputed,
    without one), the partial last page recomputed."""
    cost = CostModel(tiers={Tier.HOST: TierCost(1e-3, 1e9)}, prefill_tok_s=1000.0)
    config = PoolConfig(page_size=4, num_device_pages=16, host_cache_bytes=(1 << 20) if host else 0)
    pool = KVPool(config, [torch.zeros(16, 4, 8)], cost)
    kv = KVState(TokenList(range(22)))
    assert pool.allocate(kv, 22)
    kv.num_computed_tokens = 22
    pool.register_computed(kv)
    assert kv.num_registered_blocks == 5
    full = cost.load_s(Tier.HOST, 5 * pool.block_bytes) if host else cost.recompute_s(20)
    assert pool.resume_s(kv) == pytest.approx(full + cost.recompute_s(2))
    fresh = KVState(TokenList(range(3)))
    assert pool.resume_s(fresh) == 0.0


def test_a_swapped_decode_loads_its_blocks_back_and_recomputes_only_its_partial_page(monkeypatch):
    """A decode is preempted; another request takes every page (its blocks are written back to
    the host tier); when it resumes, its full blocks load from there and only the tokens past
    them (fewer than a page, its last token included) run again. Its output is its own."""
    llm = always_load(StandInLLM("tiny", page_size=PS, num_device_pages=12, host_cache_bytes=64 * BLOCK, preemption_mode="swap",
                                 write_policy="write-back", admission_watermark=0.0))
    engine, scheduler, pool = llm.engine, llm.engine.scheduler, llm.engine.pool
    p = prompt(5 * PS + 3, 7)
    rid = engine.add_request(p, LONG)
    for _ in range(3):
        engine.step()
    seq = engine.sequence(rid)
    assert len(seq.output_token_ids) == 3 and seq in scheduler.running
    scheduler.queues.preempt(seq, pool)  # as making room for another request would
    assert scheduler.ranking.resuming(seq)
    other = occupy(pool, 12)  # every page reused: its blocks are written back to host
    pool.free(other)
    loaded_before = pool.stats().bytes_loaded.get("host", 0)
    batches = []
    schedule = scheduler.schedule
    monkeypatch.setattr(scheduler, "schedule", lambda: batches.append(schedule()) or batches[-1])
    outs = run(engine)
    full = (seq.num_tokens - 1) // PS  # the blocks it had computed: all but the partial page
    assert pool.stats().bytes_loaded.get("host", 0) - loaded_before == full * pool.block_bytes
    chunk = next(n for b in batches for s, n in b.extends if s is seq)
    assert chunk == 5 * PS + 3 + 3 - full * PS <= PS
    assert outs[rid].token_ids == alone(p, LONG)
    assert outs[rid].metrics.preemptions_after_first_token == 1


def test_a_preempted_request_is_not_held_to_the_watermark():
    """A new request that would leave fewer than the watermark's pages free waits; the same
    request, preempted (it comes back by copy), is not held to it."""
    llm = StandInLLM("tiny", page_size=PS, num_device_pages=20, admission_watermark=0.25, host_cache_bytes=64 * BLOCK,
                     preemption_mode="swap")
    engine, scheduler = llm.engine, llm.engine.scheduler
    engine.add_request(prompt(N, 5), LONG)
    engine.step()  # it holds 9 to 10 of the 20 pages
    rid = engine.add_request(prompt(8 * PS, 6), TWO)
    seq = engine.sequence(rid)
    budget = scheduler.config.max_num_batched_tokens
    assert scheduler.under_watermark(seq, budget)
    scheduler.queues.preempted.add(rid)  # as a preemption records it
    assert scheduler.ranking.resuming(seq) and not scheduler.under_watermark(seq, budget)


@pytest.mark.parametrize("step_s, preempted", [(10.0, True), (1e-9, False)])
def test_a_decode_is_preempted_for_a_new_turn_only_when_its_resume_costs_less_than_its_end(step_s, preempted):
    """A new turn needs the pages of a decode with 10 tokens left whose resume loads 5 blocks
    and recomputes 3 tokens. With 10 s steps, waiting for the decode costs more than its resume:
    it is preempted. With steps far shorter than its resume it is not: the turn waits for it to
    end. Outputs are unchanged either way."""
    llm = host_cached(llm=StandInLLM, preemption_mode="swap")
    engine, scheduler = llm.engine, llm.engine.scheduler
    decode_prompt, cold_prompt = prompt(5 * PS + 3, 3), prompt(N, 77)
    dec = engine.add_request(decode_prompt, LONG)
    engine.step()  # it holds 6 pages, then decodes
    rid = engine.add_request(cold_prompt, TWO)
    for _ in range(2):  # the turn fails admission, then the preemption rule is asked
        fix_step_s(engine, step_s)
        seq = engine.sequence(dec)
        assert (engine.pool.resume_s(seq.kv) < 10 * step_s) == preempted
        engine.step()
    assert scheduler.num_preemptions == int(preempted)
    outs = run(engine)
    assert outs[rid].token_ids == alone(cold_prompt, TWO)
    assert outs[dec].token_ids == alone(decode_prompt, LONG)
    if not preempted:
        assert outs[rid].metrics.first_token_time > outs[dec].metrics.finish_time


@pytest.mark.parametrize("watermark", [0.0, 0.25])
def test_a_new_request_leaves_the_watermark_free_while_another_runs(watermark):
    """20 pages, a decode holding 9 to 10 of them: a new 9-page prompt fits only by taking all
    but one of the rest. With a 25% watermark (5 pages) it waits for the decode to end; with
    none it runs beside it."""
    llm = StandInLLM("tiny", page_size=PS, num_device_pages=20, admission_watermark=watermark)
    engine = llm.engine
    assert engine.scheduler.reserve == (5 if watermark else 0)
    first_prompt, second_prompt = prompt(N, 5), prompt(8 * PS, 6)
    a = engine.add_request(first_prompt, LONG)
    engine.step()
    b = engine.add_request(second_prompt, TWO)
    outs = run(engine)
    assert engine.scheduler.num_preemptions == 0
    assert outs[a].token_ids == alone(first_prompt, LONG) and outs[b].token_ids == alone(second_prompt, TWO)
    if watermark:
        assert outs[b].metrics.first_token_time > outs[a].metrics.finish_time
    else:
        assert outs[b].metrics.first_token_time < outs[a].metrics.finish_time


def test_the_queues_measure_how_long_a_preempted_decode_waits():
    """A decode preempted at t = 1 s and admitted again at t = 3 s waited 2 s; preempted again
    at 5 s and admitted at 9 s, 4 s more: ``decode_wait_s`` moves a quarter of the way to the
    latest wait (2.5 s), ``waited_s`` adds them up (6 s), and its end forgets them. A prefill
    preempted before its first token counts no decode wait."""
    now = [0.0]
    llm = StandInLLM("tiny", page_size=PS, num_device_pages=64, max_num_batched_tokens=4 * PS)
    engine, queues, pool = llm.engine, llm.engine.scheduler.queues, llm.engine.pool
    rid = engine.add_request(prompt(N, 11), LONG)
    seq = engine.sequence(rid)
    while not seq.output_token_ids:
        engine.step()
    assert seq.output_token_ids and queues.decode_wait_s == 0.0
    for preempted_at, admitted_at in ((1.0, 3.0), (5.0, 9.0)):
        queues.preempt(seq, pool, preempted_at)
        now[0] = admitted_at
        queues.start_running(seq, lambda: now[0])
    assert queues.decode_wait_s == pytest.approx(2.0 + 0.25 * (4.0 - 2.0))
    assert queues.waited_s[rid] == pytest.approx(6.0)
    queues.finish(seq)
    assert rid not in queues.waited_s and seq not in queues.running
    other = engine.add_request(prompt(N, 12), LONG)
    engine.step()  # its first chunk runs: a prefill
    fresh = engine.sequence(other)
    assert not fresh.output_token_ids
    queues.preempt(fresh, pool, 10.0)
    queues.start_running(fresh, lambda: 20.0)
    assert other not in queues.waited_s and queues.decode_wait_s == pytest.approx(2.5)


def test_the_decode_preempted_first_is_the_one_whose_time_per_token_it_harms_least():
    """Three decodes of equal context: one with 8 tokens to spread a wait over, one with 40,
    and one with 40 that already waited 3 s preempted. With a measured wait of 1 s, the
    preemption rule offers the long fresh one first, then the one that waited, then the short
    one (1 s over 7 gaps, against 4 s over 39)."""
    llm = host_cached(llm=StandInLLM, num_device_pages=40, preemption_mode="swap")
    engine, scheduler = llm.engine, llm.engine.scheduler
    forty = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    short = engine.add_request(prompt(2 * PS, 21), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    fresh = engine.add_request(prompt(2 * PS, 22), forty)
    waited = engine.add_request(prompt(2 * PS, 23), forty)
    engine.step()
    seqs = [engine.sequence(r) for r in (short, fresh, waited)]
    assert all(s.output_token_ids for s in seqs)
    scheduler.queues.decode_wait_s = 1.0
    scheduler.queues.waited_s[waited] = 3.0
    fix_step_s(engine, 10.0)
    order = scheduler.preemption.cheap_decodes(seqs)
    assert [s.seq_id for s in order] == [fresh, waited, short]
    # a running sequence short of pages preempts the least harmed decode after it, too
    assert scheduler.preemption.running_victim(seqs[0]).seq_id == fresh


def test_a_decode_about_to_end_is_not_preempted_for_a_new_turn():
    """The decode of the resume-cost test with 10 s steps, but 4 tokens left
    (``SPARED_DECODE_TOKENS``) when the new turn comes: the turn waits for its end instead of
    preempting it. Outputs are unchanged."""
    assert SPARED_DECODE_TOKENS == 4
    llm = host_cached(llm=StandInLLM, preemption_mode="swap")
    engine, scheduler = llm.engine, llm.engine.scheduler
    five = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    decode_prompt, cold_prompt = prompt(5 * PS + 3, 3), prompt(N, 77)
    dec = engine.add_request(decode_prompt, five)
    engine.step()  # its first token: 4 left
    rid = engine.add_request(cold_prompt, TWO)
    outs = run(engine, step_s=10.0)
    assert scheduler.num_preemptions == 0
    assert outs[rid].metrics.first_token_time > outs[dec].metrics.finish_time
    assert outs[rid].token_ids == alone(cold_prompt, TWO) and outs[dec].token_ids == alone(decode_prompt, five)
