"""Engine behaviour through the offline API: reuse, preemption, sampling, stops, bad input."""

import dataclasses

import numpy as np
import pytest
import torch

from kvtier import LLM, EngineConfig, SamplingParams
from kvtier.model import preset
from kvtier.serve.runner import StepResult


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", page_size=16, num_device_pages=64, max_num_batched_tokens=64)


def prompt(n, seed):
    return torch.randint(0, 163840, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)


def test_identical_prompt_reuses_pages_and_gives_same_tokens(llm):
    p = prompt(70, 1)
    first = llm.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0]
    second = llm.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 64
    assert first.token_ids == second.token_ids
    assert np.allclose(first.logprobs, second.logprobs, atol=1e-4)
    assert second.metrics.ttft_s > 0 and second.metrics.e2e_s >= second.metrics.ttft_s


def test_preemption_recomputes_and_matches_a_roomy_pool():
    prompts = [prompt(100, 2), prompt(90, 3), prompt(80, 4)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    roomy = LLM("tiny", page_size=16, num_device_pages=64, max_num_batched_tokens=128)
    tight = LLM("tiny", page_size=16, num_device_pages=12, max_num_batched_tokens=128, enable_prefix_caching=False)
    want = [o.token_ids for o in roomy.generate(prompt_token_ids=prompts, sampling_params=params)]
    got = [o.token_ids for o in tight.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == want


def test_seeded_sampling_is_reproducible(llm):
    p = prompt(20, 5)
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    a = llm.generate(prompt_token_ids=[p], sampling_params=params)[0].token_ids
    b = llm.generate(prompt_token_ids=[p], sampling_params=params)[0].token_ids
    c = llm.generate(prompt_token_ids=[p], sampling_params=dataclasses.replace(params, seed=7))[0].token_ids
    assert a == b and a != c


def test_eos_stops_unless_ignored(llm):
    p = prompt(10, 6)
    first = llm.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0].token_ids[0]
    engine = llm.engine
    saved = engine.model_config
    engine.model_config = dataclasses.replace(saved, eos_token_id=(first,))
    try:
        out = llm.generate(prompt_token_ids=[p], sampling_params=dataclasses.replace(GREEDY, ignore_eos=False))[0]
        assert out.token_ids == [first] and out.finish_reason == "stop"
        out = llm.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0]
        assert len(out.token_ids) == 6 and out.finish_reason == "length"
    finally:
        engine.model_config = saved


def test_numpy_token_ids_are_accepted(llm):
    out = llm.generate(prompt_token_ids=[np.arange(5, 25, dtype=np.int64)], sampling_params=GREEDY)[0]
    assert len(out.token_ids) == 6


@pytest.mark.parametrize("prompts, match", [
    # A good prompt is queued first, so the bad ones start at index 1.
    ([[1, 2, 163840]], r"prompt_token_ids\[1\]\[2\] = 163840 must be an int in \[0, vocab_size=163840\)"),
    ([[1, 2], [-1]], r"prompt_token_ids\[2\]\[0\]"),
    ([[]], r"prompt_token_ids\[1\] is empty"),
    ([[1] * 8193], r"more than max_position_embeddings=8192"),
    ([[1] * 2000], r"needs \d+ pages"),
])
def test_bad_prompts_raise_and_the_engine_keeps_serving(llm, prompts, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt_token_ids=[[3, 4, 5]] + prompts, sampling_params=GREEDY)
    assert not llm.engine.has_unfinished()  # nothing was queued
    assert len(llm.generate(prompt_token_ids=[[3, 4, 5]], sampling_params=GREEDY)[0].token_ids) == 6


def test_output_the_pages_cannot_hold_is_blamed_on_max_tokens(llm):
    """A prompt that fits the 64 pages with an output that does not: the error names max_tokens
    (the API's param), a prompt too long by itself names the prompt."""
    with pytest.raises(ValueError, match=r"^max_tokens: prompt_token_ids\[0\] with max_tokens=2000 needs 126 pages"):
        llm.generate(prompt_token_ids=[[3, 4, 5]], sampling_params=SamplingParams(max_tokens=2000))
    with pytest.raises(ValueError, match=r"^prompt_token_ids\[0\] with max_tokens=1 needs"):
        llm.generate(prompt_token_ids=[[1] * 1100], sampling_params=SamplingParams(max_tokens=1))
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("kwargs, match", [
    ({"page_size": 12}, "page_size must be a power of two, got 12"),
    ({"num_device_pages": 0}, "num_device_pages"),
    ({"max_num_batched_tokens": -1}, "max_num_batched_tokens"),
])
def test_bad_engine_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.of(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_model_and_text_prompts(llm):
    with pytest.raises(ValueError, match="weights directory or a preset"):
        LLM("no-such-model")
    with pytest.raises(ValueError, match="kimi-k2.*sizing"):
        LLM("kimi-k2")
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["hello"])
    with pytest.raises(ValueError, match="sampling_params has 2 entries for 1 prompts"):
        llm.generate(prompt_token_ids=[[1]], sampling_params=[GREEDY, GREEDY])


