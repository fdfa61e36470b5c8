"""``Engine.stats()``, ``Scheduler.stats()`` and ``KVPool.stats()`` are frozen copies: later steps
never change a snapshot already taken, a reader cannot rebind its fields, and its values are the
ones the engine, its scheduler and its pool hold when it is taken."""

from __future__ import annotations

import dataclasses

import pytest

from kvtier import LLM, SamplingParams
from kvtier.cache.prefix_index import Tier
from kvtier.serve.stats import SchedulerStats

PS = 16
PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def test_snapshots_are_frozen_copies_with_the_live_values():
    llm = LLM("tiny", page_size=PS, num_device_pages=32, host_cache_bytes=8 << 20)
    engine, pool = llm.engine, llm.engine.pool
    first = engine.stats()
    assert first.steps == 0 and first.prefill_tokens == 0 and first.grammar is None
    assert first.scheduler == SchedulerStats(waiting=0, loading=0, running=0, preemptions=0)
    assert first.pool.num_pages == 32 and first.pool.num_free_pages == 32
    assert first.pool.hit_tokens == {"device": 0, "host": 0, "disk": 0} and "remote" not in first.pool.sections

    prompt = list(range(1, 4 * PS + 5))
    engine.add_request(prompt, PARAMS)
    queued = engine.stats()
    assert queued.scheduler == SchedulerStats(waiting=1, loading=0, running=0, preemptions=0)
    while engine.has_unfinished():
        engine.step()
    llm.generate(prompt_token_ids=[prompt], sampling_params=PARAMS)  # its blocks are device hits now
    pool.poll(wait=True)
    later = engine.stats()

    # What was taken before stays as it was.
    assert first.steps == 0 and first.pool.hit_tokens["device"] == 0 and first.pool.cached_blocks["device"] == 0
    assert queued.scheduler.waiting == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        later.steps = 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        later.pool.copy_errors = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        later.scheduler.waiting = 3
    later.pool.hit_tokens["device"] = -1  # a copy: the pool's own counters are not touched
    assert pool.stats().hit_tokens["device"] > 0

    # ...and the new one holds the live values.
    assert later.steps == engine.num_steps > 0 and later.prefill_tokens == engine.num_prefill_tokens > 0
    assert later.scheduler == engine.scheduler.stats() == SchedulerStats(0, 0, 0, engine.scheduler.num_preemptions)
    now = pool.stats()
    assert now.num_free_pages == pool.num_free_pages and now.num_pages == 32
    assert now.cached_blocks == {t.name.lower(): pool.tiers.index.num_copies(t) for t in (Tier.DEVICE, Tier.HOST, Tier.DISK)}
    assert now.cached_blocks["device"] >= 4 and now.cached_blocks["host"] >= 4  # written through to host
    assert now.hit_tokens["device"] >= 4 * PS  # the second run of the prompt reused its blocks
    assert now.bytes_written["host"] > 0 and now.copy_errors == 0
