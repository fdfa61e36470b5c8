"""End to end through the engine: a prefix evicted from device pages comes back from a lower
tier, and the logits are those of a run that recomputes everything."""

import pytest
import torch

from kvtier import LLM
from kvtier.cache.cost_model import CostModel, TierCost
from kvtier.cache.prefix_index import Tier
from tests.helpers.serving import PS, always_load, prompt
from tests.helpers.tiers import PARAMS, flush_device, reference_logprobs


@pytest.fixture(scope="module")
def shared():
    first = prompt(200, 1)
    second = first[:170] + prompt(30, 2)
    return first, second, reference_logprobs(second)


def test_prefix_comes_back_from_host(shared):
    first, second, want = shared
    llm = always_load(LLM("tiny", page_size=PS, num_device_pages=17, host_cache_bytes=64 << 20))
    llm.generate(prompt_token_ids=[first], sampling_params=PARAMS)
    llm.engine.pool.poll(wait=True)
    flush_device(llm)
    out = llm.generate(prompt_token_ids=[second], sampling_params=PARAMS)[0]
    hit = 170 // PS * PS
    assert out.num_cached_tokens == hit
    assert out.cached_tokens_by_tier["host"] > 0 and sum(out.cached_tokens_by_tier.values()) == hit
    assert out.prompt_logprobs[:hit] == [None] * hit
    got = torch.tensor(out.prompt_logprobs[hit:], dtype=torch.float64)
    ref = torch.tensor(want.prompt_logprobs[hit:], dtype=torch.float64)
    assert float((got - ref).abs().max()) <= 1e-4
    assert out.token_ids == want.token_ids
    stats = llm.engine.pool.stats()
    assert stats.bytes_loaded["host"] > 0 and stats.copy_errors == 0


def test_cost_model_recomputes_when_loading_is_slower(shared):
    first, second, want = shared
    llm = LLM("tiny", page_size=PS, num_device_pages=17, host_cache_bytes=64 << 20)
    llm.engine.pool.tiers.cost_model = CostModel(tiers={Tier.HOST: TierCost(10.0, 1.0)}, prefill_tok_s=1e9)
    llm.generate(prompt_token_ids=[first], sampling_params=PARAMS)
    llm.engine.pool.poll(wait=True)
    flush_device(llm)
    out = llm.generate(prompt_token_ids=[second], sampling_params=PARAMS)[0]
    assert out.num_cached_tokens == 0 and llm.engine.pool.stats().bytes_loaded["host"] == 0
    assert out.token_ids == want.token_ids


def test_failed_host_copy_is_recomputed_and_counted(shared, monkeypatch):
    first, second, want = shared
    llm = always_load(LLM("tiny", page_size=PS, num_device_pages=17, host_cache_bytes=64 << 20))
    llm.generate(prompt_token_ids=[first], sampling_params=PARAMS)
    llm.engine.pool.poll(wait=True)
    flush_device(llm)
    pool = llm.engine.pool
    real_scatter = pool.tiers.copy_engine.scatter
    calls = []

    def failing(staging, pools, pages):  # the prefix's host blocks load in one job: it fails
        calls.append(pages)
        return real_scatter(staging, pools, [10**9] * len(pages))

    monkeypatch.setattr(pool.tiers.copy_engine, "scatter", failing)
    out = llm.generate(prompt_token_ids=[second], sampling_params=PARAMS)[0]
    assert len(calls) == 1 and len(calls[0]) > 2
    assert out.num_cached_tokens == 0  # nothing of the failed job is used: recomputed
    assert pool.stats().copy_errors == len(calls[0])
    got = torch.tensor(out.prompt_logprobs, dtype=torch.float64)
    ref = torch.tensor(want.prompt_logprobs, dtype=torch.float64)
    assert float((got - ref).abs().max()) <= 1e-4 and out.token_ids == want.token_ids


def test_write_back_copies_only_on_eviction(shared):
    first, second, want = shared
    llm = always_load(LLM("tiny", page_size=PS, num_device_pages=17, host_cache_bytes=64 << 20,
                          write_policy="write-back"))
    llm.generate(prompt_token_ids=[first], sampling_params=PARAMS)
    pool = llm.engine.pool
    assert pool.stats().bytes_written["host"] == 0 and not pool.writes.pending  # nothing copied yet
    flush_device(llm)
    assert pool.stats().bytes_written["host"] > 0
    out = llm.generate(prompt_token_ids=[second], sampling_params=PARAMS)[0]
    assert out.cached_tokens_by_tier["host"] > 0 and out.token_ids == want.token_ids
    hit = out.num_cached_tokens
    got = torch.tensor(out.prompt_logprobs[hit:], dtype=torch.float64)
    assert float((got - torch.tensor(want.prompt_logprobs[hit:], dtype=torch.float64)).abs().max()) <= 1e-4
