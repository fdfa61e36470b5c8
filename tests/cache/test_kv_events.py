"""KV events: a subscriber rebuilds a worker's index from its published event batches alone."""

import time

import pytest
import torch

from kvtier import LLM, SamplingParams
from kvtier.cache.block_hash import block_hashes
from kvtier.cache.kv_events import EventBatch, GlobalKVView, KVEventPublisher, KVEventSubscriber
from kvtier.cache.prefix_index import Tier

PS = 16


def prompt(n, seed):
    return torch.randint(0, 163840, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def connected(pub, sub, timeout_s=10.0):
    """Heartbeats until the subscriber sees the publisher (a PUB drops what it sends before)."""
    end = time.monotonic() + timeout_s
    while pub.worker_id not in sub.view.workers and time.monotonic() < end:
        pub([])
        sub.poll(0.05)
    assert pub.worker_id in sub.view.workers


def test_view_rebuilt_from_events_equals_the_workers_index():
    llm = LLM("tiny", page_size=PS, num_device_pages=24, host_cache_bytes=2 << 20)
    pool = llm.engine.pool
    pub = KVEventPublisher("tcp://127.0.0.1:0", "worker-a")
    sub = KVEventSubscriber([pub.endpoint])
    try:
        connected(pub, sub)
        pool.publish_events_to(pub)
        prompts = [prompt(150, s) for s in range(4)] + [prompt(150, 0)[:100] + prompt(50, 9)]
        for p in prompts:  # 24 device pages: later prompts evict earlier blocks
            llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(max_tokens=3, ignore_eos=True))
        pool.poll(wait=True)
        pool.poll()
        while sub.poll(0.5):
            pass
        view = sub.view
        assert view.gaps["worker-a"] == 0
        hashes = {h for p in prompts for h in block_hashes(p[:len(p) // PS * PS], PS, None, pool.config.salt)}
        assert pool.stats().evictions["device"] > 0 and view.blocks("worker-a", "host")
        for tier in (Tier.DEVICE, Tier.HOST):
            held = {h for h in hashes if len(pool.tiers.index.match([h], [tier])) == 1}
            assert view.blocks("worker-a", tier.name.lower()) == held
    finally:
        sub.close()
        pub.close()


def test_batch_round_trip_and_gaps():
    h = bytes(range(16))
    batch = EventBatch("w", 3, [(True, "disk", h), (False, "device", h)])
    assert EventBatch.decode(batch.encode()) == batch
    view = GlobalKVView()
    view.apply(EventBatch("w", 0, [(True, "host", h), (True, "device", h)]))
    assert view.prefix_tiers("w", [h, b"x" * 16]) == ["device"]
    view.apply(EventBatch("w", 2, [(False, "device", h)]))
    assert view.gaps["w"] == 1 and view.tiers("w", h) == {"host"}


def test_state_checkpoint_events_round_trip_and_build_their_own_view():
    h, k = bytes(range(16)), bytes(range(1, 17))
    batch = EventBatch("w", 0, [(True, "host", h)], [(True, "device", k), (True, "host", k)])
    assert EventBatch.decode(batch.encode()) == batch
    old_reader = EventBatch.decode(EventBatch("w", 0, [(True, "host", h)]).encode())
    assert old_reader.states == []  # a batch without checkpoints carries no "states" key
    view = GlobalKVView()
    view.apply(batch)
    assert view.state_tiers("w", k) == {"device", "host"}
    assert view.resume_tiers("w", k) == set()  # a checkpoint without its block: nothing to resume from
    assert view.tiers("w", k) == set() and view.state_tiers("w", h) == set()  # blocks and states apart
    view.apply(EventBatch("w", 1, [], [(False, "device", k)]))
    assert view.state_tiers("w", k) == {"host"}
    view.apply(EventBatch("w", 2, [(True, "device", k)]))
    assert view.resume_tiers("w", k) == {"device"} and view.resume_tiers("w", h) == set()  # h has no checkpoint


def test_a_hybrid_pool_publishes_its_checkpoints_beside_its_blocks():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model's ops are microseconds: one thread, as kvtier bench runs
    llm = LLM("tiny-k3", dtype="float32", page_size=PS, num_device_pages=24, host_cache_bytes=4 << 20)
    pool = llm.engine.pool
    pub = KVEventPublisher("tcp://127.0.0.1:0", "worker-k3")
    sub = KVEventSubscriber([pub.endpoint])
    try:
        connected(pub, sub)
        pool.publish_events_to(pub)
        for s in range(3):
            llm.generate(prompt_token_ids=[prompt(70, s)], sampling_params=SamplingParams(max_tokens=3, ignore_eos=True))
        pool.poll(wait=True)
        pool.poll()
        while sub.poll(0.5):
            pass
        store = pool.resume_rule.store
        keys = [k for s in range(3) for k in block_hashes(prompt(70, s)[:64], PS, None, pool.config.salt)]
        held = {k: {t.name.lower() for t in store.where(k)} for k in keys if store.where(k)}
        assert held and all(sub.view.resume_tiers("worker-k3", k) <= sub.view.tiers("worker-k3", k) for k in keys)
        assert {k: sub.view.state_tiers("worker-k3", k) for k in held} == held
    finally:
        torch.set_num_threads(threads)
        sub.close()
        pub.close()


def test_publisher_names_a_bad_endpoint():
    with pytest.raises(ValueError, match="tcp://256.0.0.1:1"):
        KVEventPublisher("tcp://256.0.0.1:1", "w")
