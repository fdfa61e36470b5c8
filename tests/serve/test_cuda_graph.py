"""``LLM(..., cuda_graph=True)``: decode steps replayed from graphs captured per padded batch size.

On CPU the option is refused with an error naming it; on a GPU (``-m gpu``) greedy generation with
graphs gives the same tokens as eager, across batch sizes that pad (3 -> 4) and that do not.
"""

from __future__ import annotations

import pytest
import torch

from kvtier import LLM, EngineConfig, SamplingParams
from kvtier.serve.cuda_graph import graph_batch_sizes


def test_graph_batch_sizes_are_powers_of_two_up_to_the_bound():
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(256)[-1] == 64


def test_cuda_graph_option_is_off_by_default_and_a_bool():
    assert EngineConfig().cuda_graph is False
    with pytest.raises(ValueError, match="cuda_graph must be a bool, got 'yes'"):
        EngineConfig(cuda_graph="yes")


def test_cuda_graph_on_cpu_is_refused_naming_the_option():
    with pytest.raises(ValueError, match=r"cuda_graph=True needs the model on a CUDA/ROCm device, got device 'cpu'"):
        LLM("tiny", dtype="float32", page_size=4, num_device_pages=32, cuda_graph=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
@pytest.mark.parametrize("num_prompts", [1, 3, 8])
def test_graph_replay_gives_the_eager_tokens(num_prompts):
    gen = torch.Generator().manual_seed(num_prompts)
    prompts = [torch.randint(0, 1000, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 40, (num_prompts,), generator=gen)]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    outputs = {}
    for graphs in (False, True):
        llm = LLM("tiny", dtype="float32", device="cuda", page_size=16, num_device_pages=64, max_num_seqs=8,
                  cuda_graph=graphs)
        outputs[graphs] = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        if graphs:
            assert llm.engine.runner.graphs.graphs, "no decode step was replayed from a graph"
    assert outputs[True] == outputs[False]
