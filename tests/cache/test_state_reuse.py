"""No half restores (kvtier/cache/checkpoints/reuse.py): a hybrid pool places a cached prefix only with the
recurrent-state checkpoint at exactly its end. Every single-object failure -- a checkpoint that is
missing, corrupt, short or stored under another key in the disk or remote tier, an MLA block whose
load fails -- falls back to the longest earlier point whose blocks and checkpoint both read back,
and is counted. Also: the options' bad values are errors naming them."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from kvtier.cache.checkpoints.store import CheckpointKind
from kvtier.cache.config import PoolConfig
from kvtier.cache.cost_model import CostModel, TierCost
from kvtier.cache.disk_tier import BlockMeta
from kvtier.cache.kv_state import KVState, TokenList
from kvtier.cache.pool import KVPool
from kvtier.cache.prefix_index import Tier
from kvtier.cache.remote import RemoteTier
from tests.helpers.memory_store import MemoryBackend

PS = 4                   # tokens per page
PAGES = 24               # device pages
CK = 1000                # bytes of one checkpoint
NUM_BLOCKS = 8           # blocks of the saved sequence (32 tokens)
POINTS = (2, 4, 6, 8)    # boundaries (in blocks) with a checkpoint


def always_load() -> CostModel:
    """Loading any block or checkpoint beats recomputing (the price itself is tested elsewhere)."""
    return CostModel(tiers={t: TierCost(0.0, 1e15) for t in (Tier.HOST, Tier.DISK, Tier.REMOTE)}, prefill_tok_s=1.0)


def make_pool(tmp_path, backend: MemoryBackend | None = None, host_blocks: int = 64, **state) -> KVPool:
    caches = [torch.zeros(PAGES, PS, 8)]
    budgets = dict(state_checkpoint_bytes=CK, state_device_bytes=8 * CK, state_host_bytes=8 * CK,
                   state_disk_bytes=8 * 8192)
    budgets.update(state)
    config = PoolConfig(page_size=PS, num_device_pages=PAGES, host_cache_bytes=host_blocks * PS * 8 * 4,
                        disk_cache_dir=str(tmp_path / "disk"), disk_cache_bytes=1 << 20, **budgets)
    remote = RemoteTier(backend, BlockMeta.of_pools(caches), timeout_s=5.0) if backend is not None else None
    return KVPool(config, caches, always_load(), remote=remote)


def tokens(seed: int, n: int = NUM_BLOCKS * PS) -> list[int]:
    return torch.randint(0, 50000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def compute(pool: KVPool, ids: list[int], seed: int = 0) -> tuple[KVState, dict[int, torch.Tensor]]:
    """Run ``ids`` through the pool as a computed request (random page contents), save a random
    checkpoint at each of :data:`POINTS`, wait for every write, free it. Returns the request and
    the payloads by boundary block."""
    kv = KVState(TokenList(ids))
    pool.begin_prefix(kv)
    assert pool.finish_prefix(kv) == 0
    assert pool.allocate(kv, len(ids))
    g = torch.Generator().manual_seed(seed)
    for p in kv.page_ids:
        pool.kv_caches[0][p] = torch.randn(PS, 8, generator=g)
    kv.num_computed_tokens = len(ids)
    pool.register_computed(kv)
    payloads = {}
    for k in POINTS:
        payloads[k] = torch.randint(0, 256, (CK,), dtype=torch.uint8, generator=g)
        kind = CheckpointKind.TURN if k == NUM_BLOCKS else CheckpointKind.GRID
        assert pool.save_checkpoint(kv, k * PS, payloads[k], kind)
    pool.poll(wait=True)
    pool.free(kv)
    return kv, payloads


def restore(pool: KVPool, ids: list[int]) -> KVState:
    """Place the cached prefix of ``ids`` plus one new token (all of ``ids`` is reusable)."""
    kv = KVState(TokenList(ids + [7]))
    pool.begin_prefix(kv)
    pool.wait_prefix(kv)
    return kv


def assert_placed(pool: KVPool, kv: KVState, payloads: dict[int, torch.Tensor], k: int) -> None:
    """Exactly ``k`` blocks and the checkpoint saved after them are placed (nothing for k == 0);
    the pool hands the checkpoint over once."""
    assert kv.num_prefix_tokens == k * PS
    assert len(kv.page_ids) == k
    restored = pool.take_restore(kv)
    if k == 0:
        assert restored is None
    else:
        assert restored is not None and restored.num_tokens == k * PS
        assert torch.equal(restored.payload.cpu(), payloads[k])
        assert pool.take_restore(kv) is None


def only_in(pool: KVPool, key: bytes, tier: Tier) -> None:
    """Drop every copy of checkpoint ``key`` except the one in ``tier``."""
    store = pool.resume_rule.store
    for t in (Tier.DEVICE, Tier.HOST, Tier.DISK, Tier.REMOTE):
        if t != tier:
            store.drop(key, t)
    assert store.where(key) == [tier]


def keys(kv: KVState) -> dict[int, bytes]:
    return {k: kv.block_hashes[k - 1] for k in POINTS}


# ---- every copy good: each tier serves the checkpoint ----------------------------------------------
@pytest.mark.parametrize("tier", [Tier.DEVICE, Tier.HOST, Tier.DISK, Tier.REMOTE])
def test_checkpoint_and_blocks_restored_together_from_each_tier(tmp_path, tier):
    pool = make_pool(tmp_path, MemoryBackend())
    ids = tokens(1)
    kv, payloads = compute(pool, ids)
    for key in keys(kv).values():
        only_in(pool, key, tier)
    got = restore(pool, ids)
    assert_placed(pool, got, payloads, NUM_BLOCKS)
    s = pool.stats().sections["state"]
    assert s.hits[tier.name.lower()] == 1 and sum(s.hits.values()) == 1
    assert s.fallbacks == 0 and sum(s.failures.values()) == 0
    pool.close()


# ---- one bad checkpoint: the longest earlier valid point, counted -----------------------------------
def _disk_path(pool: KVPool, key: bytes):
    return pool.resume_rule.store.stores[Tier.DISK].disk.path(key)


def _remote_key(pool: KVPool, key: bytes) -> str:
    return pool.resume_rule.store.stores[Tier.REMOTE].remote.key(key)


def lose(pool, backend, tier, key, other):
    if tier == Tier.DISK:
        os.remove(_disk_path(pool, key))
    else:
        del backend.values[_remote_key(pool, key)]


def corrupt(pool, backend, tier, key, other):
    if tier == Tier.DISK:
        path = _disk_path(pool, key)
        data = bytearray(path.read_bytes())
        data[4096 + 17] ^= 0x40  # a payload byte (after the 4096-byte header)
        path.write_bytes(bytes(data))
    else:
        v = bytearray(backend.values[_remote_key(pool, key)])
        v[64 + 17] ^= 0x40  # a payload byte (after the 64-byte header)
        backend.values[_remote_key(pool, key)] = bytes(v)


def shorten(pool, backend, tier, key, other):
    if tier == Tier.DISK:
        path = _disk_path(pool, key)
        os.truncate(path, os.path.getsize(path) - 4096)
    else:
        backend.values[_remote_key(pool, key)] = backend.values[_remote_key(pool, key)][:-1]


def wrong_key(pool, backend, tier, key, other):
    """The copy of ``key`` replaced by the (intact) checkpoint stored under ``other``."""
    if tier == Tier.DISK:
        shutil.copyfile(_disk_path(pool, other), _disk_path(pool, key))
    else:
        backend.values[_remote_key(pool, key)] = backend.values[_remote_key(pool, other)]


# What each tier reports a damaged copy as (StateStats.failures keys). The native disk tier checks
# header, size, key and CRC on every read and reports each failed check as CORRUPT, as does the
# remote tier's value check: a short read or a wrong key is a failed check ("corrupt").
FAULTS = {"missing": (lose, "missing"), "corrupt": (corrupt, "corrupt"), "short": (shorten, "corrupt"),
          "wrong-key": (wrong_key, "corrupt")}


@pytest.mark.parametrize("tier", [Tier.DISK, Tier.REMOTE])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_bad_checkpoint_falls_back_to_the_last_valid_point(tmp_path, tier, fault):
    backend = MemoryBackend()
    pool = make_pool(tmp_path, backend)
    ids = tokens(2)
    kv, payloads = compute(pool, ids)
    ks = keys(kv)
    for key in ks.values():
        only_in(pool, key, tier)
    damage, reason = FAULTS[fault]
    damage(pool, backend, tier, ks[8], ks[4])
    got = restore(pool, ids)
    assert_placed(pool, got, payloads, 6)  # the checkpoint at 8 blocks failed: the one at 6 with its blocks
    s = pool.stats().sections["state"]
    assert s.fallbacks == 1
    assert s.failures[reason] == 1 and sum(s.failures.values()) == 1
    assert s.hits[tier.name.lower()] == 1 and sum(s.hits.values()) == 1
    assert tier not in pool.resume_rule.store.where(ks[8])  # the bad copy is dropped from the index
    pool.close()


@pytest.mark.parametrize("tier", [Tier.DISK, Tier.REMOTE])
def test_every_checkpoint_bad_computes_from_token_zero(tmp_path, tier):
    backend = MemoryBackend()
    pool = make_pool(tmp_path, backend)
    ids = tokens(3)
    kv, payloads = compute(pool, ids)
    ks = keys(kv)
    for key in ks.values():
        only_in(pool, key, tier)
        corrupt(pool, backend, tier, key, None)
    got = restore(pool, ids)
    assert_placed(pool, got, payloads, 0)
    s = pool.stats().sections["state"]
    assert s.fallbacks == 1 and s.failures["corrupt"] == len(POINTS) and sum(s.hits.values()) == 0
    assert pool.num_free_pages == PAGES  # no page kept for blocks placed without their state
    pool.close()


def test_a_second_fault_on_the_fallback_path_falls_back_further(tmp_path):
    """The checkpoints at 8 and 6 blocks are both bad: the one at 4 is placed."""
    pool = make_pool(tmp_path)
    ids = tokens(4)
    kv, payloads = compute(pool, ids)
    ks = keys(kv)
    for key in ks.values():
        only_in(pool, key, Tier.DISK)
    corrupt(pool, None, Tier.DISK, ks[8], None)
    lose(pool, None, Tier.DISK, ks[6], None)
    got = restore(pool, ids)
    assert_placed(pool, got, payloads, 4)
    s = pool.stats().sections["state"]
    assert s.fallbacks == 1 and s.failures["corrupt"] == 1 and s.failures["missing"] == 1
    pool.close()


def test_checkpoint_dropped_from_every_tier_resumes_at_the_one_before(tmp_path):
    """A checkpoint no tier holds is not a resume point: its blocks are matched but not placed
    (counted as tokens lost), with no read that fails."""
    pool = make_pool(tmp_path, MemoryBackend())
    ids = tokens(5)
    kv, payloads = compute(pool, ids)
    ks = keys(kv)
    store = pool.resume_rule.store
    for t in (Tier.DEVICE, Tier.HOST, Tier.DISK):
        store.drop(ks[8], t)
    remote = store.stores[Tier.REMOTE].remote
    del remote.backend.values[remote.key(ks[8])]
    store.drop(ks[8], Tier.REMOTE)
    got = restore(pool, ids)
    assert_placed(pool, got, payloads, 6)
    s = pool.stats().sections["state"]
    assert s.tokens_lost == 2 * PS and s.fallbacks == 0 and sum(s.failures.values()) == 0
    pool.close()


# ---- one bad MLA block: the checkpoint after it is never placed alone ---------------------------------
def flush_device(pool: KVPool, seed: int) -> None:
    """Compute an unrelated request over every device page: cached device copies are evicted."""
    kv = KVState(TokenList(tokens(seed, PAGES * PS)))
    pool.begin_prefix(kv)
    pool.finish_prefix(kv)
    assert pool.allocate(kv, PAGES * PS)
    kv.num_computed_tokens = PAGES * PS
    pool.register_computed(kv)  # written through to the host tier, whose slots it takes
    pool.poll(wait=True)
    pool.free(kv)


@pytest.mark.parametrize("damage", ["lose", "corrupt"])
def test_failed_block_load_falls_back_below_it(tmp_path, damage):
    """The blocks come back from disk (the host tier holds none of them); block 5's file is lost or
    corrupt: the checkpoints at 6 and 8 blocks are intact but cannot be placed without it, so the
    prefix is 4 blocks with the checkpoint there."""
    pool = make_pool(tmp_path, host_blocks=1)
    ids = tokens(6)
    kv, payloads = compute(pool, ids)
    flush_device(pool, 60)
    flush_device(pool, 61)  # the host slot now holds an unrelated block
    disk = pool.tiers.disk
    hashes = kv.block_hashes
    assert all(pool.tiers.index.held([h], Tier.DISK)[0] for h in hashes)
    assert not any(pool.tiers.index.held([h], Tier.DEVICE)[0] or pool.tiers.index.held([h], Tier.HOST)[0]
                   for h in hashes)
    path = disk.path(hashes[4])
    if damage == "lose":
        os.remove(path)
    else:
        data = bytearray(path.read_bytes())
        data[4096 + 5] ^= 0x01  # a payload byte (after the 4096-byte header)
        path.write_bytes(bytes(data))
    got = restore(pool, ids)
    assert_placed(pool, got, payloads, 4)
    assert torch.equal(pool.kv_caches[0][got.page_ids[3]], page_written(3))
    s = pool.stats().sections["state"]
    assert s.fallbacks == 1 and sum(s.failures.values()) == 0  # the checkpoints themselves were fine
    assert sum(s.hits.values()) == 1
    pool.close()


def page_written(b: int) -> torch.Tensor:
    """The page contents :func:`compute` (seed 0) wrote for block ``b`` (the same generator order)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(PS, 8, generator=g) for _ in range(NUM_BLOCKS)][b]


