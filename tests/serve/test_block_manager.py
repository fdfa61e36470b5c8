"""BlockManager: page accounting, hash-chained prefix reuse, LRU reuse of freed pages (no torch)."""

from kvtier.serve.block_manager import BlockManager
from kvtier.serve.params import RequestMetrics, SamplingParams
from kvtier.serve.request import Sequence

PS = 4


def seq(tokens, sid=0):
    return Sequence(sid, list(tokens), SamplingParams(), RequestMetrics(0.0))


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
    assert bm.allocate_cached_prefix(b) == 8 and b.page_ids == a.page_ids[:2]
    assert [bm.ref_counts[p] for p in a.page_ids] == [2, 2, 1]
    same = seq(range(100, 112), 2)  # identical prompt: the last page is recomputed
    assert bm.allocate_cached_prefix(same) == 8


def test_no_reuse_across_salts_or_when_disabled():
    salted = BlockManager(16, PS, salt=b"tenant-a")
    compute(salted, seq(range(12)))
    assert salted.allocate_cached_prefix(seq(range(13), 1)) == 12  # same tenant: all 3 pages reused
    other_tenant = BlockManager(16, PS, salt=b"tenant-b")
    other_tenant.hash_to_page = dict(salted.hash_to_page)  # the other tenant's pages are present
    assert other_tenant.allocate_cached_prefix(seq(range(13), 2)) == 0
    disabled = BlockManager(16, PS, enable_prefix_caching=False)
    compute(disabled, seq(range(12)))
    assert not disabled.hash_to_page and disabled.allocate_cached_prefix(seq(range(13), 3)) == 0


def test_freed_pages_stay_reusable_until_evicted_lru():
    bm = BlockManager(4, PS)
    a = seq(range(8))
    compute(bm, a)
    pages = list(a.page_ids)
    bm.free(a)
    assert bm.num_free_pages == 4
    b = seq(list(range(8)) + [9])
    assert bm.allocate_cached_prefix(b) == 8 and b.page_ids == pages
    bm.free(b)
    # Filling the pool evicts the cached pages; their hashes are dropped with them.
    c = seq(range(500, 516), 2)
    compute(bm, c)
    assert not bm.hash_to_page.keys() & set(b.block_hashes)
    assert bm.allocate_cached_prefix(seq(list(range(8)) + [9], 3)) == 0


def test_tail_pages_are_evicted_before_head_pages():
    bm = BlockManager(6, PS)
    a = seq(range(16))
    compute(bm, a)
    head, tail = a.page_ids[0], a.page_ids[-1]
    bm.free(a)
    order = list(bm.free_pages)
    assert order.index(tail) < order.index(head)


def test_generated_tokens_are_registered_too():
    bm = BlockManager(8, PS)
    a = seq(range(6))
    compute(bm, a)
    a.output_token_ids += [7, 8, 9]
    compute(bm, a)
    b = seq(list(range(6)) + [7, 8, 9, 10], 1)
    assert bm.allocate_cached_prefix(b) == 8