def test_tiny_config_is_the_preset(llm):
    assert llm.config == preset("tiny")


class Interrupt(Exception):
    pass


def test_interrupted_generate_leaves_a_working_engine(monkeypatch):
    llm = LLM("tiny", page_size=16, num_device_pages=64, max_num_batched_tokens=16)
    prompts = [prompt(40, 20), prompt(25, 21)]
    want = [o.token_ids for o in LLM("tiny", page_size=16, num_device_pages=64).generate(
        prompt_token_ids=prompts, sampling_params=GREEDY)]
    real_run, calls = llm.engine.runner.run, []

    def run_then_interrupt(batch):
        calls.append(1)
        out = real_run(batch)
        if len(calls) == 4:
            raise Interrupt  # after the model ran, before postprocessing (like Ctrl-C)
        return out

    monkeypatch.setattr(llm.engine.runner, "run", run_then_interrupt)
    with pytest.raises(Interrupt):
        llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert not llm.engine.has_unfinished() and llm.engine.pool.num_free_pages == 64
    monkeypatch.setattr(llm.engine.runner, "run", real_run)
    assert [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)] == want


def test_a_failing_request_finishes_with_an_error_and_others_complete(llm, monkeypatch):
    """A step samples in one call, so a failing call fails the requests sampled in it; a request
    that samples in other steps completes (its prompt is still prefilling when the bad one samples)."""
    from kvtier.serve import sampler as sampler_module
    real_sample = sampler_module.ops.sample

    def sample(logits, temperature, top_p, **kw):
        if bool((top_p == 0.5).any()):
            raise RuntimeError("sampler exploded")
        return real_sample(logits, temperature, top_p, **kw)

    long_prompt = prompt(100, 23)  # not cached, 64-token steps: its first token is sampled in step 2
    monkeypatch.setattr(sampler_module.ops, "sample", sample)
    bad = dataclasses.replace(GREEDY, temperature=0.7, top_p=0.5, max_tokens=1)  # sampled: an all-greedy step makes no call
    outs = llm.generate(prompt_token_ids=[prompt(10, 22), long_prompt], sampling_params=[bad, GREEDY])
    assert outs[0].finish_reason == "error" and "sampler exploded" in outs[0].error
    assert outs[1].error is None and len(outs[1].token_ids) == 6
    assert llm.generate(prompt_token_ids=[long_prompt], sampling_params=GREEDY)[0].token_ids == outs[1].token_ids


def test_preempted_prefill_does_not_count_its_own_pages_as_cached():
    llm = LLM("tiny", page_size=16, num_device_pages=14, max_num_batched_tokens=8)
    a = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    b = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=True)
    outs = llm.generate(prompt_token_ids=[prompt(20, 24), prompt(200, 25)], sampling_params=[a, b])
    assert llm.engine.scheduler.num_preemptions > 0
    assert outs[1].num_cached_tokens == outs[1].prompt_logprobs.count(None) == 0


def test_page_budget_leaves_out_the_last_token():
    tight = LLM("tiny", page_size=16, num_device_pages=2)
    out = tight.generate(prompt_token_ids=[prompt(31, 26)], sampling_params=dataclasses.replace(GREEDY, max_tokens=2))
    assert len(out[0].token_ids) == 2


def test_flat_prompt_and_unknown_engine_argument(llm):
    assert len(llm.generate(prompt_token_ids=[5, 6, 7], sampling_params=GREEDY)[0].token_ids) == 6
    with pytest.raises(ValueError, match=r"unknown engine argument\(s\) \['gpu_memory_utilization'\]"):
        LLM("tiny", gpu_memory_utilization=0.9)


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": float("nan")}, "temperature"), ({"temperature": "0.5"}, "temperature"),
    ({"max_tokens": True}, "max_tokens"), ({"seed": 2**70}, "seed"), ({"logprobs": 5}, "logprobs"),
])
def test_more_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_tiny_temperature_is_greedy(llm):
    p = prompt(12, 27)
    greedy = llm.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0].token_ids
    tiny = llm.generate(prompt_token_ids=[p], sampling_params=dataclasses.replace(GREEDY, temperature=1e-38))[0]
    assert tiny.token_ids == greedy


