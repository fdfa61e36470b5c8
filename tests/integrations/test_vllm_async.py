"""The connector's halves off vLLM's step and its learned cost model, without vLLM: a save queued by a
step returns before a slow tier finishes it; loads run on their own thread and report when they end;
the prefill rate comes from the steps seen; recompute made free loads nothing."""

import threading

import numpy as np
import pytest
import torch

from kvtier.cache.block_hash import block_hashes
from kvtier.cache.block_layout import BlockLayout
from kvtier.cache.config import PoolConfig
from kvtier.cache.host_tier import HostTier
from kvtier.cache.prefix_index import Tier
from kvtier.cache.remote import RemoteStatus, RemoteTier
from kvtier.integrations.vllm.rate import PrefillRate, macs_per_token, probe_prefill_tok_s
from kvtier.integrations.vllm.tiers import SchedulerIndex, StepPlan, WorkerTiers
from kvtier.serve.step_plan import pairs

LAYERS, BLOCKS, PAGE, HEADS, HEAD = 2, 8, 4, 2, 8


class GatedStore:
    """An in-memory remote store whose writes wait until the test opens the gate: a slow tier."""

    url = "gated://test"

    def __init__(self):
        self.values: dict[str, bytes] = {}
        self.gate = threading.Event()
        self.put_started = threading.Event()

    def batch_put(self, keys, values):
        self.put_started.set()
        self.gate.wait()
        self.values.update(zip(keys, (bytes(v) for v in values)))
        return [RemoteStatus.OK] * len(keys)

    def batch_get(self, keys, outs):
        statuses = []
        for k, out in zip(keys, outs):
            if k in self.values:
                out[:] = self.values[k]
                statuses.append(RemoteStatus.OK)
            else:
                statuses.append(RemoteStatus.MISSING)
        return statuses

    def exists(self, keys):
        return [k in self.values for k in keys]

    def close(self):
        pass


def caches(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(BLOCKS, HEADS, PAGE, HEAD, generator=g) for _ in range(LAYERS)]


def make(cache_list, host_blocks=4, prefill_tok_s=1.0):
    layout = BlockLayout.of_caches(cache_list, 0, 1)
    pool = PoolConfig(page_size=PAGE, host_cache_bytes=host_blocks * HostTier.row_bytes(layout.block_bytes),
                      salt=b"model")
    return SchedulerIndex(pool, layout, prefill_tok_s), WorkerTiers(pool, cache_list, 0, 1)


def test_a_step_returns_before_a_slow_tier_finishes_its_save():
    src = caches(1)
    sched, worker = make(src)
    store = GatedStore()
    worker.remote = RemoteTier(store, worker.meta, timeout_s=60.0)
    sched.remote = RemoteTier(store, worker.meta, timeout_s=60.0)
    hs = block_hashes(list(range(3 * PAGE)), PAGE, salt=b"model")
    plan = StepPlan(saves=[sched.plan_save([5, 2, 7], hs)])
    assert plan.saves[0].to_remote
    worker.submit_save(plan)  # what wait_for_save does at the end of a step
    worker.fence()  # what the next step waits for: the blocks are out of vLLM's caches
    assert store.put_started.wait(60.0)  # the remote write runs ...
    assert worker.saves_in_flight() == 1 and store.values == {}  # ... and has not ended
    assert worker.stats.saved_host == 3 and worker.stats.written_remote == 0
    want = [c.clone() for c in src]
    for c in src:  # the next forward pass may overwrite the freed blocks: the host copies stay right
        c.zero_()
    job = sched.plan_load("r", [0, 1, 3], hs)
    assert worker.load([job]) == set()
    sched.loaded(job)
    assert all(torch.equal(x[[0, 1, 3]], y[[5, 2, 7]]) for x, y in zip(src, want))
    store.gate.set()
    worker.wait_idle()
    assert worker.saves_in_flight() == 0 and len(store.values) == 3 and worker.stats.written_remote == 3
    worker.close()


