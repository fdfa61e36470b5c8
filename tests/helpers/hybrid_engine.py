"""The hybrid-engine tests' prompts, sampling params, module-scoped tiny-k3 engine and run-to-end loop."""

from __future__ import annotations

import pytest
import torch

from kvtier import LLM, SamplingParams
from kvtier.serve import Engine


PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True, prompt_logprobs=True)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(1000, 150000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def llm():
    # One intra-op thread, as kvtier bench runs: the tiny model's ops are microseconds, and on a
    # shared 2-core machine a second torch thread's barriers made these tests 10-100x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM("tiny-k3", dtype="float32", page_size=16, num_device_pages=64, max_num_seqs=4)
    torch.set_num_threads(threads)


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams = PARAMS) -> list:
    ids = [engine.add_request(p, params) for p in prompts]
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    return [outs[i] for i in ids]
