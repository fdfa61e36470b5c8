"""Logit parity with transformers' DeepseekV3ForCausalLM on the same weights (fp32).

Every engine here runs on adversarial pages: the whole page pool is NaN before use (so unused
pages and the unused tail slots of partly filled pages are NaN) and the free-page order is
shuffled (so block tables are not monotone).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtier import SamplingParams
from kvtier.model import YarnScaling, preset
from tests.helpers.poisoned_engines import PAGE_SIZE, poisoned_llm
from tests.hf_reference import hf_log_softmax, hf_token_logprobs, make_hf_checkpoint

ATOL = 1e-4  # fp32 vs fp32; the contract

# (1) grouped routing with topk_group < n_group and no query compression;
# (2) K2-like: q_lora_rank set, one group, YaRN factor 64, full Kimi vocabulary.
CONFIGS = {
    "grouped-noqlora": dataclasses.replace(
        preset("tiny"), vocab_size=4099, q_lora_rank=None, n_routed_experts=16, n_group=4, topk_group=2,
        num_experts_per_tok=3, rope_scaling=YarnScaling(factor=32.0, original_max_position_embeddings=128,
                                                        beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)),
    "yarn64-k2like": dataclasses.replace(
        preset("tiny"), n_group=1, topk_group=1, num_experts_per_tok=4, n_routed_experts=12,
        rope_scaling=YarnScaling(factor=64.0, original_max_position_embeddings=128, beta_fast=1.0, beta_slow=1.0,
                                 mscale=1.0, mscale_all_dim=1.0)),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def hf_pair(request, tmp_path_factory):
    config = CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    model = make_hf_checkpoint(config, path, seed=1234)
    return config, path, model


def random_prompt(config, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (n,), generator=g).tolist()


def assert_logprobs_close(ours, theirs, what):
    ours = torch.tensor(ours, dtype=torch.float64)
    theirs = theirs.double()
    err = (ours - theirs).abs()
    worst = int(err.argmax())
    assert float(err.max()) <= ATOL, f"{what}: max |diff| {float(err.max()):.3g} at {worst} " \
                                     f"(ours {float(ours[worst]):.6f}, hf {float(theirs[worst]):.6f})"


@pytest.mark.parametrize("chunk", [4096, 37], ids=["whole", "chunks37"])
def test_prompt_logprobs(hf_pair, chunk):
    config, path, hf = hf_pair
    prompt = random_prompt(config, 317, seed=7)
    llm = poisoned_llm(path, max_num_batched_tokens=chunk)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=True))[0]
    assert out.num_cached_tokens == 0
    assert len(out.prompt_logprobs) == len(prompt) - 1 and None not in out.prompt_logprobs
    assert_logprobs_close(out.prompt_logprobs, hf_token_logprobs(hf, prompt), f"prompt logprobs, chunk {chunk}")


def test_shared_prefix_served_from_cache(hf_pair):
    config, path, hf = hf_pair
    first = random_prompt(config, 317, seed=8)
    second = first[:205] + random_prompt(config, 111, seed=9)
    llm = poisoned_llm(path, seed=1, max_num_batched_tokens=37)
    params = SamplingParams(max_tokens=2, prompt_logprobs=True)
    llm.generate(prompt_token_ids=[first], sampling_params=params)
    out = llm.generate(prompt_token_ids=[second], sampling_params=params)[0]
    assert out.num_cached_tokens == 205 // PAGE_SIZE * PAGE_SIZE
    cached = out.num_cached_tokens
    assert out.prompt_logprobs[:cached] == [None] * cached
    assert None not in out.prompt_logprobs[cached:]
    ref = hf_token_logprobs(hf, second)
    assert_logprobs_close(out.prompt_logprobs[cached:], ref[cached:], "prompt logprobs after a cached prefix")


def test_greedy_decode_16_steps(hf_pair):
    """Two prompts decoded together with chunked prefill: mixed extend + decode steps."""
    config, path, hf = hf_pair
    prompts = [random_prompt(config, 301, seed=10), random_prompt(config, 45, seed=11)]
    llm = poisoned_llm(path, seed=2, max_num_batched_tokens=37)
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=True, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for prompt, out in zip(prompts, outs):
        assert len(out.token_ids) == 16
        full = prompt + out.token_ids
        ref = hf_log_softmax(hf, full)[len(prompt) - 1 : -1]  # the 16 decode positions
        chosen = ref.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
        assert_logprobs_close(out.logprobs, chosen, "decode logprobs")
        # Greedy: each chosen token is the reference's best up to the tolerance (no near-tie flips).
        gap = ref.max(-1).values - chosen
        assert float(gap.max()) <= ATOL, f"token not greedy under the reference: gap {gap.tolist()}"