def test_loads_run_off_the_step_and_report_when_they_end():
    src = caches(2)
    sched, worker = make(src)
    hs = block_hashes(list(range(2 * PAGE)), PAGE, salt=b"model")
    worker.save(StepPlan(saves=[sched.plan_save([4, 6], hs)]))
    want = [c.clone() for c in src]
    job = sched.plan_load("r1", [0, 1], hs)
    assert sched.index.ref_count(hs[0], Tier.HOST) == 1  # locked: its slot is not reused mid-load
    worker.submit_load(job)
    worker.wait_idle()
    done, failed = worker.finished_loads()
    assert done == {"r1"} and failed == set() and not worker.loading("r1")
    sched.loaded(job)
    assert sched.index.ref_count(hs[0], Tier.HOST) == 0
    assert all(torch.equal(x[[0, 1]], y[[4, 6]]) for x, y in zip(src, want))
    assert worker.finished_loads() == (set(), set())  # reported once
    worker.close()


def test_recompute_made_free_loads_nothing():
    """The decision, not the timing: the connector sets the cost model's rate from its
    PrefillRate before choosing; a rate at which recomputing costs nothing chooses no load."""
    src = caches(3)
    sched, worker = make(src)
    hs = block_hashes(list(range(3 * PAGE)), PAGE, salt=b"model")
    worker.save(StepPlan(saves=[sched.plan_save([0, 1, 2], hs)]))
    assert sched.sources(hs) == [Tier.HOST] * 3
    for tok_s, want in [(1e18, 0), (1.0, 3)]:
        rate = PrefillRate(tok_s, learn=False)
        sched.cost_model.prefill_tok_s = rate.rate(0, len(hs) * PAGE)
        assert sched.blocks_to_load(hs)[0] == want, tok_s
    worker.close()


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_the_prefill_rate_is_learned_from_the_steps_seen():
    clock = FakeClock()
    w_step, w_tok, w_pair, w_dec = 2e-3, 5e-5, 1e-8, 1e-4  # the "true" step time of this fake engine
    rate = PrefillRate(123.0, clock=clock)
    assert rate.rate(0, 512) == pytest.approx(123.0)  # the probe's figure until steps are seen
    rng = np.random.default_rng(0)
    for i in range(200):
        if i % 2:
            extends, decodes, ctx = [(int(rng.integers(32, 2048)), int(rng.integers(0, 4096)))], 0, 0
        else:
            extends, decodes, ctx = [], int(rng.integers(1, 8)), int(rng.integers(100, 8000))
        rate.step_started(extends, decodes, ctx)
        clock.t += (w_step + sum(w_tok * n + w_pair * pairs(c, n) for n, c in extends) + w_dec * decodes)
        rate.step_ended()
    truth = w_tok * 1024 + w_pair * pairs(2048, 1024)
    assert rate.model.weights is not None
    assert abs(rate.recompute_s(2048, 1024) - truth) < 0.05 * truth
    frozen = PrefillRate(123.0, learn=False, clock=clock)
    frozen.step_started([(100, 0)], 0, 0)
    clock.t += 1.0
    frozen.step_ended()
    assert frozen.rate(0, 512) == pytest.approx(123.0)


def test_the_probe_gives_a_positive_first_rate():
    class Cfg:
        hidden_size, num_hidden_layers, intermediate_size, num_attention_heads, num_key_value_heads = 64, 2, 128, 4, 2
    macs = macs_per_token(Cfg)
    assert macs == 2 * (64 * (4 + 2 * 2) * 16 + 4 * 16 * 64 + 3 * 64 * 128)
    assert probe_prefill_tok_s(Cfg, repeats=1) > 0


def test_layer_by_layer_loads_fill_each_layer_before_its_attention_waits_end():
    src = caches(4)
    sched, worker = make(src)
    hs = block_hashes(list(range(2 * PAGE)), PAGE, salt=b"model")
    worker.save(StepPlan(saves=[sched.plan_save([5, 7], hs)]))
    want = [c.clone() for c in src]
    for c in src:
        c.zero_()
    job = sched.plan_load("r", [1, 2], hs)
    assert worker.native_host_load(job)  # host slots -> vLLM-layout CPU caches: the native copy engine
    worker.start_layered([job])  # start_load_kv, before the forward pass
    for layer in range(LAYERS):  # wait_for_layer_load as each attention layer runs
        worker.wait_layer(layer)
        assert torch.equal(src[layer][[1, 2]], want[layer][[5, 7]]), layer
    assert worker.end_layered() == set()  # wait_for_save: the step's loads ended, none failed
    assert worker.stats.loaded["host"] == 2
    worker.close()
