"""KVPool, device tier only: page accounting, hash-chained prefix reuse, LRU reuse of freed pages."""

import torch

from kvtier.cache.config import PoolConfig
from kvtier.cache.kv_state import KVState, TokenList
from kvtier.cache.pool import KVPool, PrefixStart

PS = 4


def BlockManager(num_pages, page_size, salt=b"", enable_prefix_caching=True):
    config = PoolConfig(page_size=page_size, num_device_pages=num_pages, salt=salt,
                        enable_prefix_caching=enable_prefix_caching)
    return KVPool(config, [torch.zeros(num_pages, page_size, 8)])


def seq(tokens, sid=0):
    return KVState(TokenList(tokens))


def begin_prefix_tokens(bm, s):
    assert bm.begin_prefix(s) is PrefixStart.READY  # device-only: nothing to wait for
    s.num_computed_tokens = bm.finish_prefix(s)  # the caller owns the progress
    return s.num_computed_tokens


def compute(bm, s, upto=None):
    """Pretend the model computed the sequence up to ``upto`` tokens."""
    upto = s.num_tokens if upto is None else upto
    assert bm.allocate(s, upto)
    s.num_computed_tokens = upto
    bm.register_computed(s)


def test_allocation_and_free_accounting():
    bm = BlockManager(8, PS)
    a = seq(range(10))
    assert bm.allocate(a, 10) and len(a.page_ids) == 3 and bm.num_free_pages == 5
    assert not bm.allocate(seq(range(40), 1), 40)  # needs 10 pages: refused, nothing taken
    assert bm.num_free_pages == 5
    bm.free(a)
    assert bm.num_free_pages == 8 and a.page_ids == []


def test_prefix_reuse_shares_pages_and_leaves_one_token():
    bm = BlockManager(16, PS)
    a = seq(range(100, 112))  # exactly 3 full pages
    compute(bm, a)
    b = seq(list(range(100, 108)) + [1, 2, 3])
    assert begin_prefix_tokens(bm, b) == 8 and b.page_ids == a.page_ids[:2]
    assert [bm.pages.ref_counts[p] for p in a.page_ids] == [2, 2, 1]
    same = seq(range(100, 112), 2)  # identical prompt: the last page is recomputed
    assert begin_prefix_tokens(bm, same) == 8


def test_no_reuse_across_salts_or_when_disabled():
    salted = BlockManager(16, PS, salt=b"tenant-a")
    compute(salted, seq(range(12)))
    assert begin_prefix_tokens(salted, seq(range(13), 1)) == 12  # same tenant: all 3 pages reused
    other_tenant = BlockManager(16, PS, salt=b"tenant-b")
    other_tenant.tiers.index = salted.tiers.index  # the other tenant's blocks are present
    assert begin_prefix_tokens(other_tenant, seq(range(13), 2)) == 0
    disabled = BlockManager(16, PS, enable_prefix_caching=False)
    compute(disabled, seq(range(12)))
    assert disabled.tiers.index.num_blocks() == 0 and begin_prefix_tokens(disabled, seq(range(13), 3)) == 0


def test_freed_pages_stay_reusable_until_evicted_lru():
    bm = BlockManager(4, PS)
    a = seq(range(8))
    compute(bm, a)
    pages = list(a.page_ids)
    bm.free(a)
    assert bm.num_free_pages == 4
    b = seq(list(range(8)) + [9])
    assert begin_prefix_tokens(bm, b) == 8 and b.page_ids == pages
    bm.free(b)
    # Filling the pool evicts the cached pages; their hashes are dropped with them.
    c = seq(range(500, 516), 2)
    compute(bm, c)
    assert bm.tiers.index.match(b.block_hashes).shape[0] == 0
    assert begin_prefix_tokens(bm, seq(list(range(8)) + [9], 3)) == 0


def test_tail_pages_are_evicted_before_head_pages():
    bm = BlockManager(6, PS)
    a = seq(range(16))
    compute(bm, a)
    head, tail = a.page_ids[0], a.page_ids[-1]
    bm.free(a)
    order = list(bm.pages.free_pages)
    assert order.index(tail) < order.index(head)


def test_generated_tokens_are_registered_too():
    bm = BlockManager(8, PS)
    a = seq(range(6))
    compute(bm, a)
    a.tokens.ids += [7, 8, 9]  # generated
    compute(bm, a)
    b = seq(list(range(6)) + [7, 8, 9, 10], 1)
    assert begin_prefix_tokens(bm, b) == 8
