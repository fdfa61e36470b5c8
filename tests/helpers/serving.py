"""Shared builders of serving tests: prompts, a cost model under which loads always win, and
tiny engines whose host tier holds a few prompts' blocks (over the model, or over the
model-free stand-in of :mod:`tests.helpers.engines`)."""

import torch

from kvtier import LLM, SamplingParams
from kvtier.cache.cost_model import CostModel, TierCost
from kvtier.cache.kv_state import KVState, TokenList
from kvtier.cache.prefix_index import Tier

PS, BLOCK = 16, 15360  # the page size these tests use, and the bytes of one block of the tiny preset
N = 8 * PS + 1  # 8 full blocks and one token
ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    """``n`` token ids drawn from the tiny preset's vocabulary by ``seed``."""
    return torch.randint(0, 163840, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def always_load(llm):
    """A cost model under which loading always wins (the decision itself is tested elsewhere)."""
    llm.engine.pool.tiers.cost_model = CostModel(tiers={t: TierCost(0.0, 1e15) for t in (Tier.HOST, Tier.DISK)},
                                                 prefill_tok_s=1.0)
    return llm


def host_cached(*prompts, num_device_pages=10, schedule_policy="cache-aware", llm=LLM, preemption_mode="recompute"):
    """A tiny engine (``llm``: ``LLM`` or :class:`tests.helpers.engines.StandInLLM`) whose host
    tier holds ``prompts``' blocks and whose device pages do not."""
    built = always_load(llm("tiny", page_size=PS, num_device_pages=num_device_pages, host_cache_bytes=64 * BLOCK,
                            schedule_policy=schedule_policy, preemption_mode=preemption_mode))
    for p in (*prompts, prompt(N, 901), prompt(N, 902)):
        built.generate(prompt_token_ids=[p], sampling_params=ONE)
    built.engine.pool.poll(wait=True)
    return built


def occupy(pool, num_pages: int) -> KVState:
    """A request's KV state holding ``num_pages`` device pages."""
    ps = pool.config.page_size
    s = KVState(TokenList(range(num_pages * ps)))
    assert pool.allocate(s, num_pages * ps)
    return s
