"""The router's HTTP front: OpenAI-compatible routes proxied to workers with httpx (streams
passed through chunk by chunk), a poller of each worker's ``/metrics``, and ``/health``."""

from __future__ import annotations

import asyncio
import json
import re
import time
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from kvtier.cache.kv_events import KVEventSubscriber
from kvtier.cluster.router.pd import TRANSFER_HEADER
from kvtier.cluster.router.routing import Router

SESSION_HEADER = "x-session-id"
WORKER_HEADER = "x-kvtier-worker"  # which worker served the response
_FORWARD = ("content-type", "authorization", SESSION_HEADER)


def check_workers(urls: list[str], timeout_s: float = 5.0) -> dict[str, dict]:
    """Every worker answers ``/health``; returns each one's answer (``kv_events``: its KV events
    endpoint, when it publishes them).

    Raises:
        ValueError: the unreachable or unhealthy URLs, named.
    """
    bad, health = [], {}
    for u in urls:
        try:
            r = httpx.get(f"{u}/health", timeout=timeout_s)
            if r.status_code != 200:
                bad.append(u)
            else:
                health[u] = r.json()
        except (httpx.HTTPError, ValueError) as e:
            bad.append(f"{u} ({type(e).__name__})")
    if bad:
        raise ValueError(f"--workers: not answering /health: {', '.join(bad)}")
    return health


def subscribe_events(router: Router, health: dict[str, dict]) -> KVEventSubscriber | None:
    """Subscribe ``router`` to the KV events of the workers that publish them (their ``/health``
    names the endpoint); None when none does."""
    endpoints = {u: h["kv_events"] for u, h in health.items() if h.get("kv_events")}
    if not endpoints:
        return None
    sub = KVEventSubscriber(endpoints.values())
    router.view, router.worker_ids = sub.view, dict(endpoints)
    return sub


async def poll_worker(client: httpx.AsyncClient, w) -> None:
    """Refresh ``w``'s load from its ``/metrics``. A refused connection, an error status, or a
    ``/health`` of 503 (its engine thread stalled with work queued) takes it out of routing; a
    slow answer (a busy worker) only leaves its figures as they were."""
    try:
        health = await client.get(f"{w.url}/health", timeout=5.0)
        health.raise_for_status()
        r = await client.get(f"{w.url}/metrics", timeout=5.0)
        r.raise_for_status()
        values = {s.name: s.value for fam in text_string_to_metric_families(r.text) for s in fam.samples}
        w.waiting, w.running = int(values.get("kvtier_requests_waiting", 0)), int(values.get("kvtier_requests_running", 0))
        w.healthy = True
    except httpx.TimeoutException:
        pass
    except (httpx.HTTPError, ValueError):
        w.healthy = False


