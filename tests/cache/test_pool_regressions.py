"""Regressions found by trying to break the pool: each test names the failure it guards against."""

import time


from kvtier import LLM, SamplingParams
from kvtier.cache.cost_model import UNPROBED_TIER, CostModel
from kvtier.cache.eviction import ToolAwarePolicy
from kvtier.cache.prefix_index import Tier
from tests.cache.test_tiers_e2e import always_load, prompt

PS, BLOCK = 16, 15360
PARAMS = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=True, ignore_eos=True)


class SlowHandle:
    """A copy that looks as if it took ``delay`` seconds (a busy copy engine)."""

    def __init__(self, handle, delay):
        self.handle, self.deadline = handle, time.monotonic() + delay

    def done(self):
        return time.monotonic() >= self.deadline and self.handle.done()

    def wait(self, timeout_s=None):
        time.sleep(max(0.0, min(self.deadline - time.monotonic(), timeout_s or 1e9)))
        return self.done()

    def result(self):
        time.sleep(max(0.0, self.deadline - time.monotonic()))
        return self.handle.result()


def test_unprobed_tier_gets_a_default_cost():
    model = CostModel()
    assert model.load_s(Tier.DISK, 10**9) == UNPROBED_TIER.load_s(10**9)
    model.observe_copy(Tier.DISK, 10**9, 0.5)
    assert Tier.DISK in model.tiers


def test_the_blocks_of_one_copy_job_move_the_bandwidth_estimate_as_one_observation():
    """A job of ``n`` blocks folded block by block (each ``1 / n`` of it) leaves the estimate
    where one observation of the whole job leaves it, whatever ``n``: it does not replace the
    estimate with the job's rate (as ``n`` whole observations did)."""
    import pytest
    from kvtier.cache.cost_model import TierCost

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


def test_pages_held_by_a_running_write_do_not_stop_the_next_request():
    llm = LLM("tiny", page_size=PS, num_device_pages=9, host_cache_bytes=64 * BLOCK)
    real = llm.engine.pool.tiers.copy_engine.gather
    llm.engine.pool.tiers.copy_engine.gather = lambda *a: SlowHandle(real(*a), 0.3)
    llm.generate(prompt_token_ids=[prompt(8 * PS + 1, 1)], sampling_params=PARAMS)
    out = llm.generate(prompt_token_ids=[prompt(8 * PS + 1, 2)], sampling_params=PARAMS)[0]
    assert len(out.token_ids) == 1


def test_two_loaded_prefixes_that_cannot_both_fit_take_turns():
    n = 8 * PS + 1
    a, b = prompt(n, 1), prompt(n, 2)
    llm = always_load(LLM("tiny", page_size=PS, num_device_pages=10, host_cache_bytes=64 * BLOCK))
    for p in (a, b, prompt(n, 3), prompt(n, 4)):
        llm.generate(prompt_token_ids=[p], sampling_params=PARAMS)
    llm.engine.pool.poll(wait=True)
    outs = llm.generate(prompt_token_ids=[a, b], sampling_params=PARAMS)
    assert outs[0].cached_tokens_by_tier["host"] > 0


def test_another_model_on_the_same_disk_dir_is_never_served_its_blocks(tmp_path):
    p = prompt(6 * PS + 1, 7)
    args = dict(page_size=PS, num_device_pages=16, host_cache_bytes=16 * BLOCK, disk_cache_dir=str(tmp_path),
                disk_cache_bytes=1 << 24)
    first = LLM("tiny", seed=0, **args)
    first.generate(prompt_token_ids=[p], sampling_params=PARAMS)
    first.engine.pool.poll(wait=True)
    other = always_load(LLM("tiny", seed=1, **args))  # same shapes, other weights
    assert other.generate(prompt_token_ids=[p], sampling_params=PARAMS)[0].num_cached_tokens == 0
    same = always_load(LLM("tiny", seed=0, **args))
    assert same.generate(prompt_token_ids=[p], sampling_params=PARAMS)[0].cached_tokens_by_tier["disk"] > 0


def test_disk_writes_in_flight_count_against_the_budget(tmp_path):
    from kvtier.cache.disk_tier import DiskTier
    llm = LLM("tiny", page_size=PS, num_device_pages=16, host_cache_bytes=64 * BLOCK, disk_cache_dir=str(tmp_path),
              disk_cache_bytes=2 * DiskTier.file_bytes(BLOCK))
    llm.generate(prompt_token_ids=[prompt(6 * PS + 1, 1)], sampling_params=PARAMS)
    llm.engine.pool.poll(wait=True)
    assert llm.engine.pool.stats().copy_errors == 0 and llm.engine.pool.tiers.disk.used_bytes <= 2 * DiskTier.file_bytes(BLOCK)


def test_returning_session_keeps_others_protection():
    pol = ToolAwarePolicy()
    shared, a_only, b_only = b"s" * 16, b"a" * 16, b"b" * 16
    pol.tool_wait("A", [shared, a_only], expected_wait_s=20.0, now=0.0)
    pol.tool_wait("B", [shared, b_only], expected_wait_s=40.0, now=0.0)
    pol.tool_return("A")
    from collections import OrderedDict
    assert pol.pick_page(OrderedDict.fromkeys([0, 1]), [shared, None], 5.0) == 1  # B still protects shared
    pol.tool_wait("C", [a_only], 100.0, 0.0)
    pol.tool_wait("C", [b_only], 100.0, 0.0)  # a new wait replaces the old one
    pol.tool_return("C")
    assert pol.pick_page(OrderedDict.fromkeys([0]), [a_only], 1.0) == 0 and not pol._protected.get(a_only)


