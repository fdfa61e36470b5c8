"""PrefixIndex through Python: longest-prefix match, locks, LRU, events, errors, threads."""

import random
import threading

import pytest

from kvtier.cache import PrefixIndex, RemoveResult, Tier, block_hashes


def chain(n, start=0):
    return block_hashes(list(range(start, start + 16 * n)), 16)


def test_match_reports_every_tier_of_the_longest_prefix():
    idx = PrefixIndex()
    hs = chain(6)
    idx.insert(hs[0], Tier.DEVICE, 3)
    idx.insert(hs[0], Tier.DISK, 40)
    idx.insert(hs[1], Tier.HOST, 9)
    idx.insert(hs[2], Tier.DISK, 41)
    idx.insert(hs[4], Tier.DEVICE, 5)  # after a gap: never part of the match
    got = idx.match(hs)
    assert got.tolist() == [[3, -1, 40, -1], [-1, 9, -1, -1], [-1, -1, 41, -1]]
    assert idx.match(hs, tiers=[Tier.DEVICE, Tier.HOST]).shape == (2, 4)
    assert idx.match(hs, tiers=[Tier.HOST]).shape == (0, 4)
    assert idx.match([]).shape == (0, 4)


def test_locked_copies_are_neither_removed_nor_evicted():
    idx = PrefixIndex()
    hs = chain(3)
    for i, h in enumerate(hs):
        idx.insert(h, Tier.HOST, i)
    assert idx.lock(hs[:2], Tier.HOST) and idx.lock(hs[:1], Tier.HOST)
    assert idx.ref_count(hs[0], Tier.HOST) == 2
    assert idx.remove(hs[0], Tier.HOST) == (RemoveResult.LOCKED, -1)
    assert idx.eviction_candidates(Tier.HOST, 10) == [(hs[2], 2)]
    assert not idx.lock(hs, Tier.DEVICE)  # no device copies: all-or-nothing
    assert idx.unlock(hs[:2], Tier.HOST) and idx.unlock(hs[:1], Tier.HOST)
    assert not idx.unlock(hs[:1], Tier.HOST)
    assert idx.remove(hs[0], Tier.HOST) == (RemoveResult.REMOVED, 0)
    assert idx.remove(hs[0], Tier.HOST) == (RemoveResult.ABSENT, -1)
    idx.check_invariants()


def test_lru_order_follows_touch_and_events_are_bounded():
    idx = PrefixIndex(max_events=4)
    hs = chain(5)
    for i, h in enumerate(hs):
        idx.insert(h, Tier.DEVICE, i)
    idx.touch(hs[:2])
    assert [s for _, s in idx.eviction_candidates(Tier.DEVICE, 5)] == [2, 3, 4, 0, 1]
    events = idx.drain_events()
    assert [(e.added, e.tier, e.slot) for e in events] == [(True, Tier.DEVICE, s) for s in (1, 2, 3, 4)]
    assert idx.dropped_events == 1
    assert not idx.insert(hs[0], Tier.DEVICE, 99)  # never overwritten
    assert idx.match(hs[:1]).tolist() == [[0, -1, -1, -1]]


def test_batch_calls_match_their_one_block_forms():
    idx = PrefixIndex()
    hs = chain(5)
    idx.insert(hs[1], Tier.HOST, 1)
    assert idx.insert_many(hs[:4], Tier.HOST, [10, 11, 12, 13]).tolist() == [True, False, True, True]
    assert idx.match(hs[:4], tiers=[Tier.HOST])[:, Tier.HOST].tolist() == [10, 1, 12, 13]
    idx.insert(hs[3], Tier.DISK, 0)
    assert idx.held(hs, Tier.DISK).tolist() == [False, False, False, True, False]
    assert idx.held(hs, Tier.HOST).tolist() == [True, True, True, True, False]
    assert idx.lock(hs[2:3], Tier.HOST)
    results, slots = idx.remove_many(hs, Tier.HOST)
    assert [RemoveResult(r) for r in results.tolist()] == [
        RemoveResult.REMOVED, RemoveResult.REMOVED, RemoveResult.LOCKED, RemoveResult.REMOVED, RemoveResult.ABSENT]
    assert slots.tolist() == [10, 1, -1, 13, -1]
    assert idx.num_copies(Tier.HOST) == 1 and idx.num_blocks() == 2
    idx.check_invariants()
    assert idx.insert_many([], Tier.DEVICE, []).tolist() == []


def test_touch_can_keep_to_some_tiers():
    idx = PrefixIndex()
    hs = chain(3)
    for i, h in enumerate(hs):
        idx.insert(h, Tier.DEVICE, i)
        idx.insert(h, Tier.HOST, i)
    idx.touch(hs[:1], [Tier.HOST])
    assert [s for _, s in idx.eviction_candidates(Tier.HOST, 3)] == [1, 2, 0]
    assert [s for _, s in idx.eviction_candidates(Tier.DEVICE, 3)] == [0, 1, 2]


@pytest.mark.parametrize("call, match", [
    (lambda idx: idx.insert(b"short", Tier.HOST, 0), "must be bytes of length 16"),
    (lambda idx: idx.insert(bytes(16), 7, 0), "tier must be in"),
    (lambda idx: idx.insert(bytes(16), Tier.HOST, -2), "slot must be >= 0"),
    (lambda idx: idx.match([bytes(16), "x"]), r"hashes\[1\]"),
    (lambda idx: idx.insert_many([bytes(16), bytes(range(16))], Tier.HOST, [0, -1]), "slot must be >= 0"),
    (lambda idx: idx.insert_many([bytes(16)], Tier.HOST, [0, 1]), "one slot per hash"),
    (lambda idx: idx.held([bytes(16), b"x"], Tier.HOST), r"hashes\[1\]"),
])
def test_bad_arguments_are_named(call, match):
    idx = PrefixIndex()
    with pytest.raises(ValueError, match=match):
        call(idx)
    assert idx.num_blocks() == 0


def test_threads_keep_the_index_consistent():
    """Python threads run truly concurrently here (the index releases the GIL)."""
    idx = PrefixIndex(max_events=256)
    hs = chain(200)
    slots_lock = threading.Lock()
    free = {t: list(range(64)) for t in (Tier.DEVICE, Tier.HOST)}
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        held = []
        for _ in range(3000):
            tier, h = rng.choice([Tier.DEVICE, Tier.HOST]), rng.choice(hs)
            op = rng.randrange(5)
            if op < 2:
                with slots_lock:
                    slot = free[tier].pop() if free[tier] else None
                if slot is not None and not idx.insert(h, tier, slot):
                    with slots_lock:
                        free[tier].append(slot)
            elif op == 2 and idx.lock([h], tier):
                held.append((h, tier))
            elif op == 3:
                for hh, s in idx.eviction_candidates(tier, 2):
                    res, slot = idx.remove(hh, tier)
                    if res == RemoveResult.REMOVED:
                        with slots_lock:
                            free[tier].append(slot)
            else:
                idx.match(hs[rng.randrange(150):][:50])
        for hh, t in held:
            if not idx.unlock([hh], t):
                errors.append("unlock failed")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    idx.check_invariants()
    for tier in (Tier.DEVICE, Tier.HOST):
        indexed = [s for _, s in idx.eviction_candidates(tier, 1000)]
        assert sorted(indexed + free[tier]) == list(range(64))  # nothing lost, nothing twice
