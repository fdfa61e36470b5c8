"""The pool's facade is its contract verbs (no pass-through to its parts), and the copy engine
moves bytes and knows no tier (the disk tier submits its own reads and writes)."""

import pytest
import torch

from kvtier.sim.copies import SimCopyEngine, SimDisk, TierLinks, VirtualClock
from kvtier.sim.hardware import Link
from kvtier.cache import seams
from kvtier.cache.config import PoolConfig
from kvtier.cache.cost_model import CostModel, TierCost
from kvtier.cache.device_copy import DeviceCopyEngine
from kvtier.cache.disk_tier import BlockMeta, DiskStatus, DiskTier, aligned_empty
from kvtier.cache.pool import KVPool
from kvtier.cache.prefix_index import Tier
from kvtier.cache.streams import CpuStreams
from kvtier.cache.tiers import DiskFiles, DiskJob
from kvtier.transfer import CopyEngine

PS, PAGES = 4, 8
PASS_THROUGH = ("host", "disk", "disk_budget", "remote", "index", "cost_model", "clock", "copy_engine")


def _pool(disk=None, cost_model=None) -> KVPool:
    kv = [torch.zeros(PAGES, PS, 2) for _ in range(2)]  # 2 layers x 4 tokens x 8 bytes = 64-byte blocks
    config = PoolConfig(page_size=PS, num_device_pages=PAGES, host_cache_bytes=8 * 64)
    return KVPool(config, kv, cost_model, disk=disk)


@pytest.mark.parametrize("name", PASS_THROUGH)
def test_the_pool_has_no_pass_through_to_its_parts(name):
    assert not hasattr(KVPool, name)
    assert not hasattr(_pool(), name)


def test_cost_verbs_read_and_update_the_pools_cost_model():
    pool = _pool(cost_model=CostModel(tiers={Tier.HOST: TierCost(1e-3, 1e9)}, prefill_tok_s=1000.0, alpha=0.5))
    assert pool.recompute_s(500) == 0.5
    pool.observe_prefill(2000, 1.0)  # 2,000 tokens/s observed, weight 0.5: 1,500 tokens/s
    assert pool.recompute_s(1500) == 1.0
    pool.observe_prefill(0, 1.0)  # an empty step teaches nothing
    assert pool.recompute_s(1500) == 1.0
    got = pool.costs()
    assert got.prefill_tok_s == 1500.0 and got.tiers == {Tier.HOST: TierCost(1e-3, 1e9)}
    got.prefill_tok_s, got.tiers[Tier.HOST].bandwidth_Bps = 1.0, 1.0  # a copy: the pool's is untouched
    assert pool.recompute_s(1500) == 1.0 and pool.costs().tiers[Tier.HOST].bandwidth_Bps == 1e9


def test_pools_share_a_disk_tier_only_when_it_is_one_store():
    shared = SimDisk(1 << 20)
    a, b, c, bare = _pool(shared), _pool(shared), _pool(SimDisk(1 << 20)), _pool()
    assert a.shares_disk_with(b) and b.shares_disk_with(a)
    assert not a.shares_disk_with(c) and not a.shares_disk_with(bare) and not bare.shares_disk_with(_pool())


def _engines():
    link = Link(latency_s=1e-6, bandwidth_Bps=1e9)
    return {"native": CopyEngine(1), "device": DeviceCopyEngine("cpu", CpuStreams()),
            "sim": SimCopyEngine(VirtualClock(), TierLinks(64.0, host=link, disk=link))}


def test_copy_engines_know_no_tier():
    for name in ("disk_read", "disk_write"):
        assert not hasattr(seams.CopyEngine, name)
        for kind, engine in _engines().items():
            assert not hasattr(engine, name), kind
    assert {"gather", "scatter", "run_io"} <= set(dir(seams.CopyEngine))
    assert all(isinstance(e, seams.CopyEngine) for e in _engines().values())


@pytest.mark.parametrize("kind", ["native", "device", "sim"])
def test_the_disk_tier_runs_its_jobs_on_any_engines_io_workers(tmp_path, kind):
    """The same disk-tier reads and writes, on each engine's I/O facility: the native workers
    (its own queue), the device engine's, and the simulator's virtual-time storage link."""
    engine = _engines()[kind]
    meta = BlockMeta(2, PS, 16, 1, 2 * PS * 16)
    disk = SimDisk(1 << 20) if kind == "sim" else DiskTier(tmp_path, 1 << 20)
    files = DiskFiles(disk, meta, lambda: engine)
    hashes = [bytes([i]) * 16 for i in range(3)]
    blocks = torch.arange(2 * meta.payload_bytes, dtype=torch.int32).to(torch.uint8)
    assert files.write(hashes[:2], blocks).result() == [DiskStatus.OK] * 2
    out = aligned_empty(3 * meta.payload_bytes).zero_()
    assert files.read_into(hashes, out).result() == [DiskStatus.OK, DiskStatus.OK, DiskStatus.MISSING]
    if kind != "sim":  # the simulator's disk keeps no bytes
        assert torch.equal(out[:blocks.numel()], blocks)
    assert disk.contains(hashes[1]) and not disk.contains(hashes[2])


def test_a_disk_job_checks_its_staging_buffer():
    meta = BlockMeta(1, PS, 16, 1, PS * 16)
    with pytest.raises(ValueError, match="staging must be a contiguous CPU tensor of at least 128 bytes"):
        DiskJob(SimDisk(1 << 20), [b"a" * 16, b"b" * 16], meta, torch.zeros(127, dtype=torch.uint8), write=True)
    with pytest.raises(ValueError, match="at least 64 bytes"):
        DiskJob(SimDisk(1 << 20), [b"a" * 16], meta, torch.zeros(2, 64, dtype=torch.uint8)[:, 0], write=False)