def test_disk_tier_needs_a_host_block_and_waits_must_be_finite(tmp_path):
    import pytest
    with pytest.raises(ValueError, match="disk_cache_dir needs host_cache_bytes >= one block"):
        LLM("tiny", page_size=PS, num_device_pages=8, disk_cache_dir=str(tmp_path), disk_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="expected_wait_s must be a finite number"):
        ToolAwarePolicy().tool_wait("s", [], float("nan"), 0.0)


def test_write_back_keeps_the_host_copy_of_a_block_evicted_beside_blocks_it_must_copy():
    """Write-back evicts device blocks A (already on host, least recently used there) and D (not
    on host) with the host tier full: D's slot must come from another host copy, not A's (A's
    device copy is going away: evicting its host copy lost A, with no disk tier)."""
    import torch

    from kvtier.cache.config import PoolConfig
    from kvtier.cache.pool import KVPool

    pool = KVPool(PoolConfig(page_size=4, num_device_pages=4, host_cache_bytes=2 * 4 * 8 * 4,
                             write_policy="write-back"), [torch.zeros(4, 4, 8)])
    a, c, d = (bytes([i]) * 16 for i in (1, 2, 3))
    for h in (a, c):
        assert pool.tiers.index.insert(h, Tier.HOST, pool.tiers.host.allocate())
    pool.tiers.index.insert(a, Tier.DEVICE, 0)
    pool.tiers.index.insert(d, Tier.DEVICE, 1)
    pool.writes.evicting([(a, 0), (d, 1)])
    assert pool.tiers.index.held([a, c, d], Tier.HOST).tolist() == [True, False, True]
    assert [h for h, _ in pool.tiers.index.eviction_candidates(Tier.HOST, 2)] == [a, d]  # A as if written now
    assert pool.tiers.index.ref_count(a, Tier.HOST) == 0 and pool.stats().evictions["host"] == 1
    pool.tiers.index.check_invariants()


def test_the_host_probe_measures_bandwidth_with_many_blocks_not_one(monkeypatch):
    """One job of one small block measures the job's fixed cost: 960-byte blocks probed at 1-15
    MB/s (bulk: ~9 GB/s), and at the low end loads looked slower than recomputing, so none was
    made or observed and the pool never loaded from host for the whole run. The probe times a
    many-block job too (a fake clock: each job costs 100 us plus 1 us per block)."""
    import pytest

    from kvtier.cache import cost_model

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
    import torch

    from kvtier.cache.config import PoolConfig
    from kvtier.cache.pool import KVPool
    from kvtier.transfer import CopyEngine

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


def test_an_eviction_copy_that_fails_for_some_blocks_stores_the_others():
    """Write-back copies two evicted device blocks to host in one job that reports its first
    block failed: the other is indexed on host and its slot holds its bytes (before, no slot
    was written unless every block succeeded, yet the good blocks were indexed: a later load
    served whatever the slot held)."""
    import torch

    from kvtier.cache.config import PoolConfig
    from kvtier.cache.cost_model import TierCost
    from kvtier.cache.kv_state import KVState, TokenList
    from kvtier.cache.pool import KVPool
    from kvtier.transfer import CopyEngine

    class FirstBlockFails:
        """Gathers of two blocks or more report their first block failed."""

        def __init__(self):
            self.engine = CopyEngine()

        def gather(self, pools, pages, staging):
            handle = self.engine.gather(pools, pages, staging)
            if len(pages) < 2:
                return handle

            class Partial:
                run_s = 0.0
                done, wait = handle.done, handle.wait

                def result(self):
                    return [-1] + list(handle.result())[1:]
            return Partial()

        def __getattr__(self, name):
            return getattr(self.engine, name)

    loads = CostModel(prefill_tok_s=1e-3, tiers={Tier.HOST: TierCost(1e-6, 1e9)})  # always load
    pool = KVPool(PoolConfig(page_size=1, num_device_pages=2, host_cache_bytes=2 * 32, write_policy="write-back"),
                  [torch.zeros(2, 1, 8)], loads, copy_engine=FirstBlockFails())
    kv = KVState(TokenList([1, 2, 3]))
    pool.begin_prefix(kv)
    pool.finish_prefix(kv)
    assert pool.allocate(kv, 2)
    pool.kv_caches[0][kv.page_ids[0]] = 11.0
    pool.kv_caches[0][kv.page_ids[1]] = 22.0
    kv.num_computed_tokens = 2
    pool.register_computed(kv)
    pool.free(kv)
    other = KVState(TokenList([9, 9, 9]))
    assert pool.allocate(other, 2)  # evicts both blocks in one two-block gather
    # The last page is reused first, so block 1 is the job's first block: it failed.
    assert pool.tiers.index.held(kv.block_hashes, Tier.HOST).tolist() == [True, False] and pool.stats().copy_errors == 1
    slot = int(pool.tiers.index.match(kv.block_hashes[:1], [Tier.HOST])[0, Tier.HOST])
    assert torch.equal(pool.tiers.host.slot(slot).view(torch.float32), torch.full((8,), 11.0))
    assert len(pool.tiers.host._free) == 1  # the failed block's slot was given back
    pool.tiers.index.check_invariants()
