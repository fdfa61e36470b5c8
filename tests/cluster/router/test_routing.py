"""Routing decisions of ``kvtier router`` (no processes): sticky, least-loaded, kv-aware."""

import pytest

from kvtier.cluster.router.routing import Router

A, B = "http://a", "http://b"


def test_kv_aware_keeps_a_session_then_moves_it_when_its_worker_is_overloaded():
    r = Router([A, B], policy="kv-aware", remote=True)
    r.record("s", A, 2000, 0.5)
    assert r.choose("s", 2100) == A
    r.workers[A].waiting = 8
    assert r.choose("s", 2100) == B
    r.record("s", B, 2100, 0.5)
    assert r.moves == 1
    r.workers[B].healthy = False
    assert r.choose("s", 2100) == A
    r.record("s", B, 2200, 0.5)
    assert r.moves == 1  # the same worker again: no move


def test_kv_aware_without_remote_counts_recomputation():
    r = Router([A, B], policy="kv-aware", remote=False)
    r.record("s", A, 20000, 0.5)
    r.workers[A].waiting = 2  # 1 s of queue < 10 s of recomputing 20000 tokens elsewhere
    assert r.predicted_ttft(r.workers[B], "s", 20000) > r.predicted_ttft(r.workers[A], "s", 20000)
    assert r.choose("s", 20000) == A


def test_sticky_and_least_loaded():
    sticky = Router([A, B], policy="sticky")
    sticky.record("s", B, 100, 0.1)
    sticky.workers[B].waiting = 50
    assert sticky.choose("s", 100) == B
    least = Router([A, B], policy="least-loaded")
    least.workers[A].running = 3
    assert least.choose("s", 100) == B


def test_bad_router_arguments_are_named():
    with pytest.raises(ValueError, match="policy"):
        Router([A], policy="random")
    with pytest.raises(ValueError, match="workers"):
        Router([])
    r = Router([A])
    r.workers[A].healthy = False
    with pytest.raises(RuntimeError, match="no healthy worker"):
        r.choose(None, 1)


def test_kv_aware_follows_the_event_view_when_it_has_one():
    from kvtier.cache.kv_events import EventBatch, GlobalKVView

    view, h = GlobalKVView(), b"\x07" * 16
    r = Router([A, B], policy="kv-aware", remote=False, view=view, worker_ids={A: "ev-a", B: "ev-b"})
    view.apply(EventBatch("ev-a", 0, []))
    view.apply(EventBatch("ev-b", 0, [(True, "host", h)]))  # B holds the prefix, not A
    r.record("s", A, 20000, 0.5, last_block=h)
    assert r.prefix_tier(B, r.sessions["s"]) == "local" and r.prefix_tier(A, r.sessions["s"]) is None
    assert r.choose("s", 20000) == B


def test_kv_aware_counts_a_hybrid_workers_prefix_only_where_it_holds_the_checkpoint():
    """A hybrid model's worker that holds the session's blocks but not the state checkpoint at the
    prompt's last block cannot reuse them: the router does not count it local."""
    from kvtier.cache.kv_events import EventBatch, GlobalKVView

    view, h, other = GlobalKVView(), b"\x07" * 16, b"\x08" * 16
    r = Router([A, B], policy="kv-aware", remote=False, view=view, worker_ids={A: "ev-a", B: "ev-b"})
    view.apply(EventBatch("ev-a", 0, [(True, "host", h)], [(True, "host", other)]))  # blocks, no checkpoint at h
    view.apply(EventBatch("ev-b", 0, [(True, "disk", h)], [(True, "disk", h)]))
    r.record("s", A, 20000, 0.5, last_block=h)
    assert r.prefix_tier(A, r.sessions["s"]) is None and r.prefix_tier(B, r.sessions["s"]) == "local"
    assert r.choose("s", 20000) == B
    view.apply(EventBatch("ev-a", 1, [], [(True, "device", h)]))
    assert r.prefix_tier(A, r.sessions["s"]) == "local"


def test_a_worker_whose_health_is_503_leaves_routing_until_it_recovers():
    import asyncio

    import httpx

    from kvtier.cluster.router.app import poll_worker

    state = {"health": 503}

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(state["health"], json={"status": "ok"})
        return httpx.Response(200, text="kvtier_requests_waiting 2.0\nkvtier_requests_running 1.0\n")

    r = Router([A, B], policy="least-loaded")

    async def poll():
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            await poll_worker(client, r.workers[A])

    asyncio.run(poll())
    assert not r.workers[A].healthy and r.choose(None, 10) == B  # a stalled engine: not routed to
    state["health"] = 200
    asyncio.run(poll())
    assert r.workers[A].healthy and (r.workers[A].waiting, r.workers[A].running) == (2, 1)
