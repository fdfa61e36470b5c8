"""Copies between device and host under pressure: a write still running never stops the next
request, two loaded prefixes that cannot both fit on device take turns, and write-back keeps
the host copies it must and stores the blocks whose copy succeeded."""

import time

import torch

from kvtier import LLM, SamplingParams
from kvtier.cache.config import PoolConfig
from kvtier.cache.cost_model import CostModel, TierCost
from kvtier.cache.kv_state import KVState, TokenList
from kvtier.cache.pool import KVPool
from kvtier.cache.prefix_index import Tier
from kvtier.transfer import CopyEngine
from tests.helpers.serving import always_load, prompt

PS, BLOCK = 16, 15360  # tiny preset, fp32: one block = 15360 bytes
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


def test_write_back_keeps_the_host_copy_of_a_block_evicted_beside_blocks_it_must_copy():
    """Write-back evicts device blocks A (already on host, least recently used there) and D (not
    on host) with the host tier full: D's slot must come from another host copy, not A's (A's
    device copy is going away: evicting its host copy lost A, with no disk tier)."""
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


def test_an_eviction_copy_that_fails_for_some_blocks_stores_the_others():
    """Write-back copies two evicted device blocks to host in one job that reports its first
    block failed: the other is indexed on host and its slot holds its bytes (before, no slot
    was written unless every block succeeded, yet the good blocks were indexed: a later load
    served whatever the slot held)."""
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

