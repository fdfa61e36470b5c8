"""``LLM(..., torch_compile=True)``: the model's step runs through ``torch.compile`` (dynamic
shapes, frozen weights) and greedy generation gives the eager tokens; the option is a bool and is
refused for a model with a recurrent state, naming it."""

from __future__ import annotations

import pytest
import torch

from kvtier import LLM, EngineConfig, SamplingParams


def test_torch_compile_is_off_by_default_and_a_bool():
    assert EngineConfig().torch_compile is False
    with pytest.raises(ValueError, match="torch_compile must be a bool, got 1"):
        EngineConfig(torch_compile=1)


def test_torch_compile_is_refused_for_a_model_with_a_recurrent_state():
    with pytest.raises(ValueError, match="torch_compile is for models without a recurrent state"):
        LLM("tiny-k3", dtype="float32", page_size=16, num_device_pages=64, torch_compile=True)


def test_compiled_step_gives_the_eager_tokens():
    """Two prompts of different lengths, one prefill step then decode steps of both, greedy: the
    same tokens as eager. fp32, so only the summation order of fused kernels differs; the tiny
    model's logit gaps are far wider than that. (Kept to two shapes: each new shape class
    compiles, about a minute each on 2 CPU cores.)"""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (9, 23)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (6, 6)]
    outputs = {}
    for compiled in (False, True):
        llm = LLM("tiny", dtype="float32", page_size=16, num_device_pages=64, max_num_seqs=4, torch_compile=compiled)
        outputs[compiled] = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        assert (llm.engine.runner._step == llm.engine.runner.model.step) != compiled
    assert outputs[True] == outputs[False]
    torch._dynamo.reset()
