"""Engine behaviour through the offline API: reuse, preemption, sampling, stops, bad input."""

import dataclasses

import numpy as np
import pytest
import torch

from kvtier import LLM, EngineConfig, SamplingParams
from kvtier.model import preset


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


@pytest.mark.parametrize("kwargs, match", [
    ({"page_size": 12}, "page_size must be a power of two, got 12"),
    ({"num_device_pages": 0}, "num_device_pages"),
    ({"max_num_batched_tokens": -1}, "max_num_batched_tokens"),
])
def test_bad_engine_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_model_and_text_prompts(llm):
    with pytest.raises(ValueError, match="checkpoint directory or a preset"):
        LLM("no-such-model")
    with pytest.raises(ValueError, match="kimi-k2.*sizing"):
        LLM("kimi-k2")
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["hello"])
    with pytest.raises(ValueError, match="sampling_params has 2 entries for 1 prompts"):
        llm.generate(prompt_token_ids=[[1]], sampling_params=[GREEDY, GREEDY])


def test_tiny_config_is_the_preset(llm):
    assert llm.config == preset("tiny")
