"""The resume target in the pool: a tool-waiting session's blocks are kept on the device through
the wait when capacity allows, else demoted and prefetched back the cost model's load time plus a
margin before the expected return (a fake clock: no timing)."""

import pytest

from kvtier.cache.eviction import LRUPolicy, ToolAwarePolicy, plan_resume
from kvtier.cache.prefix_index import Tier
from tests.helpers.pools import PS, on_device, run
from tests.helpers.resume_pools import LOAD_LATENCY_S, make_pool


# ---- the decision, alone ------------------------------------------------------------------------
def test_plan_keeps_through_the_wait_when_capacity_allows():
    p = plan_resume(100.0, 20.0, 1.0, num_blocks=3, kept_blocks=0, capacity_blocks=8, target_s=2.0)
    assert p.kept and p.keep_until == 100.0 + 20.0 + 20.0 == p.hold_until  # return + max(S, 1.0 * wait)
    assert p.prefetch_at == 100.0 + 20.0 - 1.0 - 0.25 * 20.0  # what pressure evicted anyway comes back


def test_plan_demotes_then_prefetches_when_capacity_does_not_allow():
    p = plan_resume(100.0, 20.0, 1.0, num_blocks=3, kept_blocks=2, capacity_blocks=8, target_s=2.0)  # 5 > 4
    assert not p.kept
    assert p.keep_until == 100.0 + min(0.5 * 20.0, 30.0)  # the usual TTL
    assert p.prefetch_at == 100.0 + 20.0 - 1.0 - 5.0  # return - load - margin
    assert p.hold_until == 140.0


def test_plan_prefetches_at_once_when_the_load_takes_longer_than_the_wait():
    p = plan_resume(100.0, 2.0, 5.0, num_blocks=9, kept_blocks=0, capacity_blocks=8, target_s=3.0)
    assert not p.kept and p.prefetch_at == 100.0 and p.hold_until == 100.0 + 2.0 + 3.0  # grace: max(S, wait)


@pytest.mark.parametrize("kw, name", [(dict(load_s=-1.0), "load_s"), (dict(expected_wait_s=float("nan")),
                                                                        "expected_wait_s"),
                                      (dict(target_s=float("inf")), "target_s")])
def test_plan_rejects_bad_times(kw, name):
    args = dict(now=0.0, expected_wait_s=1.0, load_s=0.0, num_blocks=1, kept_blocks=0, capacity_blocks=4,
                target_s=1.0) | kw
    with pytest.raises(ValueError, match=name):
        plan_resume(**args)


def test_the_target_is_checked():
    for policy in (LRUPolicy(), ToolAwarePolicy()):
        with pytest.raises(ValueError, match="resume_ttft_s"):
            policy.set_resume_target(0.0)
    with pytest.raises(ValueError, match="resume_ttft_s"):
        make_pool(target=float("inf"))


# ---- in the pool ----------------------------------------------------------------------------------
@pytest.mark.parametrize("policy, kept", [("lru", False), ("tool-aware", True)])
def test_a_kept_session_stays_on_the_device_past_the_ttl(policy, kept):
    pool = make_pool(policy)
    agent = run(pool, range(12), 0)  # 3 blocks: fits in half of the 8 pages
    run(pool, range(200, 220), 3)  # 5 blocks: the agent's pages are now the least recently used
    hashes = agent.block_hashes[:3]
    pool.tool_wait("agent", list(range(12)), expected_wait_s=20.0)
    pool.tiers.clock.now += 15.0  # past the TTL (10 s) the policy has without a target
    run(pool, range(100, 112), 1)  # 3 blocks: LRU takes the agent's pages
    assert all(on_device(pool, hashes)) is kept
    assert pool.stats().prefetched_blocks == 0  # nothing had to come back


def test_a_declared_wait_is_prefetched_load_time_plus_margin_before_the_return():
    pool = make_pool()
    agent = run(pool, range(20), 0)  # 5 blocks: more than half of the device, so not kept
    hashes = agent.block_hashes[:5]
    pool.tool_wait("agent", list(range(20)), expected_wait_s=20.0)
    w = pool.tiers.policy.sessions["agent"]
    assert not w.kept and w.prefetch_at == pytest.approx(100.0 + 20.0 - LOAD_LATENCY_S - 5.0)
    pool.tiers.clock.now += 11.0  # the TTL is over: the blocks are ordinary victims
    run(pool, range(100, 132), 1)  # 8 blocks: the whole device
    assert not any(on_device(pool, hashes)) and pool.tiers.index.match(hashes, [Tier.HOST]).shape[0] == 5
    pool.tiers.clock.now = w.prefetch_at - 0.01
    pool.poll(wait=True)
    assert pool.stats().prefetched_blocks == 0  # not due yet
    pool.tiers.clock.now = w.prefetch_at
    pool.poll(wait=True)  # due: loaded before the expected return at 120 s
    assert pool.stats().prefetched_blocks > 0
    back = set(h for h, on in zip(hashes, on_device(pool, hashes)) if on)
    assert len(back) == pool.stats().prefetched_blocks
    pool.tiers.clock.now += 3.0  # still before the return
    run(pool, range(300, 304), 2)  # another request takes a page: not one the prefetch brought back
    assert back <= set(h for h, on in zip(hashes, on_device(pool, hashes)) if on)
    turn = run(pool, list(range(20)) + [7], 3)  # the returning turn
    assert turn.prefix_tokens_by_tier["device"] == len(back) * PS and turn.prefix_tokens_by_tier.get("host", 0) == (
        5 - len(back)) * PS
    pool.tiers.index.check_invariants()


def test_without_a_target_the_policy_plans_as_before():
    pool = make_pool(target=None)
    run(pool, range(20), 0)
    pool.tool_wait("agent", list(range(20)), expected_wait_s=20.0)
    w = pool.tiers.policy.sessions["agent"]
    assert (w.keep_until, w.prefetch_at, w.hold_until, w.kept) == (110.0, 118.0, None, False)


def test_kept_sessions_share_the_keep_budget():
    pool = make_pool(pages=16)  # keeps up to 8 blocks
    for i, sid in enumerate("abc"):
        run(pool, range(1000 * i, 1000 * i + 12), i)  # 3 blocks each
        pool.tool_wait(sid, list(range(1000 * i, 1000 * i + 12)), expected_wait_s=10.0)
    kept = {sid: w.kept for sid, w in pool.tiers.policy.sessions.items()}
    assert kept == {"a": True, "b": True, "c": False} and pool.tiers.policy.kept_blocks(pool.tiers.clock()) == 6
    pool.tool_return("a")  # its budget is free again
    pool.tool_wait("c", list(range(2000, 2012)), expected_wait_s=10.0)
    assert pool.tiers.policy.sessions["c"].kept
