"""A model-free pool with a resume target over a host tier whose every load costs LOAD_LATENCY_S."""

import torch

from kvtier.cache.config import PoolConfig
from kvtier.cache.cost_model import CostModel, TierCost
from kvtier.cache.pool import KVPool
from kvtier.cache.prefix_index import Tier
from tests.helpers.pools import PS, Clock


LOAD_LATENCY_S = 1.0  # the host tier's cost per load: every prefix of blocks loads in ~1 s


def make_pool(policy="tool-aware", pages=8, target=2.0):
    config = PoolConfig(page_size=PS, num_device_pages=pages, host_cache_bytes=64 * PS * 8 * 4, cache_policy=policy)
    pool = KVPool(config, [torch.randn(pages, PS, 8)],
                  CostModel(tiers={Tier.HOST: TierCost(LOAD_LATENCY_S, 1e15)}, prefill_tok_s=1.0))
    pool.tiers.clock = Clock()
    pool.set_resume_target(target)
    return pool
