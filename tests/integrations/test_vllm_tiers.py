"""The connector's tiers without vLLM: the scheduler's plans run by a worker over vLLM-layout K/V caches."""

import socket
import time

import pytest
import torch

from kvtier.cache.block_hash import block_hashes
from kvtier.cache.block_layout import BlockLayout
from kvtier.cache.config import PoolConfig
from kvtier.cache.host_tier import HostTier
from kvtier.cache.prefix_index import Tier
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.tiers import SchedulerIndex, StepPlan, WorkerTiers

LAYERS, BLOCKS, PAGE, HEADS, HEAD = 2, 8, 4, 2, 8


def caches(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, BLOCKS, PAGE, HEADS, HEAD, generator=g) for _ in range(LAYERS)]


def make(tmp_path, cache_list, *, host_blocks=4, disk=True, prefill_tok_s=1e3, **extra):
    layout = BlockLayout.of_caches(cache_list, 1, 1)
    pool = PoolConfig(page_size=PAGE, host_cache_bytes=host_blocks * HostTier.row_bytes(layout.block_bytes),
                      disk_cache_dir=str(tmp_path / "disk") if disk else None,
                      disk_cache_bytes=(1 << 20) if disk else 0, salt=b"model", **extra)
    return SchedulerIndex(pool, layout, prefill_tok_s), WorkerTiers(pool, cache_list, 1, 1)


def step(sched, worker, loads=(), saves=()):
    plan = StepPlan(loads=list(loads), saves=[s for s in saves if s is not None])
    sched.take_pending(plan)
    failed = worker.load(plan.loads)
    worker.save(plan)
    return failed


def same_blocks(a, ai, b, bi):
    return all(torch.equal(x[:, ai], y[:, bi]) for x, y in zip(a, b))


def test_save_then_load_into_other_blocks(tmp_path):
    src = caches(1)
    sched, worker = make(tmp_path, src, prefill_tok_s=1.0)  # recomputing is slow: load all
    hs = block_hashes(list(range(3 * PAGE)), PAGE, salt=b"model")
    step(sched, worker, saves=[sched.plan_save([5, 2, 7], hs)])
    assert worker.stats.saved_host == 3 and worker.stats.written_disk == 3
    k, src_tiers = sched.blocks_to_load(hs)
    assert (k, src_tiers) == (3, [Tier.HOST] * 3)
    for c in src:  # vLLM reuses the blocks for others
        c.zero_()
    src_copy = caches(1)
    assert step(sched, worker, loads=[sched.plan_load("r", [0, 1, 3], hs)]) == set()
    assert same_blocks(src, [0, 1, 3], src_copy, [5, 2, 7])
    assert worker.stats.loaded["host"] == 3


def test_recompute_is_chosen_when_faster(tmp_path):
    sched, worker = make(tmp_path, caches(2), prefill_tok_s=1e15)
    hs = block_hashes(list(range(2 * PAGE)), PAGE)
    step(sched, worker, saves=[sched.plan_save([0, 1], hs)])
    assert sched.sources(hs) == [Tier.HOST, Tier.HOST]
    assert sched.blocks_to_load(hs)[0] == 0


def test_host_eviction_then_disk_load_and_restart(tmp_path):
    src = caches(3)
    sched, worker = make(tmp_path, src, host_blocks=2, prefill_tok_s=1.0)
    hs = block_hashes(list(range(4 * PAGE)), PAGE)
    step(sched, worker, saves=[sched.plan_save([0, 1], hs[:2])])
    step(sched, worker, saves=[sched.plan_save([2, 3], hs[2:])])  # evicts the first two from host
    assert sched.index.num_copies(Tier.HOST) == 2 and sched.index.num_copies(Tier.DISK) == 4
    assert sched.sources(hs) == [Tier.DISK, Tier.DISK, Tier.HOST, Tier.HOST]
    want = [c.clone() for c in src]
    for c in src:
        c.zero_()
    assert step(sched, worker, loads=[sched.plan_load("r", [4, 5, 6, 7], hs)]) == set()
    assert same_blocks(src, [4, 5, 6, 7], want, [0, 1, 2, 3])
    assert worker.stats.loaded == {"host": 2, "disk": 2, "remote": 0}
    # a new server on the same directory finds the disk blocks
    worker.close()
    fresh = caches(9)
    sched2, worker2 = make(tmp_path, fresh, prefill_tok_s=1.0)
    assert sched2.sources(hs) == [Tier.DISK] * 4
    assert step(sched2, worker2, loads=[sched2.plan_load("r", [0, 1, 2, 3], hs)]) == set()
    assert same_blocks(fresh, [0, 1, 2, 3], want, [0, 1, 2, 3])


def test_a_corrupt_disk_block_is_a_load_failure_not_served(tmp_path):
    src = caches(4)
    sched, worker = make(tmp_path, src, host_blocks=1, prefill_tok_s=1.0)
    hs = block_hashes(list(range(2 * PAGE)), PAGE)
    step(sched, worker, saves=[sched.plan_save([0], hs[:1])])
    step(sched, worker, saves=[sched.plan_save([1], hs[1:])])
    path = worker.disk.path(hs[0])
    raw = bytearray(path.read_bytes())
    raw[4096 + 10] ^= 0x01  # one bit of block 0's payload
    path.write_bytes(bytes(raw))
    for c in src:
        c.fill_(7.0)
    job = sched.plan_load("r", [3, 4], hs)
    assert job.tiers == [Tier.DISK, Tier.HOST]
    assert step(sched, worker, loads=[job]) == {3, 4}  # from the bad block on
    assert all((c[:, 3:5] == 7.0).all() for c in src)  # nothing served
    assert worker.stats.load_failures["disk"] == 1 and not worker.disk.contains(hs[0])


