"""The cost model: what an unprobed tier costs, how copy jobs move a tier's estimate, and how the
pool probes its host tier (bytes per second over many-block jobs, not one block's fixed cost)."""

import pytest
import torch

from kvtier import LLM
from kvtier.cache import cost_model
from kvtier.cache.config import PoolConfig
from kvtier.cache.cost_model import UNPROBED_TIER, CostModel, TierCost
from kvtier.cache.pool import KVPool
from kvtier.cache.prefix_index import Tier
from kvtier.transfer import CopyEngine

PS, BLOCK = 16, 15360  # tiny preset, fp32: one block = 15360 bytes


def test_unprobed_tier_gets_a_default_cost():
    model = CostModel()
    assert model.load_s(Tier.DISK, 10**9) == UNPROBED_TIER.load_s(10**9)
    model.observe_copy(Tier.DISK, 10**9, 0.5)
    assert Tier.DISK in model.tiers


def test_the_blocks_of_one_copy_job_move_the_bandwidth_estimate_as_one_observation():
    """A job of ``n`` blocks folded block by block (each ``1 / n`` of it) leaves the estimate
    where one observation of the whole job leaves it, whatever ``n``: it does not replace the
    estimate with the job's rate (as ``n`` whole observations did)."""
    def after(observations):
        model = CostModel(tiers={Tier.HOST: TierCost(latency_s=1e-4, bandwidth_Bps=1e9)})
        for nbytes, seconds, share in observations:
            model.observe_copy(Tier.HOST, nbytes, seconds, share)
        return model.tiers[Tier.HOST].bandwidth_Bps

    job_bytes, job_s = 1000 * 960, 0.1  # a slow job: ~9.6 MB/s after its latency
    whole = after([(job_bytes, job_s, 1.0)])
    assert whole == pytest.approx(1e9 + 0.2 * (job_bytes / (job_s - 1e-4) - 1e9))
    for n in (1, 10, 1000):
        assert after([(job_bytes // n, job_s / n, 1.0 / n)] * n) == pytest.approx(whole, rel=1e-6)
    assert whole > 5e8  # one slow job moves the estimate by alpha, not to the job's 9.6 MB/s


def test_default_probe_measures_bytes_per_second():
    llm = LLM("tiny", page_size=PS, num_device_pages=8, host_cache_bytes=4 * BLOCK)
    assert llm.engine.pool.tiers.cost_model.tiers[Tier.HOST].bandwidth_Bps > 1e7  # bytes, not copies, per second


def test_the_host_probe_measures_bandwidth_with_many_blocks_not_one(monkeypatch):
    """One job of one small block measures the job's fixed cost: 960-byte blocks probed at 1-15
    MB/s (bulk: ~9 GB/s), and at the low end loads looked slower than recomputing, so none was
    made or observed and the pool never loaded from host for the whole run. The probe times a
    many-block job too (a fake clock: each job costs 100 us plus 1 us per block)."""
    now = [0.0]
    monkeypatch.setattr(cost_model.time, "perf_counter", lambda: now[0])

    def copy(n):
        now[0] += 1e-4 + n * 1e-6
        return n * 960

    bulk = cost_model.probe(copy, 4096)
    assert bulk.latency_s == pytest.approx(1.01e-4) and bulk.bandwidth_Bps == pytest.approx(960 / 1e-6)
    one = cost_model.probe(copy, 1)  # the disk's probe: its loads are one block per job
    assert one.bandwidth_Bps == pytest.approx(960 / 1.01e-4)


def test_the_pool_probes_its_host_tier_with_a_many_block_job():
    sizes = []

    class Recording:
        def __init__(self, engine):
            self.engine = engine

        def scatter(self, staging, kv_caches, pages):
            sizes.append(len(pages))
            assert staging.shape[0] == len(pages)
            return self.engine.scatter(staging, kv_caches, pages)

        def __getattr__(self, name):
            return getattr(self.engine, name)

    pool = KVPool(PoolConfig(page_size=1, num_device_pages=64, host_cache_bytes=32 * 8 * 4),
                  [torch.zeros(64, 1, 8)], copy_engine=Recording(CopyEngine()))
    assert sizes == [1, 1, 1, 32, 32, 32]  # every host slot (32 < 4 MiB of 32-byte blocks)
    assert pool.tiers.cost_model.tiers[Tier.HOST].bandwidth_Bps > 0