def test_block_dropped_from_the_index_stops_the_match_below_it(tmp_path):
    """A block no tier holds (evicted everywhere): the match ends before it, so the checkpoints
    after it are out of reach; the point at 4 blocks is placed."""
    pool = make_pool(tmp_path, host_blocks=1)
    ids = tokens(7)
    kv, payloads = compute(pool, ids)
    flush_device(pool, 70)
    flush_device(pool, 71)
    h = kv.block_hashes[4]
    pool.tiers.index.remove(h, Tier.DISK)  # evicted from disk, as the disk budget does
    pool.tiers.stores[Tier.DISK].evict([h])
    got = restore(pool, ids)
    assert_placed(pool, got, payloads, 4)
    s = pool.stats().sections["state"]
    assert s.fallbacks == 0 and sum(s.failures.values()) == 0
    pool.close()


# ---- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [3, 6, -4, 17])
def test_checkpoint_spacing_must_be_a_positive_multiple_of_the_page_size(n):
    with pytest.raises(ValueError, match="state_checkpoint_tokens"):
        PoolConfig(page_size=4, state_checkpoint_tokens=n)


def test_state_budget_below_one_checkpoint_is_an_error_naming_it(tmp_path):
    caches = [torch.zeros(PAGES, PS, 8)]
    config = PoolConfig(page_size=PS, num_device_pages=PAGES, host_cache_bytes=1 << 16, state_checkpoint_bytes=4000,
                        state_host_bytes=1000)
    with pytest.raises(ValueError, match="state_host_bytes"):
        KVPool(config, caches, always_load())
    for name in ("state_device_bytes", "state_disk_bytes"):
        config = PoolConfig(page_size=PS, num_device_pages=PAGES, host_cache_bytes=1 << 16,
                            disk_cache_dir=str(tmp_path), disk_cache_bytes=1 << 20, state_checkpoint_bytes=4000,
                            **{name: 1000})
        with pytest.raises(ValueError, match=name):
            KVPool(config, caches, always_load())