@pytest.mark.parametrize("trial", range(12))
def test_prompt_logprobs_never_have_holes(trial):
    """Shared prefixes, tight pages, small budgets: entries are None exactly for the reported
    cached tokens, whatever admissions, retries and preemptions happened."""
    import random
    rng = random.Random(trial)
    shared = prompt(rng.randint(2, 5) * 16, trial)
    a, b = shared + prompt(rng.randint(1, 40), 1000 + trial), shared + prompt(rng.randint(1, 40), 2000 + trial)
    tokens = [rng.randint(1, 8), rng.randint(1, 8)]
    need = max(-(-(len(a) + tokens[0] - 1) // 16), -(-(len(b) + tokens[1] - 1) // 16))
    llm = LLM("tiny", page_size=16, num_device_pages=need + rng.randint(0, 4), max_num_seqs=rng.choice([2, 3]),
              max_num_batched_tokens=rng.choice([8, 16, 24, 40, 56]))
    params = [SamplingParams(max_tokens=m, temperature=0.0, prompt_logprobs=True, ignore_eos=True) for m in tokens]
    for out in llm.generate(prompt_token_ids=[a, b], sampling_params=params):
        c = out.num_cached_tokens
        assert out.prompt_logprobs[:c] == [None] * c and None not in out.prompt_logprobs[c:]


def test_begin_run_end_is_step_and_a_fake_clock_times_the_metrics():
    # step() is begin_step -> runner.run -> end_step: driving the three by hand gives step()'s tokens,
    # and every metric time comes from the engine's clock.
    want = LLM("tiny", page_size=16, num_device_pages=64).generate(prompt_token_ids=[prompt(40, 3)],
                                                                   sampling_params=GREEDY)[0]
    ticks = iter(range(1000))
    llm = LLM("tiny", page_size=16, num_device_pages=64)
    engine = llm.engine
    engine.clock = engine.scheduler.clock = lambda: float(next(ticks))
    rid = engine.add_request(prompt(40, 3), GREEDY, arrival_time=-5.0)
    outs = []
    while engine.has_unfinished():
        batch = engine.begin_step()
        assert batch  # nothing loads here: every step has work
        outs += engine.end_step(engine.runner.run(batch))
    (out,) = outs
    assert out.request_id == rid and out.token_ids == want.token_ids
    m = out.metrics
    assert m.arrival_time == -5.0 and 0 <= m.admitted_time < m.first_token_time < m.finish_time < 1000
    assert all(float(t).is_integer() for t in (m.admitted_time, m.first_token_time, m.finish_time))
    with pytest.raises(RuntimeError, match="begin_step first"):
        engine.end_step(StepResult())


def test_stepping_an_idle_engine_does_nothing(llm):
    """With no request, a step returns no output and schedules nothing (no error: the engine is
    idle, not short of pages); the engine then serves as before."""
    engine = llm.engine
    assert not engine.has_unfinished()
    assert engine.step() == [] and engine.begin_step() is None
    two = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=two)
    assert len(out[0].token_ids) == 2 and engine.step() == []


def test_prompt_logprobs_stay_none_for_positions_reported_cached_after_a_preemption():
    """After vLLM #47282 / #26329: a request admitted with 48 cached tokens and preempted, its
    blocks evicted meanwhile, recomputes them when re-admitted; what it reports stays the first
    admission's (48 cached) and exactly the first 48 prompt log-probs are None, as the contract
    of ``RequestOutput.prompt_logprobs`` says."""
    from kvtier.cache.kv_state import KVState, TokenList

    llm = LLM("tiny", page_size=16, num_device_pages=8)
    engine, pool = llm.engine, llm.engine.pool
    p = prompt(3 * 16 + 5, 31)
    llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(max_tokens=1, temperature=0.0))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=True)
    rid = engine.add_request(p, params)
    seq = engine._sequences[rid]
    engine.step()  # admitted with its 3 cached blocks; its last 5 tokens computed
    assert seq.num_cached_tokens == 48 and seq.prompt_logprobs[:48] == [None] * 48
    engine.scheduler.queues.preempt(seq, pool)
    filler = KVState(TokenList(range(pool.num_free_pages * 16)))
    assert pool.allocate(filler, pool.num_free_pages * 16)  # evicts the cached blocks
    pool.free(filler)
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    out = outs[rid]
    assert engine.scheduler.num_preemptions == 1 and out.metrics.num_preemptions == 0  # after its first token
    assert out.num_cached_tokens == 48
    assert out.prompt_logprobs[:48] == [None] * 48 and None not in out.prompt_logprobs[48:]
