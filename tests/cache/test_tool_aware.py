"""Tool-aware retention: protected while the tool runs (TTL), demoted after, prefetched before return."""

import pytest
import torch

from kvtier.cache.cost_model import CostModel, TierCost
from kvtier.cache.config import PoolConfig
from kvtier.cache.eviction import ToolAwarePolicy
from kvtier.cache.pool import KVPool
from kvtier.cache.prefix_index import Tier
from tests.helpers.pools import PS, Clock, on_device, run


def make_pool(policy="tool-aware", pages=8):
    config = PoolConfig(page_size=PS, num_device_pages=pages, host_cache_bytes=64 * PS * 8 * 4, cache_policy=policy)
    pool = KVPool(config, [torch.randn(pages, PS, 8)],
                  CostModel(tiers={Tier.HOST: TierCost(0.0, 1e15)}, prefill_tok_s=1.0))
    pool.tiers.clock = Clock()
    return pool


@pytest.mark.parametrize("policy, kept", [("lru", False), ("tool-aware", True)])
def test_waiting_session_keeps_device_blocks_during_its_ttl(policy, kept):
    pool = make_pool(policy)
    agent = run(pool, range(12), 0)  # 3 blocks
    run(pool, range(200, 220), 3)  # 5 blocks: the agent's pages are now the least recently used
    pool.tool_wait("agent", list(range(12)), expected_wait_s=20.0)
    pool.tiers.clock.now += 5.0  # inside the TTL (0.5 * 20 s)
    run(pool, range(100, 112), 1)  # another request needs 3 pages: LRU would take the agent's
    assert all(on_device(pool, agent.block_hashes[:3])) is kept


def test_blocks_are_demoted_after_the_ttl_and_prefetched_before_return():
    pool = make_pool()
    agent = run(pool, range(12), 0)
    hashes = agent.block_hashes[:3]
    assert pool.tiers.index.match(hashes, [Tier.HOST]).shape[0] == 3  # written through to host
    pool.tool_wait("agent", list(range(12)), expected_wait_s=20.0)
    pool.tiers.clock.now += 11.0  # TTL (10 s) over: ordinary victims now
    run(pool, range(100, 132), 1)  # 8 blocks: the whole device pool
    assert not any(on_device(pool, hashes)) and pool.tiers.index.match(hashes, [Tier.HOST]).shape[0] == 3
    pool.tiers.clock.now += 7.5  # 18.5 s: within prefetch_lead_s (2 s) of the expected return
    pool.poll(wait=True)
    assert all(on_device(pool, hashes)) and pool.stats().prefetched_blocks == 3
    back = run(pool, list(range(12)) + [7], 2)  # the returning turn finds its prefix on device
    assert back.prefix_tokens_by_tier["device"] == 12
    pool.tiers.index.check_invariants()


def test_protection_never_blocks_progress():
    pool = make_pool(pages=3)
    run(pool, range(12), 0)
    pool.tool_wait("agent", list(range(12)), expected_wait_s=100.0)
    run(pool, range(50, 62), 1)  # every free page is protected: the oldest is taken anyway
    pool.tool_return("agent")
    with pytest.raises(ValueError, match="expected_wait_s"):
        ToolAwarePolicy().tool_wait("x", [], -1.0, 0.0)


class HeldCopy:
    """A copy handle that has not ended until ``release()``."""

    def __init__(self, handle):
        self.handle, self.ended = handle, False

    def done(self):
        return self.ended and self.handle.done()

    def wait(self, timeout_s=None):
        return self.done()

    def result(self):
        return self.handle.result()

    @property
    def run_s(self):
        return self.handle.run_s


def test_a_prefetch_locks_the_host_copy_it_reads():
    pool = make_pool()
    agent = run(pool, range(12), 0)
    hashes = set(agent.block_hashes[:3])
    pool.tool_wait("agent", list(range(12)), expected_wait_s=20.0)
    pool.tiers.clock.now += 11.0
    run(pool, range(100, 132), 1)  # the agent's device copies are evicted; its host copies stay
    real, held = pool.tiers.copy_engine.scatter, []
    pool.tiers.copy_engine.scatter = lambda *a: held.append(HeldCopy(real(*a))) or held[-1]
    pool.tiers.clock.now += 7.5
    pool.poll()  # the prefetches start; their copies have not ended
    assert len(held) == 3 and len(pool.prefetcher.pending) == 3

    def evictable():
        return {h for h, _ in pool.tiers.index.eviction_candidates(Tier.HOST, 1000)}

    assert not evictable() & hashes  # a copy being read cannot be evicted
    for h in held:
        h.ended = True
    pool.poll(wait=True)
    assert pool.stats().prefetched_blocks == 3 and hashes <= evictable()  # and it is unlocked after
    pool.tiers.index.check_invariants()


def test_returning_session_keeps_others_protection():
    pol = ToolAwarePolicy()
    shared, a_only, b_only = b"s" * 16, b"a" * 16, b"b" * 16
    pol.tool_wait("A", [shared, a_only], expected_wait_s=20.0, now=0.0)
    pol.tool_wait("B", [shared, b_only], expected_wait_s=40.0, now=0.0)
    pol.tool_return("A")
    from collections import OrderedDict
    assert pol.pick_page(OrderedDict.fromkeys([0, 1]), [shared, None], 5.0) == 1  # B still protects shared
    pol.tool_wait("C", [a_only], 100.0, 0.0)
    pol.tool_wait("C", [b_only], 100.0, 0.0)  # a new wait replaces the old one
    pol.tool_return("C")
    assert pol.pick_page(OrderedDict.fromkeys([0]), [a_only], 1.0) == 0 and not pol._protected.get(a_only)


def test_a_tool_wait_must_be_finite():
    with pytest.raises(ValueError, match="expected_wait_s must be a finite number"):
        ToolAwarePolicy().tool_wait("s", [], float("nan"), 0.0)
