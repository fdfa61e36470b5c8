"""HTTP routes of worker roles (added to ``kvtier serve``'s application by :func:`add_role_routes`).

Every role answers ``GET /v1/kv/info`` (role, the layout of each kind of object its pool
exchanges, salt digest). Workers that decode (``decode``, ``both``) answer ``POST /v1/kv/held``
(JSON ``{"block_hashes": [hex, ...]}`` -> ``{"held": n}``, the leading blocks held in a local tier)
and take each kind of object at ``POST /v1/kv/<kind>`` (``blocks``, and what the pool's resume rule
needs at a prefix's end: :meth:`kvtier.cache.pool.KVPool.layouts`): a stream of checked wire values
of its layout (:mod:`kvtier.cluster.disagg.blocks`), each kept as soon as it is complete. A ``prefill`` worker answers ``POST /v1/kv/prefill/chat/completions`` and
``/v1/kv/prefill/completions`` (the OpenAI body; the target in the ``x-kvtier-decode-url``
header, one of its ``--decode-workers``) with the first token and the transfer's report; it
refuses plain ``/v1/chat/completions`` and ``/v1/completions`` with a 400 that says where to send
them, so no request is dropped silently.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import re

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from kvtier.cluster.disagg.blocks import ValueReader
from kvtier.cluster.disagg.worker import DisaggMetrics, PrefillJob
from kvtier.serve.api.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    json_body,
    parse,
)

ROLES = ("prefill", "decode", "both")
DECODE_URL_HEADER = "x-kvtier-decode-url"
SESSION_HEADER = "x-session-id"
MAX_HELD_QUERY = 1 << 16  # block hashes in one held query (a 1M-token prompt at page_size 16)
_HEX_HASH = re.compile(r"[0-9a-f]{32}")


def check_role(role) -> str:
    """``role`` if it is one of :data:`ROLES`.

    Raises:
        ValueError: anything else, naming ``--role``, the value and the choices.
    """
    if role not in ROLES:
        raise ValueError(f"--role must be one of {list(ROLES)}, got {role!r}")
    return role


def worker_info(engine, role: str) -> dict:
    """What ``/v1/kv/info`` answers: the role, the layout of each kind of object the pool exchanges
    (``layouts``, by name) and a digest of the block-hash salt (workers exchange blocks only when
    both match)."""
    return {"role": role, "layouts": {k: dataclasses.asdict(m) for k, m in engine.pool.layouts().items()},
            "salt": hashlib.sha256(engine.block_hash_salt).hexdigest()[:32]}


def add_role_routes(app, worker, role: str, metrics: DisaggMetrics, decode_urls: list[str] = ()) -> None:
    """Add the routes of ``role`` to ``app`` (built by :func:`kvtier.serve.api.app.build_app`)."""
    info = worker_info(worker.engine, role)

    @app.get("/v1/kv/info")
    async def kv_info():
        return info

    if role in ("decode", "both"):
        _add_decode_routes(app, worker, metrics)
    if role == "prefill":
        _add_prefill_routes(app, worker, metrics, set(decode_urls))


def _add_decode_routes(app, worker, metrics: DisaggMetrics) -> None:
    pool = worker.engine.pool

    @app.post("/v1/kv/held")
    async def held(request: Request):
        hashes = _held_query(await json_body(request))
        return {"held": await worker.call(lambda: pool.held_prefix(hashes))}

    for kind, meta in pool.layouts().items():
        app.post(f"/v1/kv/{kind}")(_import_route(worker, kind, meta, metrics))


def _import_route(worker, kind: str, meta, metrics: DisaggMetrics):
    """``POST /v1/kv/<kind>``: a stream of wire values of layout ``meta``, each kept as soon as it is
    complete (:meth:`kvtier.cache.pool.KVPool.import_values`); the counts by result, corrupt and
    truncated values included (blocks' also in ``kvtier_kv_import_blocks_total``)."""
    pool = worker.engine.pool

    async def import_values(request: Request):
        reader = ValueReader(meta)
        counts = {"stored": 0, "duplicate": 0, "refused": 0}
        nbytes = 0
        try:
            async for data in request.stream():
                nbytes += len(data)
                good = reader.feed(data)
                if good:
                    for k, v in (await worker.call(lambda good=good: pool.import_values(kind, good))).items():
                        counts[k] += v
        except ClientDisconnect:
            pass  # a cut transfer: the complete values are kept, the rest is recomputed
        reader.close()
        counts.update(corrupt=reader.corrupt, truncated=reader.truncated)
        if kind == "blocks":
            metrics.observe_import(counts, nbytes)
        return counts

    return import_values


def _add_prefill_routes(app, worker, metrics: DisaggMetrics, decode_urls: set[str]) -> None:
    @app.middleware("http")
    async def refuse_turns(request: Request, call_next):
        if request.url.path in ("/v1/chat/completions", "/v1/completions"):
            err = ApiError(400, f"{request.url.path}: this worker has --role prefill and does not decode; send "
                           "turns to the router (kvtier router --prefill-workers ... --decode-workers ...) or "
                           "to a worker with --role decode or both", "role")
            return JSONResponse(err.body(), status_code=400)
        return await call_next(request)

    async def prefill(request: Request, kind: str):
        target = (request.headers.get(DECODE_URL_HEADER) or "").rstrip("/")
        if target not in decode_urls:
            raise ApiError(400, f"{DECODE_URL_HEADER}: {target!r} is not one of this worker's --decode-workers "
                           f"{sorted(decode_urls)}", DECODE_URL_HEADER)
        body = await json_body(request)
        if kind == "chat":
            req = parse(ChatRequest, body)
            # the prompt the decode worker will render: K3's prompt fields too (thinking, tool_choice, ...)
            options = req.prompt_options(getattr(worker.tokenizer, "chat_format", None), req.params())
            payload, sid, hint = {"messages": req.messages, "prompt_options": options}, \
                req.session(request.headers.get(SESSION_HEADER)), req.expected_tool_wait_s
        else:
            req = parse(CompletionRequest, body)
            payload, sid, hint = {"prompt": req.single_prompt()}, None, None
        params = dataclasses.replace(req.params(), max_tokens=1)
        loop = asyncio.get_running_loop()
        job = PrefillJob(kind, params, loop, asyncio.Queue(), payload, sid, hint, [], req.cache_salt or "",
                         decode_url=target)
        worker.submit(job)
        final = await _final(job)
        report = job.transfer.report if job.transfer is not None else None
        if job.transfer is not None:
            await asyncio.to_thread(job.transfer.wait, 4 * worker.transfer_timeout_s)
            metrics.observe_transfer(report)
        if final.error is not None:
            raise ApiError(final.error_status, f"prefill failed: {final.error}")
        return {"prompt_tokens": final.prompt_tokens, "cached_tokens": final.cached_tokens,
                "first_token": final.token_ids[:1], "ttft_s": final.ttft_s,
                "kv_last_block": final.last_prompt_block.hex() if final.last_prompt_block else None,
                "transfer": report.to_dict() if report is not None else None}

    @app.post("/v1/kv/prefill/chat/completions")
    async def prefill_chat(request: Request):
        return await prefill(request, "chat")

    @app.post("/v1/kv/prefill/completions")
    async def prefill_completion(request: Request):
        return await prefill(request, "completion")


async def _final(job: PrefillJob):
    """The job's final summary; raises its error (an :class:`ApiError`)."""
    while True:
        event, value = await job.queue.get()
        if event == "error":
            raise value
        if event == "final":
            return value


def _held_query(body) -> list[bytes]:
    hashes = body.get("block_hashes") if isinstance(body, dict) else None
    if not isinstance(hashes, list) or len(hashes) > MAX_HELD_QUERY or \
            not all(isinstance(h, str) and _HEX_HASH.fullmatch(h) for h in hashes):
        raise ApiError(400, f"block_hashes: expected a list of at most {MAX_HELD_QUERY} 32-digit lowercase hex "
                       "block hashes", "block_hashes")
    return [bytes.fromhex(h) for h in hashes]
