"""End-to-end tier tests' sampling params, reference run, device flush and warm-and-compare checks (tiny preset)."""

import dataclasses

import torch

from kvtier import LLM, SamplingParams
from tests.helpers.serving import PS, prompt

PARAMS = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=True, ignore_eos=True)
HOST_BYTES = 2 * 15360  # two tiny-preset blocks: the prefix cannot stay in host memory


def reference_logprobs(p):
    llm = LLM("tiny", page_size=PS, num_device_pages=64, enable_prefix_caching=False)
    return llm.generate(prompt_token_ids=[p], sampling_params=PARAMS)[0]


def flush_device(llm, n_prompts=2):
    """Run unrelated prompts that take every device page, so cached device copies are evicted."""
    for i in range(n_prompts):
        llm.generate(prompt_token_ids=[prompt(250, 100 + i)], sampling_params=dataclasses.replace(PARAMS, max_tokens=1))


def warm(llm, first):
    llm.generate(prompt_token_ids=[first], sampling_params=PARAMS)
    llm.engine.pool.poll(wait=True)
    flush_device(llm)
    llm.engine.pool.poll(wait=True)


def assert_matches(out, want, min_hit):
    hit = out.num_cached_tokens
    assert hit >= min_hit
    assert out.prompt_logprobs[:hit] == [None] * hit
    got = torch.tensor(out.prompt_logprobs[hit:], dtype=torch.float64)
    ref = torch.tensor(want.prompt_logprobs[hit:], dtype=torch.float64)
    assert float((got - ref).abs().max()) <= 1e-4
    assert out.token_ids == want.token_ids
