"""The SGLang backend's parts that need no SGLang: its extra-config check, the hit rule for a KV
pool plus a state pool, and one pool's pages in kvtier's tiers under faults (a corrupt or missing
disk file, a full disk, a Redis store that goes down): a fault is a miss and a count, never wrong
bytes or an exception. SGLang's own classes drive the backend in test_sglang_storage.py."""

from __future__ import annotations

import pytest
import torch

from kvtier.cache.block_layout import BlockLayout
from kvtier.cache.disk_tier import DiskTier
from kvtier.cache.remote import open_backend
from kvtier.integrations.sglang.config import SGLANG_KEYS, StorageConfig
from kvtier.integrations.sglang.hit_rules import ALL_PAGES, TRAILING_PAGES, SidePool, restorable_prefixes
from kvtier.integrations.sglang.page_store import PageTiers
from kvtier.transfer import CopyEngine
from tests.stores import start_redis

PAGE_ELEMS = 1536  # one page of 2 K/V x 4 layers x 2 heads x 96 bf16 values / 4 tokens: 3072 bytes
META = BlockLayout(1, (1, PAGE_ELEMS), 0, torch.bfloat16).meta()


def _pages(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, META.payload_bytes), dtype=torch.uint8, generator=g)


def _hashes(n: int, tag: str = "p") -> list[bytes]:
    return [f"{tag}{i:015d}".encode() for i in range(n)]


@pytest.fixture(scope="module")
def engine():
    return CopyEngine(num_threads=2, max_queued=64)


# ---- extra config --------------------------------------------------------------------------------
def test_unknown_key_is_named():
    with pytest.raises(ValueError, match=r"'disk_cache_byte'"):
        StorageConfig.from_extra_config({"disk_cache_dir": "/tmp/x", "disk_cache_byte": 1 << 20})


@pytest.mark.parametrize("key, value", [("host_cache_bytes", "1GB"), ("host_cache_bytes", True),
                                         ("disk_cache_bytes", -1), ("remote_timeout_s", "1"),
                                         ("remote_cache_url", "http://x:1"), ("namespace", 3)])
def test_wrong_type_is_named(key, value):
    extra = {"host_cache_bytes": 1 << 20, key: value}
    with pytest.raises(ValueError, match=key):
        StorageConfig.from_extra_config(extra)


def test_sglang_keys_pass_and_a_tier_is_required():
    extra = {k: 1 for k in SGLANG_KEYS} | {"host_cache_bytes": 1 << 20}
    assert StorageConfig.from_extra_config(extra).host_cache_bytes == 1 << 20
    with pytest.raises(ValueError, match="no tier configured"):
        StorageConfig.from_extra_config({"backend_name": "kvtier"})
    with pytest.raises(ValueError, match="extra_config must be a JSON object"):
        StorageConfig.from_extra_config(["host_cache_bytes"])


# ---- hit rule ------------------------------------------------------------------------------------
def test_trailing_state_gives_sparse_restorable_lengths():
    # states at the page boundaries 2, 5 and 6 (a checkpoint grid): only those lengths restore
    state = SidePool("mamba", TRAILING_PAGES, 1, [False, True, False, False, True, True, False, False])
    hit = restorable_prefixes([True] * 6 + [False, True], [state])
    assert hit.restorable == [2, 5, 6] and hit.pages == 6
    assert hit.per_pool == {"kv": 6, "mamba": 6}


def test_no_kv_without_its_state():
    state = SidePool("mamba", TRAILING_PAGES, 1, [True, True, True, False])
    assert restorable_prefixes([True, True, False, True], [state]).pages == 2  # the KV prefix ends at 2
    assert restorable_prefixes([True] * 4, [SidePool("mamba", TRAILING_PAGES, 1, [False] * 4)]).restorable == []
    window = SidePool("swa", TRAILING_PAGES, 2, [False, True, True, True])  # a 2-page window
    assert restorable_prefixes([True] * 4, [window]).restorable == [3, 4]
    dense = SidePool("indexer", ALL_PAGES, 1, [True, True, False, True])
    assert restorable_prefixes([True] * 4, [dense, window]).restorable == []
    assert restorable_prefixes([True] * 4, [dense]).restorable == [1, 2]
    with pytest.raises(ValueError, match="hit_policy of pool 'x'"):
        SidePool("x", "block_groups", 1, [True])


