"""The router's prefill stage falls back (counted) instead of failing a turn."""

import asyncio

import httpx

from kvtier.cluster.router.pd import PrefillStage
from kvtier.cluster.router.routing import Router
from tests.cluster.disagg.helpers import free_dead_url


def _run(stage: PrefillStage, decode_url: str):
    async def go():
        async with httpx.AsyncClient(timeout=5.0) as client:
            return await stage.run(client, "/v1/chat/completions", b"{}", {"content-type": "application/json"},
                                   "s1", 10, decode_url)
    return asyncio.run(go())


def test_unreachable_prefill_worker_is_a_counted_fallback():
    dead = free_dead_url()
    stage = PrefillStage(Router([dead]))
    assert _run(stage, "http://127.0.0.1:1") is None
    assert stage.stats["turns"] == 1 and stage.stats["fallbacks"] == 1
    assert not stage.router.workers[dead].healthy and stage.router.workers[dead].inflight == 0
    assert _run(stage, "http://127.0.0.1:1") is None  # no healthy prefill worker left: straight to decode
    assert stage.stats["turns"] == 2 and stage.stats["fallbacks"] == 2


def test_transfer_reports_add_up():
    stage = PrefillStage(Router(["http://127.0.0.1:1"]))
    for failed in (False, True):
        stage._count({"failed": failed, "blocks_held": 3, "blocks_sent": 2, "blocks_lost": 1, "bytes_sent": 20,
                      "full_prompt_bytes": 60, "overlapped_s": 0.5, "exposed_s": 0.25})
    s = stage.stats
    assert (s["blocks_held"], s["blocks_sent"], s["blocks_lost"], s["bytes_sent"], s["full_prompt_bytes"]) == \
        (6, 4, 2, 40, 120)
    assert s["transfer_failures"] == 1 and s["fallbacks"] == 1 and s["overlapped_s"] == 1.0
