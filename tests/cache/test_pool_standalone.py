"""The pool stands alone: its own KV state, its seams as Protocols, progress left to the caller."""

import subprocess
import sys

import torch

from kvtier.sim.copies import SimCopyEngine, SimCopyHandle, SimDisk, TierLinks, VirtualClock
from kvtier.sim.hardware import Link
from kvtier.cache.config import PoolConfig
from kvtier.cache.cost_model import CostModel, TierCost
from kvtier.cache.disk_tier import DiskTier
from kvtier.cache.kv_state import KVState, TokenList
from kvtier.cache.pool import KVPool, PrefixStart
from kvtier.cache.prefix_index import Tier
from kvtier.cache.seams import CopyEngine, CopyJob, DiskStore
from kvtier.transfer import CopyEngine as NativeCopyEngine

PS, PAGES = 4, 8


def test_the_pool_and_its_tests_need_no_serving_layer():
    code = ("import sys, kvtier.cache.pool, kvtier.cache.seams, kvtier.sim.copies; "
            "print(sorted(m for m in sys.modules if m.startswith('kvtier.serve')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_native_and_simulated_parts_satisfy_the_seams(tmp_path):
    link = Link(latency_s=1e-6, bandwidth_Bps=1e9)
    sim = SimCopyEngine(VirtualClock(), TierLinks(64.0, host=link, disk=link))
    native = NativeCopyEngine(1)
    assert isinstance(sim, CopyEngine) and isinstance(native, CopyEngine)
    assert isinstance(SimDisk(1 << 20), DiskStore) and isinstance(DiskTier(tmp_path, 1 << 20), DiskStore)
    pools = [torch.zeros(2, PS, 2)]
    job = native.gather(pools, [1], torch.zeros(PS * 2))
    assert isinstance(job, CopyJob) and job.result() == [0]
    assert isinstance(sim.scatter(None, pools, [0]), SimCopyHandle)
    assert isinstance(sim.scatter(None, pools, [0]), CopyJob)


def _host_pool() -> KVPool:
    kv = [torch.randn(PAGES, PS, 2) for _ in range(2)]
    pool = KVPool(PoolConfig(page_size=PS, num_device_pages=PAGES, host_cache_bytes=16 * 64), kv)
    pool.tiers.cost_model = CostModel(tiers={Tier.HOST: TierCost(0.0, 1e15)}, prefill_tok_s=1.0)  # always load
    return pool


def _computed(pool: KVPool, tokens: list[int]) -> KVState:
    kv = KVState(TokenList(tokens))
    assert pool.allocate(kv, len(tokens))
    kv.num_computed_tokens = len(tokens)  # the caller (a scheduler) advances progress
    pool.register_computed(kv)
    pool.poll(wait=True)  # write-through copies ended: the pages are the request's only
    return kv


def test_the_pool_reports_what_it_placed_and_never_moves_progress():
    pool = _host_pool()
    tokens = list(range(50, 50 + 3 * PS + 1))
    writer = _computed(pool, tokens[:3 * PS])  # written through to host
    pool.free(writer)
    assert writer.num_computed_tokens == 3 * PS and writer.page_ids == []  # free leaves progress alone
    filler = _computed(pool, list(range(1000, 1000 + PAGES * PS)))  # evicts the device copies
    pool.free(filler)

    kv = KVState(TokenList(tokens))
    assert pool.begin_prefix(kv) is PrefixStart.LOADING and kv.loading and pool.loading == [kv]
    placed = pool.finish_prefix(kv)
    while placed is None:
        pool.wait_for_loads(0.05)
        placed = pool.finish_prefix(kv)
    assert placed == 3 * PS and kv.num_prefix_tokens == 3 * PS and kv.prefix_tokens_by_tier["host"] == 3 * PS
    assert kv.num_computed_tokens == 0 and not kv.loading and pool.loading == []  # progress is the caller's
    kv.num_computed_tokens = placed
    assert pool.truncate(kv, PS + 1) == PS and len(kv.page_ids) == 1
    assert kv.num_computed_tokens == placed  # the caller lowers it to what truncate reports


def test_a_request_freed_while_loading_gives_its_pages_back():
    pool = _host_pool()
    tokens = list(range(7, 7 + 2 * PS + 1))
    pool.free(_computed(pool, tokens[:2 * PS]))
    pool.free(_computed(pool, list(range(900, 900 + PAGES * PS))))
    kv = KVState(TokenList(tokens))
    assert pool.begin_prefix(kv) is PrefixStart.LOADING
    pool.free(kv)
    assert kv.page_ids == [] and not kv.loading and pool.loading == []
    assert pool.num_free_pages == PAGES and sum(pool.pages.ref_counts) == 0
    pool.tiers.index.check_invariants()