# ---- tiers under faults --------------------------------------------------------------------------
def _disk_tiers(tmp_path, engine, pages_room: int, host_pages: int = 0) -> PageTiers:
    config = StorageConfig(host_cache_bytes=host_pages * META.payload_bytes, disk_cache_dir=str(tmp_path),
                           disk_cache_bytes=pages_room * DiskTier.file_bytes(META.payload_bytes))
    return PageTiers(config, META, b"test", engine)


def test_disk_round_trip_then_corrupt_and_missing_files_are_counted_misses(tmp_path, engine):
    tiers = _disk_tiers(tmp_path, engine, pages_room=8)
    pages, hashes = _pages(4), _hashes(4)
    assert tiers.write(hashes, pages) == [True] * 4
    out = torch.zeros_like(pages)
    assert tiers.read(hashes, out) == [True] * 4 and torch.equal(out, pages)
    disk = tiers.stores[0].disk
    path = disk.path(hashes[1])
    raw = bytearray(path.read_bytes())
    raw[4096 + 7] ^= 0xFF  # one payload byte flipped
    path.write_bytes(bytes(raw))
    disk.path(hashes[3]).unlink()
    out = torch.full_like(pages, 0xAB)
    assert tiers.read(hashes, out) == [True, False, True, False]
    assert torch.equal(out[0], pages[0]) and torch.equal(out[2], pages[2])
    assert bool((out[1] == 0xAB).all()) and bool((out[3] == 0xAB).all())  # failed pages left untouched
    c = tiers.counters["disk"]
    assert (c.hits, c.failures, c.misses, c.bytes_read) == (6, 1, 1, 6 * META.payload_bytes)
    assert tiers.contains(hashes) == [True, False, True, False]  # the corrupt file was deleted


def test_full_disk_refuses_writes_and_counts_them(tmp_path, engine):
    tiers = _disk_tiers(tmp_path, engine, pages_room=2)
    pages, hashes = _pages(3, seed=1), _hashes(3, "f")
    assert tiers.write(hashes, pages) == [True, True, False]
    assert tiers.counters["disk"].write_failures == 1 and tiers.counters["disk"].writes == 2
    out = torch.zeros_like(pages)
    assert tiers.read(hashes, out) == [True, True, False] and torch.equal(out[:2], pages[:2])
    assert tiers.contains(hashes) == [True, True, False]


def test_host_slots_evict_and_the_disk_copy_is_promoted(tmp_path, engine):
    tiers = _disk_tiers(tmp_path, engine, pages_room=8, host_pages=2)
    pages, hashes = _pages(3, seed=2), _hashes(3, "h")
    assert tiers.write(hashes[:2], pages[:2]) == [True] * 2
    assert tiers.write(hashes[2:], pages[2:]) == [True]  # evicts the least recently used host copy
    assert tiers.host.held(hashes) == [False, True, True]
    out = torch.zeros_like(pages)
    assert tiers.read(hashes, out) == [True] * 3 and torch.equal(out, pages)
    assert tiers.counters["disk"].hits == 1 and tiers.counters["host"].hits == 2
    assert tiers.host.held(hashes[:1]) == [True]  # promoted on its read


def test_remote_store_that_drops_is_a_counted_miss(tmp_path, engine):
    store = start_redis(tmp_path)
    try:
        config = StorageConfig(remote_cache_url=store.url, remote_timeout_s=0.5)
        tiers = PageTiers(config, META, b"test", engine, open_backend(store.url, 0.5))
        pages, hashes = _pages(3, seed=3), _hashes(3, "r")
        assert tiers.write(hashes, pages) == [True] * 3
        out = torch.zeros_like(pages)
        assert tiers.read(hashes, out) == [True] * 3 and torch.equal(out, pages)
        store.stop()  # the store crashes
        out = torch.full_like(pages, 0xCD)
        assert tiers.read(hashes, out) == [False] * 3 and bool((out == 0xCD).all())
        assert tiers.contains(hashes) == [False] * 3
        assert tiers.write(_hashes(2, "s"), pages[:2]) == [False, False]
        c = tiers.counters["remote"]
        assert (c.hits, c.failures, c.writes, c.write_failures) == (3, 3, 3, 2)
        tiers.close()
    finally:
        store.stop()
