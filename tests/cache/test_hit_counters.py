"""A request's blocks are hits once, at the tier that first served them: a block reloaded from a
lower tier after a preemption is credited to that tier in the request's breakdown but is not a
second hit in the pool's counters, and a block the request computed itself is never a hit."""

import torch

from kvtier.cache.config import PoolConfig
from kvtier.cache.cost_model import CostModel, TierCost
from kvtier.cache.kv_state import KVState, TokenList
from kvtier.cache.pool import KVPool, PrefixStart
from kvtier.cache.prefix_index import Tier

PS, PAGES = 4, 8


def _pool() -> KVPool:
    kv = [torch.randn(PAGES, PS, 2) for _ in range(2)]
    pool = KVPool(PoolConfig(page_size=PS, num_device_pages=PAGES, host_cache_bytes=16 * 64), kv)
    pool.tiers.cost_model = CostModel(tiers={Tier.HOST: TierCost(0.0, 1e15)}, prefill_tok_s=1.0)  # always load
    return pool


def _seq(i: int, tokens: list[int]) -> KVState:
    return KVState(TokenList(tokens))


def _place(pool: KVPool, seq: KVState) -> int:
    start = pool.begin_prefix(seq)
    while start is PrefixStart.LOADING and pool.finish_prefix(seq) is None:
        pool.wait_for_loads(0.05)
    seq.num_computed_tokens = pool.finish_prefix(seq)
    return seq.num_computed_tokens


def test_reload_from_host_after_preemption_is_credited_to_host_and_not_counted_twice():
    pool = _pool()
    tokens = list(range(100, 100 + 3 * PS + 1))
    writer = _seq(0, tokens)
    assert pool.allocate(writer, 3 * PS)
    writer.num_computed_tokens = 3 * PS
    pool.register_computed(writer)  # write-through: host copies of its 3 blocks
    pool.poll(wait=True)
    pool.free(writer)

    seq = _seq(1, tokens)
    assert _place(pool, seq) == 3 * PS  # first admission: found on device
    assert pool.stats().hit_tokens == {"device": 3 * PS, "host": 0, "disk": 0}
    pool.free(seq)  # preempted
    seq.num_computed_tokens = 0

    filler = _seq(2, list(range(PAGES * PS + 1)))
    assert pool.allocate(filler, PAGES * PS)  # every page taken: the device copies are evicted
    pool.free(filler)
    assert pool.tiers.index.num_copies(Tier.DEVICE) == 0

    assert _place(pool, seq) == 3 * PS  # re-admission loads them back from host
    assert pool.stats().bytes_loaded["host"] == 3 * 64
    assert seq.prefix_tokens_by_tier["host"] == 3 * PS
    # the first admission's hits stand and are not counted again (kvtier_hit_tokens_total)
    assert pool.stats().hit_tokens == {"device": 3 * PS, "host": 0, "disk": 0}


def test_blocks_loaded_earlier_and_still_on_device_are_not_counted_again():
    pool = _pool()
    tokens = list(range(200, 200 + 2 * PS + 1))
    writer = _seq(0, tokens)
    assert pool.allocate(writer, 2 * PS)
    writer.num_computed_tokens = 2 * PS
    pool.register_computed(writer)
    pool.poll(wait=True)
    pool.free(writer)
    filler = _seq(1, list(range(PAGES * PS + 1)))
    assert pool.allocate(filler, PAGES * PS)
    pool.free(filler)

    seq = _seq(2, tokens)
    assert _place(pool, seq) == 2 * PS  # loaded from host
    pool.free(seq)  # sent back to wait; its loaded blocks stay cached on the device
    seq.num_computed_tokens = 0
    assert _place(pool, seq) == 2 * PS
    assert pool.stats().hit_tokens == {"device": 0, "host": 2 * PS, "disk": 0}
    assert seq.prefix_tokens_by_tier["host"] == 2 * PS


def test_blocks_a_request_computed_itself_are_not_its_hits_after_a_preemption():
    pool = _pool()
    tokens = list(range(300, 300 + 3 * PS + 1))
    seq = _seq(0, tokens)
    assert _place(pool, seq) == 0  # nothing cached: it computes its 3 blocks
    assert pool.allocate(seq, 3 * PS)
    seq.num_computed_tokens = 3 * PS
    pool.register_computed(seq)
    pool.free(seq)  # preempted; its blocks stay cached on the device
    seq.num_computed_tokens = 0
    assert _place(pool, seq) == 3 * PS  # re-admitted: its own blocks placed again
    assert pool.stats().hit_tokens == {"device": 0, "host": 0, "disk": 0}
    assert sum(seq.prefix_tokens_by_tier.values()) == 0
