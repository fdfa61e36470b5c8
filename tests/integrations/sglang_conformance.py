"""Conformance of kvtier's HiCache storage backend with SGLang's own classes (run inside the
SGLang venv by test_sglang_storage.py; not collected on its own).

As SGLang's CPU test of a storage backend does (``test_hicache_seaweedfs_storage.py``), pages
move through real CPU host pools (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``) and the
cache controller's own page paths (``HiCacheController._generic_page_get`` / ``_page_get_zero_copy``
and their set twins); the backend is built by SGLang's ``StorageBackendFactory`` from a
``dynamic`` extra config, as ``--hicache-storage-backend dynamic`` builds it. Nothing of
kvtier's tiers is replaced: pages go to real disk files (and a real Redis where installed).
The v2 side pool is a second real MHA host pool standing in for a state pool, as in SGLang's
test: the backend touches it only through the host-pool page API.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    HiCacheStorageFailureInjector,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage import backend_factory

from kvtier.integrations.sglang import KvtierStorage
from tests.helpers.sglang_pools import fill, mha_pool, mla_pool, page_bytes

PAGE_SIZE = 16
NUM_PAGES = 4
LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def _mha_pool(layout: str):
    return mha_pool(layout, PAGE_SIZE)


def _mla_pool(layout: str):
    return mla_pool(layout, PAGE_SIZE)


def _page(pool, page: int) -> torch.Tensor:
    return page_bytes(pool, page * PAGE_SIZE)


_fill = fill


@pytest.fixture
def disk(tmp_path) -> Path:
    return tmp_path / "kvtier-l3"


def _config(extra: dict, tp_rank=0, tp_size=1, is_mla=False, layout="page_first") -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=is_mla, enable_storage_metrics=True,
                                is_page_first_layout=layout == "page_first", model_name="moonshotai/Kimi-K2",
                                extra_config=extra)


def _extra(disk: Path, **tiers) -> dict:
    tiers = tiers or {"disk_cache_dir": str(disk), "disk_cache_bytes": 64 << 20}
    return {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang", "class_name": "KvtierStorage",
            "interface_v1": 1, **tiers}


def _store(disk: Path, **kwargs):
    tiers = kwargs.pop("tiers", {})
    return backend_factory.StorageBackendFactory.create_backend(
        backend_name="dynamic", storage_config=_config(_extra(disk, **tiers), **kwargs), mem_pool_host=None)


def _controller(store, pool):
    store.register_mem_pool_host(pool)
    return SimpleNamespace(storage_backend=store, storage_host_pool=pool, page_size=PAGE_SIZE)


SET = {"generic": HiCacheController._generic_page_set, "zero_copy": HiCacheController._page_set_zero_copy}
GET = {"generic": HiCacheController._generic_page_get, "zero_copy": HiCacheController._page_get_zero_copy}
OPERATION = SimpleNamespace(request_id="r", is_terminated=lambda: False)


def _backup_and_reload(store, pool, set_via, get_via, damage=None):
    """Back up NUM_PAGES random pages through the controller, wipe the pool, fetch them back."""
    ctrl = _controller(store, pool)
    _fill(pool, seed=hash(set_via + get_via) % 1000)
    expected = [_page(pool, i) for i in range(NUM_PAGES)]
    keys = [f"{uuid.uuid4().hex}" for _ in range(NUM_PAGES)]
    host_indices = torch.arange(NUM_PAGES * PAGE_SIZE, dtype=torch.int64)
    assert SET[set_via](ctrl, keys, host_indices)
    if damage is not None:
        damage(store, keys)
    pool.kv_buffer.zero_()
    loaded = GET[get_via](ctrl, OPERATION, keys, host_indices)
    return keys, expected, loaded


def _disk_file(store: KvtierStorage, pool: str, key: str) -> Path:
    tiers = store._tiers[pool]
    return next(s.disk for s in tiers.stores if s.name == "disk").path(store._hashes(pool, [key])[0])


# ---- the factory ---------------------------------------------------------------------------------
def test_dynamic_factory_builds_the_backend(disk):
    store = _store(disk)
    assert isinstance(store, KvtierStorage) and store.config.disk_cache_bytes == 64 << 20


def test_bad_extra_config_is_named(disk):
    with pytest.raises(ValueError, match="disk_cache_byte"):
        _store(disk, tiers={"disk_cache_dir": str(disk), "disk_cache_byte": 1 << 20})
    with pytest.raises(ValueError, match="host_cache_bytes"):
        _store(disk, tiers={"host_cache_bytes": "64MB"})


# ---- v1 zero copy and the generic path, MHA and MLA ----------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("via", ["generic", "zero_copy"])
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_round_trip_is_byte_exact(disk, kind, via, layout):
    if kind == "mla" and via == "zero_copy" and layout == "layer_first":
        pytest.skip("SGLang's MLA host pool has no zero-copy segments for layer_first "
                    "(its controller uses the generic path there)")
    pool = _mha_pool(layout) if kind == "mha" else _mla_pool(layout)
    _, expected, loaded = _backup_and_reload(_store(disk, is_mla=kind == "mla"), pool, via, via)
    assert loaded == NUM_PAGES
    for i in range(NUM_PAGES):
        assert torch.equal(_page(pool, i), expected[i])


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
@pytest.mark.parametrize("set_via, get_via", [("generic", "zero_copy"), ("zero_copy", "generic")])
def test_generic_and_zero_copy_read_each_others_pages(disk, layout, set_via, get_via):
    pool = _mha_pool(layout)
    _, expected, loaded = _backup_and_reload(_store(disk), pool, set_via, get_via)
    assert loaded == NUM_PAGES
    assert all(torch.equal(_page(pool, i), expected[i]) for i in range(NUM_PAGES))


# ---- batch_exists and faults: a shorter prefix, never wrong bytes --------------------------------
def _corrupt(store, keys, index=2):
    path = _disk_file(store, "kv", keys[index])
    raw = bytearray(path.read_bytes())
    raw[4096 + 100] ^= 0x5A
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("via", ["generic", "zero_copy"])
@pytest.mark.parametrize("fault", ["missing", "corrupt"])
def test_a_missing_or_corrupt_page_ends_the_prefix(disk, via, fault):
    store = _store(disk)
    damage = (lambda s, k: _disk_file(s, "kv", k[2]).unlink()) if fault == "missing" else _corrupt
    pool = _mha_pool("page_first")
    keys, expected, loaded = _backup_and_reload(store, pool, via, via, damage=damage)
    assert loaded == 2
    assert all(torch.equal(_page(pool, i), expected[i]) for i in range(2))
    assert not _page(pool, 2).any()  # the bad page never reached the host pool
    assert store.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=[])) == 2
    disk_stats = store.get_stats().tiers["disk"]
    assert disk_stats["failures" if fault == "corrupt" else "misses"] >= 1


def test_batch_exists_counts_the_leading_pages(disk):
    store = _store(disk)
    pool = _mha_pool("page_first")
    ctrl = _controller(store, pool)
    _fill(pool)
    keys = [uuid.uuid4().hex for _ in range(NUM_PAGES)]
    assert store.batch_exists(keys) == 0
    assert SET["zero_copy"](ctrl, keys[:3], torch.arange(3 * PAGE_SIZE))
    assert store.batch_exists(keys) == 3 and store.batch_exists(keys[1:]) == 2
    assert store.batch_exists([keys[3], *keys[:3]]) == 0
    assert store.exists(keys[0]) and not store.exists(keys[3])


def test_full_disk_is_a_counted_refusal_then_a_miss(disk):
    from kvtier.cache.disk_tier import DiskTier

    pool = _mha_pool("page_first")
    page_file = DiskTier.file_bytes(_page(pool, 0).numel())
    store = _store(disk, tiers={"disk_cache_dir": str(disk), "disk_cache_bytes": 2 * page_file})
    ctrl = _controller(store, pool)
    _fill(pool)
    keys = [uuid.uuid4().hex for _ in range(NUM_PAGES)]
    host_indices = torch.arange(NUM_PAGES * PAGE_SIZE)
    assert store.batch_set_v1(keys, host_indices) == [True, True, False, False]
    assert not SET["zero_copy"](ctrl, keys, host_indices)  # the controller sees the batch fail
    pool.kv_buffer.zero_()
    assert GET["zero_copy"](ctrl, OPERATION, keys, host_indices) == 2
    assert store.get_stats().tiers["disk"]["write_failures"] >= 2


def _redis(tmp_path):
    """A Redis server on a free loopback port (stopped by the caller), or a skip saying why."""
    try:
        from kvtier.cluster.stores import start_store, store_binary
    except ImportError as e:
        pytest.skip(f"kvtier.cluster.stores does not import here: {e}")
    if store_binary("redis") is None:
        pytest.skip("redis-server is not installed (scripts/setup.sh installs it)")
    return start_store("redis", tmp_path)


def test_remote_store_that_drops_gives_misses(tmp_path):
    server = _redis(tmp_path)
    try:
        store = _store(tmp_path, tiers={"remote_cache_url": server.url, "remote_timeout_s": 0.5})
        pool = _mha_pool("page_first")
        keys, expected, loaded = _backup_and_reload(store, pool, "zero_copy", "zero_copy")
        assert loaded == NUM_PAGES and all(torch.equal(_page(pool, i), expected[i]) for i in range(NUM_PAGES))
        server.stop()
        pool.kv_buffer.zero_()
        host_indices = torch.arange(NUM_PAGES * PAGE_SIZE)
        assert GET["zero_copy"](_controller(store, pool), OPERATION, keys, host_indices) == 0
        assert not pool.kv_buffer.any() and store.batch_exists(keys) == 0
        remote = store.get_stats().tiers["remote"]
        assert remote["hits"] == NUM_PAGES and remote["failures"] >= 1
        store.close()
    finally:
        server.stop()


def test_failure_injector_wraps_the_backend(disk, monkeypatch):
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    store = _store(disk)
    assert isinstance(store, HiCacheStorageFailureInjector) and isinstance(store._backend, KvtierStorage)
    pool = _mha_pool("page_first")
    ctrl = _controller(store, pool)
    _fill(pool, seed=7)
    expected = [_page(pool, i) for i in range(NUM_PAGES)]
    host_indices = torch.arange(NUM_PAGES * PAGE_SIZE)
    seen = set()
    for trial in range(30):
        keys = [f"inj-{trial}-{i}" for i in range(NUM_PAGES)]
        SET["zero_copy"](ctrl, keys, host_indices)
        pool.kv_buffer.zero_()
        loaded = GET["zero_copy"](ctrl, OPERATION, keys, host_indices)
        seen.add(loaded)
        assert all(torch.equal(_page(pool, i), expected[i]) for i in range(loaded))
        pool.kv_buffer.zero_()
        for i, page in enumerate(expected):
            pool.set_from_flat_data_page(i * PAGE_SIZE, page.view(torch.bfloat16))
    assert 0 in seen and NUM_PAGES in seen  # some batches failed, some went through


# ---- MLA: one writer per shard, shared pages; MHA ranks apart ------------------------------------
def test_mla_pages_are_shared_and_written_by_the_writer_only(tmp_path):
    server = _redis(tmp_path)
    try:
        tiers = {"remote_cache_url": server.url, "disk_cache_dir": str(tmp_path / "d"), "disk_cache_bytes": 8 << 20}
        writer = _store(tmp_path, tp_rank=0, tp_size=2, is_mla=True, tiers=tiers)
        reader = _store(tmp_path, tp_rank=1, tp_size=2, is_mla=True, tiers=tiers)
        assert writer.is_writer and not reader.is_writer
        pool_w, pool_r = _mla_pool("page_first"), _mla_pool("page_first")
        writer.register_mem_pool_host(pool_w)
        reader.register_mem_pool_host(pool_r)
        _fill(pool_w, seed=3)
        _fill(pool_r, seed=3)
        keys = [uuid.uuid4().hex for _ in range(NUM_PAGES)]
        host_indices = torch.arange(NUM_PAGES * PAGE_SIZE)
        assert reader.batch_set_v1(keys, host_indices) == [True] * NUM_PAGES  # a follower's write is a no-op
        assert writer.batch_exists(keys) == 0 and reader.get_stats().tiers["remote"]["writes"] == 0
        assert writer.batch_set_v1(keys, host_indices) == [True] * NUM_PAGES
        expected = [_page(pool_r, i) for i in range(NUM_PAGES)]
        pool_r.kv_buffer.zero_()
        assert reader.batch_exists(keys) == NUM_PAGES
        assert reader.batch_get_v1(keys, host_indices) == [True] * NUM_PAGES
        assert all(torch.equal(_page(pool_r, i), expected[i]) for i in range(NUM_PAGES))
        assert reader.get_stats().tiers["remote"]["hits"] == NUM_PAGES
        writer.close()
        reader.close()
    finally:
        server.stop()


def test_mha_ranks_do_not_share_pages(disk):
    first, second = _store(disk, tp_rank=0, tp_size=2), _store(disk, tp_rank=1, tp_size=2)
    pools = [_mha_pool("page_first"), _mha_pool("page_first")]
    for store, pool in zip((first, second), pools):
        store.register_mem_pool_host(pool)
        _fill(pool)
    keys = [uuid.uuid4().hex]
    assert first.batch_set_v1(keys, torch.arange(PAGE_SIZE)) == [True]
    assert first.batch_exists(keys) == 1 and second.batch_exists(keys) == 0


# ---- v2: a KV pool and a state pool --------------------------------------------------------------
def _v2(disk, layout="page_first", **tiers):
    store = _store(disk, tiers=tiers)
    kv, state = _mha_pool(layout), _mha_pool(layout)
    store.register_mem_pool_host(kv)
    store.register_mem_host_pool_v2(kv, PoolName.KV)
    store.register_mem_host_pool_v2(state, PoolName.MAMBA)
    _fill(kv, seed=11)
    _fill(state, seed=12)
    return store, kv, state


def _indices(pages):
    return torch.cat([torch.arange(p * PAGE_SIZE, (p + 1) * PAGE_SIZE) for p in pages]) if pages \
        else torch.zeros(0, dtype=torch.int64)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_v2_round_trip_is_byte_exact_per_pool(disk, layout):
    store, kv, state = _v2(disk, layout)
    keys = [uuid.uuid4().hex for _ in range(NUM_PAGES)]
    transfers = [PoolTransfer(name=PoolName.KV, host_indices=_indices(range(NUM_PAGES)), keys=keys),
                 PoolTransfer(name=PoolName.MAMBA, host_indices=_indices(range(NUM_PAGES)), keys=keys)]
    pools = ((PoolName.KV, kv), (PoolName.MAMBA, state))
    expected = {p: [_page(pool, i) for i in range(NUM_PAGES)] for p, pool in pools}
    written = store.batch_set_v2(transfers)
    assert written[PoolName.KV] == [True] * NUM_PAGES and written[PoolName.MAMBA] == [True] * NUM_PAGES
    kv.kv_buffer.zero_()
    state.kv_buffer.zero_()
    loaded = store.batch_get_v2(transfers)
    for p, pool in pools:
        assert loaded[p] == [True] * NUM_PAGES
        assert all(torch.equal(_page(pool, i), expected[p][i]) for i in range(NUM_PAGES))
    assert store.batch_exists(keys) == NUM_PAGES  # v2 KV pages are the v1 pages


def test_v2_trailing_state_restores_only_at_checkpoint_boundaries(disk):
    store, _, _ = _v2(disk)
    keys = [uuid.uuid4().hex for _ in range(6)]
    # KV pages for 6 pages; states only at the ends of pages 2 and 5 (keys 1 and 4): a sparse grid
    assert store.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=_indices(range(6)), keys=keys)])
    assert store.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=_indices([1, 4]),
                                            keys=[keys[1], keys[4]])])[PoolName.MAMBA] == [True, True]
    window = PoolTransfer(name=PoolName.MAMBA, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    result = store.batch_exists_v2(keys, [window])
    assert result.kv_hit_pages == 5 and result.restorable_prefix_pages == [2, 5]
    assert result.extra_pool_hit_pages == {"kv": 6, PoolName.MAMBA.value: 5}
    # the state at page 5 goes bad: the prefix falls back to the last valid boundary, never KV alone
    path = _disk_file(store, "mamba", keys[4])
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    raw[4096] ^= 0xFF
    path.write_bytes(bytes(raw))
    state_buf = store._pools["mamba"].pool.kv_buffer
    state_buf.zero_()
    got = store.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=_indices([4]), keys=[keys[4]])])
    assert got[PoolName.MAMBA] == [False] and not state_buf.any()
    result = store.batch_exists_v2(keys, [window])
    assert result.kv_hit_pages == 2 and result.restorable_prefix_pages == [2]
    assert store.get_stats().tiers["pools"]["mamba"]["disk"]["failures"] == 1
    # the state at page 2 goes missing too (deleted behind the tier's back: the read finds out and
    # drops it): no boundary is left, so no KV prefix is restorable
    _disk_file(store, "mamba", keys[1]).unlink()
    got = store.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=_indices([1]), keys=[keys[1]])])
    assert got[PoolName.MAMBA] == [False] and not state_buf.any()
    result = store.batch_exists_v2(keys, [window])
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (0, [])
    assert store.batch_exists(keys) == 6  # the KV pages themselves are all there


def test_v2_all_pages_policy_and_malformed_transfers(disk):
    store, _, _ = _v2(disk)
    keys = [uuid.uuid4().hex for _ in range(NUM_PAGES)]
    store.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=_indices(range(4)), keys=keys),
                        PoolTransfer(name=PoolName.MAMBA, host_indices=_indices([0, 1, 3]),
                                     keys=[keys[0], keys[1], keys[3]])])
    dense = PoolTransfer(name=PoolName.MAMBA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)
    result = store.batch_exists_v2(keys, [dense])
    assert result.kv_hit_pages == 2 and result.restorable_prefix_pages == [1, 2]
    short = _indices([0])  # one page of indices for four keys
    bad = store.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=short, keys=keys),
                              PoolTransfer(name=PoolName.SWA, host_indices=_indices(range(4)), keys=keys)])
    assert bad == {PoolName.KV: [False] * NUM_PAGES, PoolName.SWA: [False] * NUM_PAGES}


def test_get_stats_is_sglang_storage_metrics(disk):
    from sglang.srt.observability.metrics_collector import StorageMetrics

    store = _store(disk, tiers={"host_cache_bytes": 1 << 20, "disk_cache_dir": str(disk), "disk_cache_bytes": 8 << 20})
    pool = _mha_pool("page_first")
    keys, _, loaded = _backup_and_reload(store, pool, "zero_copy", "zero_copy")
    stats = store.get_stats()
    assert isinstance(stats, StorageMetrics) and stats.backup_pgs == [NUM_PAGES] and stats.prefetch_pgs == [NUM_PAGES]
    page_bytes = _page(pool, 0).numel()
    assert stats.tiers["host"]["hits"] == NUM_PAGES and stats.tiers["host"]["bytes_read"] == NUM_PAGES * page_bytes
    assert stats.tiers["disk"]["writes"] == NUM_PAGES and stats.tiers["disk"]["hits"] == 0
    assert store.get_stats().backup_pgs == []  # batch records are taken once