def _prompt_tokens_estimate(body: dict) -> int:
    """Tokens of a request's prompt, roughly (4 characters a token): the router does not tokenize."""
    text = body.get("messages") if "messages" in body else body.get("prompt", "")
    return max(1, len(json.dumps(text)) // 4)


def build_router_app(router: Router, poll_s: float = 0.25, events: KVEventSubscriber | None = None,
                     prefill=None) -> FastAPI:
    """The router application over ``router`` (its workers were checked by :func:`check_workers`);
    ``events`` (from :func:`subscribe_events`) feeds ``router.view`` on every poll. ``prefill``
    (a :class:`kvtier.cluster.router.pd.PrefillStage`): ``router``'s workers are decode workers, and
    each turn is prefilled on one of the stage's prefill workers first."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0))
    stage_workers = list(prefill.router.workers.values()) if prefill is not None else []

    async def poller():
        while True:
            await asyncio.gather(*(poll_worker(client, w) for w in [*router.workers.values(), *stage_workers]))
            if events is not None:
                events.poll(0.0)
            await asyncio.sleep(poll_s)

    @asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(poller())
        yield
        task.cancel()
        await client.aclose()
        if events is not None:
            events.close()

    app = FastAPI(title="kvtier router", lifespan=lifespan)
    app.state.router = router

    @app.get("/health")
    async def health():
        workers = {w.url: {"healthy": w.healthy, "waiting": w.waiting, "running": w.running}
                   for w in router.workers.values()}
        status = 200 if router.healthy() else 503
        extra = {} if prefill is None else {"prefill_workers": {w.url: {"healthy": w.healthy} for w in stage_workers},
                                            "pd": dict(prefill.stats)}
        return JSONResponse({"status": "ok" if status == 200 else "no healthy worker", "policy": router.policy,
                             "workers": workers, "sessions": len(router.sessions), "session_moves": router.moves,
                             **extra}, status_code=status)

    @app.get("/v1/models")
    async def models():
        for w in router.healthy():
            try:
                r = await client.get(f"{w.url}/v1/models")
                return Response(r.content, r.status_code, media_type="application/json")
            except httpx.HTTPError:
                w.healthy = False
        return _no_worker()

    async def route(request: Request, path: str):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = {}
        sid = (body.get("session_id") if isinstance(body, dict) else None) or request.headers.get(SESSION_HEADER)
        est = _prompt_tokens_estimate(body) if isinstance(body, dict) else 1
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARD}
        tried, pd_headers = set(), {}
        while True:
            live = [w for w in router.healthy() if w.url not in tried]
            if not live:
                return _no_worker()
            url = router.choose(sid, est) if not tried else min(live, key=lambda w: w.load).url
            if prefill is not None and not tried:  # P/D: the prompt's blocks go to ``url`` first
                done = await prefill.run(client, path, raw, headers, sid, est, url)
                pd_headers = {TRANSFER_HEADER: json.dumps(done["transfer"] if done else None)}
            tried.add(url)
            w = router.workers[url]
            w.inflight += 1
            t0 = time.monotonic()
            try:
                req = client.build_request("POST", f"{url}{path}", content=raw, headers=headers)
                resp = await client.send(req, stream=True)
            except (httpx.ConnectError, httpx.RemoteProtocolError):
                w.inflight -= 1
                w.healthy = False  # dead or unreachable: out of routing until a poll succeeds
                continue
            except httpx.HTTPError as e:
                w.inflight -= 1
                return JSONResponse({"error": {"message": f"worker {url}: {type(e).__name__}", "type": "bad_gateway",
                                               "code": 502}}, status_code=502)
            if isinstance(body, dict) and body.get("stream"):
                return StreamingResponse(_relay(resp, w, router, sid, est, t0), status_code=resp.status_code,
                                         media_type=resp.headers.get("content-type"),
                                         headers={WORKER_HEADER: url, **pd_headers})
            try:
                content = await resp.aread()
            finally:
                await resp.aclose()
                w.inflight -= 1
            if resp.status_code == 200:
                usage = json.loads(content).get("usage") or {}
                last = usage.get("kv_last_block")
                router.record(sid, url, int(usage.get("prompt_tokens", est)), time.monotonic() - t0,
                              bytes.fromhex(last) if last else None)
            return Response(content, resp.status_code, media_type=resp.headers.get("content-type"),
                            headers={WORKER_HEADER: url, **pd_headers})

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await route(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await route(request, "/v1/completions")

    return app


_USAGE_IN_STREAM = re.compile(rb'"prompt_tokens":\s*(\d+).*?"kv_last_block":\s*"([0-9a-f]{32})"', re.S)


async def _relay(resp: httpx.Response, w, router: Router, sid, est: int, t0: float):
    tokens, last, tail = est, None, b""
    try:
        async for chunk in resp.aiter_raw():
            yield chunk
            m = _USAGE_IN_STREAM.search(tail + chunk)  # the usage chunk (stream_options.include_usage)
            if m:
                tokens, last = int(m.group(1)), bytes.fromhex(m.group(2).decode())
            tail = chunk[-512:]
        router.record(sid, w.url, tokens, time.monotonic() - t0, last)
    finally:
        await resp.aclose()
        w.inflight -= 1


def _no_worker() -> JSONResponse:
    return JSONResponse({"error": {"message": "no healthy worker", "type": "service_unavailable", "code": 503}},
                        status_code=503)