def test_one_save_never_evicts_its_own_blocks(tmp_path):
    sched, worker = make(tmp_path, caches(8), host_blocks=2, disk=False)
    hs = block_hashes(list(range(4 * PAGE)), PAGE)
    job = sched.plan_save([0, 1, 2, 3], hs)
    assert job.slots == [0, 1] and job.hashes == hs[:2]  # the prefix's first blocks, not overwritten
    assert sched.index.ref_count(hs[0], Tier.HOST) == 0  # evictable by later saves


def test_write_back_spills_evicted_host_blocks(tmp_path):
    src = caches(5)
    sched, worker = make(tmp_path, src, host_blocks=1, prefill_tok_s=1.0, write_policy="write-back")
    hs = block_hashes(list(range(2 * PAGE)), PAGE)
    step(sched, worker, saves=[sched.plan_save([0], hs[:1])])
    assert worker.stats.written_disk == 0 and sched.index.num_copies(Tier.DISK) == 0
    step(sched, worker, saves=[sched.plan_save([1], hs[1:])])  # evicts hs[0] from host: spilled first
    assert worker.stats.spilled == 1 and worker.disk.contains(hs[0])
    want = [c.clone() for c in src]
    assert step(sched, worker, loads=[sched.plan_load("r", [6, 7], hs)]) == set()
    assert same_blocks(src, [6, 7], want, [0, 1])


def test_tool_aware_policy_keeps_a_waiting_sessions_blocks(tmp_path):
    sched, worker = make(tmp_path, caches(6), host_blocks=2, disk=False, cache_policy="tool-aware")
    a = block_hashes(list(range(PAGE)), PAGE)
    b = block_hashes(list(range(100, 100 + PAGE)), PAGE)
    c = block_hashes(list(range(200, 200 + PAGE)), PAGE)
    step(sched, worker, saves=[sched.plan_save([0], a)])
    step(sched, worker, saves=[sched.plan_save([1], b)])
    sched.policy.tool_wait("s", a, 60.0, time.monotonic())
    step(sched, worker, saves=[sched.plan_save([2], c)])  # a is the LRU block but protected
    assert sched.index.held(a + b + c, Tier.HOST).tolist() == [True, False, True]


def test_extra_config_errors_name_the_key(tmp_path):
    for extra, key in [({"host_cache_byte": 1}, "host_cache_byte"), ({"disk_cache_bytes": "1G"}, "disk_cache_bytes"),
                       ({"cache_policy": "mru"}, "cache_policy"), ({"salt": 1}, "salt"),
                       ({"host_cache_bytes": 0}, "host_cache_bytes"), ({"prefill_tok_s": -1}, "prefill_tok_s"),
                       ({"remote_cache_url": "http://x:1"}, "remote_cache_url"),
                       ({"disk_cache_dir": "/proc/kvtier", "disk_cache_bytes": 1 << 20}, "disk_cache_dir")]:
        with pytest.raises(ValueError, match=rf"kv_connector_extra_config\['{key}'\]"):
            ConnectorConfig.from_extra_config(extra, PAGE)
    cfg = ConnectorConfig.from_extra_config({"disk_cache_dir": str(tmp_path / "d"), "disk_cache_bytes": 1 << 20,
                                             "salt": "t1"}, PAGE)
    assert cfg.pool.salt == b"t1" and (tmp_path / "d").is_dir()


def test_an_unreachable_remote_store_is_refused_naming_the_key(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\['remote_cache_url'\].*cannot be reached"):
        ConnectorConfig.from_extra_config({"remote_cache_url": f"redis://127.0.0.1:{port}"}, PAGE)
    with socket.socket() as s:  # a listening port passes the probe (the store's handshake comes later)
        s.bind(("127.0.0.1", 0))
        s.listen()
        url = f"redis://127.0.0.1:{s.getsockname()[1]}"
        assert ConnectorConfig.from_extra_config({"remote_cache_url": url}, PAGE).pool.remote_cache_url == url
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\['disk_cache_dir'\].*not a writable"):
        (tmp_path / "file").write_text("x")
        ConnectorConfig.from_extra_config({"disk_cache_dir": str(tmp_path / "file" / "disk"),
                                           "disk_cache_bytes": 1 << 20}, PAGE)


def test_a_planned_block_gone_from_the_tiers_is_a_load_failure(tmp_path):
    src = caches(10)
    sched, worker = make(tmp_path, src, disk=False, prefill_tok_s=1.0)
    hs = block_hashes(list(range(2 * PAGE)), PAGE)
    step(sched, worker, saves=[sched.plan_save([0], hs[:1])])
    job = sched.plan_load("r", [3, 4], hs)  # hs[1] was never saved
    assert job.tiers == [Tier.HOST, -1]
    assert step(sched, worker, loads=[job]) == {4}
    assert same_blocks(src, [3], src, [0])
