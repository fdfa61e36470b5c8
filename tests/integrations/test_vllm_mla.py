"""The connector's MLA layout: vLLM's MLA cache ``[num_blocks, block_size, 576]`` bf16 (passed to
the connector as its 4-D view ``[num_blocks, 1, block_size, 576]``) saved by the connector's worker
tiers and loaded back from kvtier's host, disk and remote tiers into other blocks, bytes equal; on
the CPU and, marked ``gpu``, on CUDA tensors (``perf/gpu_check.sh`` runs those)."""

import pytest
import torch

from kvtier.cache.block_hash import block_hashes
from kvtier.cache.block_layout import BlockLayout
from kvtier.cache.config import PoolConfig
from kvtier.cache.disk_tier import BlockMeta
from kvtier.cache.host_tier import HostTier
from kvtier.cache.prefix_index import Tier
from kvtier.cache.remote import RemoteStatus, RemoteTier
from kvtier.integrations.vllm.tiers import LoadJob, SchedulerIndex, StepPlan, WorkerTiers

LAYERS, BLOCKS, PAGE, MLA_DIM = 3, 10, 16, 576  # 576 = kv_lora_rank 512 + rope 64
NEEDS_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, NEEDS_GPU])]


class DictStore:
    """An in-memory remote store (the :class:`kvtier.cache.remote.RemoteBackend` protocol)."""

    url = "dict://test"

    def __init__(self):
        self.values: dict[str, bytes] = {}

    def batch_put(self, keys, values):
        self.values.update(zip(keys, (bytes(v) for v in values)))
        return [RemoteStatus.OK] * len(keys)

    def batch_get(self, keys, outs):
        statuses = []
        for k, out in zip(keys, outs):
            v = self.values.get(k)
            if v is None or len(v) != len(out):
                statuses.append(RemoteStatus.MISSING if v is None else RemoteStatus.CORRUPT)
            else:
                out[:] = v
                statuses.append(RemoteStatus.OK)
        return statuses

    def exists(self, keys):
        return [k in self.values for k in keys]

    def close(self):
        pass


def mla_pools(device, seed):
    """vLLM's MLA allocations: per layer ``[num_blocks, block_size, 576]`` bf16 of random bits (NaN
    and inf patterns included: the tiers move bytes, never values)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-(1 << 15), 1 << 15, (BLOCKS, PAGE, MLA_DIM), dtype=torch.int16, generator=g)
            .view(torch.bfloat16).to(device) for _ in range(LAYERS)]


def bits(t):
    return t.view(torch.int16).cpu()


def same_blocks(a, ai, b, bi):
    return all(torch.equal(bits(x[ai]), bits(y[bi])) for x, y in zip(a, b))


def tiers(tmp_path, caches, store):
    """The scheduler's index and a worker's tiers over ``caches`` (vLLM's 4-D views), as the
    connector opens them, with a host tier of 8 blocks, a disk tier and ``store`` as the remote."""
    layout = BlockLayout.of_caches(caches, 0, 1)
    pool = PoolConfig(page_size=PAGE, host_cache_bytes=8 * HostTier.row_bytes(layout.block_bytes),
                      disk_cache_dir=str(tmp_path / "disk"), disk_cache_bytes=1 << 24, salt=b"mla-model")
    sched = SchedulerIndex(pool, layout, prefill_tok_s=1.0, remote=RemoteTier(store, layout.meta()))
    worker = WorkerTiers(pool, caches, block_dim=0, token_dim=1)
    worker.remote = RemoteTier(store, worker.meta)
    return sched, worker


@pytest.mark.parametrize("device", DEVICES)
def test_mla_blocks_round_trip_through_host_disk_and_remote(tmp_path, device):
    pools = mla_pools(device, seed=1)
    views = [p.unsqueeze(1) for p in pools]  # what register_kv_caches gets: [num_blocks, 1, block_size, 576]
    want = [p.clone() for p in pools]
    store = DictStore()
    sched, worker = tiers(tmp_path, views, store)
    # one layout: vLLM's MLA page is kvtier's page-first MLA page (the same meta, disk names, keys)
    assert worker.layout.page_shape == (PAGE, MLA_DIM) and worker.layout.dtype == torch.bfloat16
    # what the scheduler's connector computes from vLLM's MLA spec (1 KV head of 576, no V part)
    assert BlockLayout(LAYERS, (1, PAGE, MLA_DIM + 0), 1, torch.bfloat16) == worker.layout
    assert worker.meta == BlockMeta.of_pools([p.cpu() for p in pools])
    assert worker.layout.block_bytes == LAYERS * PAGE * MLA_DIM * 2
    hs = block_hashes(list(range(3 * PAGE)), PAGE, salt=b"mla-model")
    plan = StepPlan(saves=[sched.plan_save([5, 2, 7], hs)])
    worker.save(plan)  # write-through: host, disk and remote
    assert (worker.stats.saved_host, worker.stats.written_disk, worker.stats.written_remote) == (3, 3, 3)
    assert len(store.values) == 3 and all(worker.disk.contains(h) for h in hs)
    assert sched.sources(hs) == [Tier.HOST] * 3
    for p in pools:  # vLLM reuses the blocks for other requests
        p.fill_(0)
    for tier, dst in [(Tier.HOST, [0, 1, 3]), (Tier.DISK, [4, 6, 8]), (Tier.REMOTE, [9, 0, 1])]:
        if tier == Tier.HOST:
            job = sched.plan_load("r", dst, hs)
        else:
            job = LoadJob("r", dst, hs, [int(tier)] * 3, [-1] * 3)
        assert job.tiers == [int(tier)] * 3
        assert worker.load([job]) == set(), tier
        assert same_blocks(pools, dst, want, [5, 2, 7]), tier
        assert all(v.device.type == device for v in views)
    assert worker.stats.loaded == {"host": 3, "disk": 3, "remote": 3}
    assert worker.stats.load_failures == {"host": 0, "disk": 0, "remote": 0}


@pytest.mark.parametrize("device", DEVICES)
def test_a_corrupt_remote_mla_block_is_not_served(tmp_path, device):
    pools = mla_pools(device, seed=2)
    views = [p.unsqueeze(1) for p in pools]
    store = DictStore()
    sched, worker = tiers(tmp_path, views, store)
    hs = block_hashes(list(range(2 * PAGE)), PAGE, salt=b"mla-model")
    worker.save(StepPlan(saves=[sched.plan_save([3, 4], hs)]))
    key = worker.remote.key(hs[0])
    raw = bytearray(store.values[key])
    raw[-7] ^= 0x10  # one payload bit of the first block
    store.values[key] = bytes(raw)
    for p in pools:
        p.fill_(1.0)
    assert worker.load([LoadJob("r", [0, 1], hs, [int(Tier.REMOTE)] * 2, [-1] * 2)]) == {0, 1}
    assert all((p[:2] == 1.0).all() for p in pools)  # nothing served, from the bad block on
    assert worker.stats.load_failures["remote"] == 1
