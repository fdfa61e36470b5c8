"""The FastAPI application of ``kvtier serve``: routes, admission (queue limit), streaming.

Request bodies are parsed and validated here, on the event loop, before anything reaches the
engine thread: a bad request never touches engine state. A request's tool grammar is compiled
on a request thread before it is queued (a schema over a grammar limit is a 400 naming its
keyword), so the engine thread never waits on a compile. Accepted requests become
:class:`~kvtier.serve.api.jobs.Job` s handed to the :class:`~kvtier.serve.api.worker.EngineWorker`;
their events come back on an ``asyncio.Queue``. A streaming client that disconnects aborts its
request (its pages are freed).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtier.serve.api import chat_completions, messages, messages_stream, responses, responses_stream
from kvtier.serve.api.jobs import Final, Job
from kvtier.serve.api.metrics import CONTENT_TYPE, ServerMetrics
from kvtier.serve.api.protocol import (
    DEFAULT_MAX_REQUEST_BYTES,
    ApiError,
    ChatRequest,
    CompletionRequest,
    TOOL_WAIT_HEADER,
    json_body,
    parse,
    tool_wait_hint,
)
from kvtier.serve.api.worker import EngineWorker

SESSION_HEADER = "x-session-id"
_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", messages.PATH, responses.PATH)


@dataclass
class ServerOptions:
    """Server limits.

    Attributes:
        model_name: the name clients send as ``model`` (others get 404).
        max_queue: requests accepted at once (running or queued); more get 503.
        max_model_len: the longest sequence a request may have, in tokens (reported by
            ``/v1/models``): the model's context, or fewer where the device pages hold fewer.
        kv_events: the ZeroMQ endpoint publishing this worker's KV events (reported by
            ``/health``; the events' worker id is this endpoint), or None.
        health_stall_s: ``/health`` answers 503 once the engine thread has not completed a step
            for this many seconds while requests wait.
        max_request_bytes: a request body over this many bytes is a 413 (in the API's error
            shape) before it is read further, decoded or tokenized.
    """

    model_name: str
    max_queue: int = 256
    max_model_len: int | None = None
    kv_events: str | None = None
    health_stall_s: float = 30.0
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES

    def __post_init__(self) -> None:
        if not isinstance(self.max_queue, int) or self.max_queue < 1:
            raise ValueError(f"max_queue must be an int >= 1, got {self.max_queue!r}")
        b = self.max_request_bytes
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"max_request_bytes must be an int >= 1, got {b!r}")
        s = self.health_stall_s
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not s > 0 or s == float("inf"):
            raise ValueError(f"health_stall_s must be a number of seconds > 0, got {s!r}")


class _State:
    def __init__(self, worker: EngineWorker, options: ServerOptions, metrics: ServerMetrics):
        self.worker, self.options, self.metrics = worker, options, metrics
        self.pending = 0  # accepted and not yet answered (event loop only: no lock)


def build_app(worker: EngineWorker, options: ServerOptions, metrics: ServerMetrics) -> FastAPI:
    """The application; starts ``worker`` on startup and stops it on shutdown."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        worker.shutdown()

    app = FastAPI(title="kvtier", lifespan=lifespan)
    st = _State(worker, options, metrics)
    app.state.kvtier = st

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        path = request.url.path
        metrics.requests.labels(path if path in _ENDPOINTS else "other", str(e.status)).inc()
        return JSONResponse(_error_body(path, e), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        err = ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}")
        return JSONResponse(_error_body(request.url.path, err), status_code=e.status_code)

    async def body(request: Request):
        """The JSON body; a 413 over ``options.max_request_bytes`` before it is decoded."""
        return await json_body(request, options.max_request_bytes)

    @app.get("/health")
    async def health():
        if not worker.alive:
            raise ApiError(503, "the engine thread is not running")
        stalled = worker.stalled(options.health_stall_s)
        if stalled is not None:
            raise ApiError(503, stalled)
        return {"status": "ok"} if options.kv_events is None else {"status": "ok", "kv_events": options.kv_events}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": options.model_name, "object": "model", "created": 0,
                                            "owned_by": "kvtier", "max_model_len": options.max_model_len}]}

    @app.delete("/v1/sessions/{session_id}")
    async def end_session(session_id: str):
        if not await worker.call(lambda: worker.sessions.end(session_id)):
            raise ApiError(404, f"session_id: no session {session_id!r}", "session_id")
        return {"id": session_id, "object": "session", "deleted": True}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = parse(ChatRequest, await body(request))
        params = req.params()
        sid = req.session(request.headers.get(SESSION_HEADER))
        hint = req.tool_wait(request.headers.get(TOOL_WAIT_HEADER))
        return await _serve(st, request, "chat", req, params, _chat_payload(st, req, params), sid, hint, tools=True)

    @app.post(messages.PATH)
    async def anthropic_messages(request: Request):
        req, params, sid, fmt = messages_stream.prepare(await body(request), request.headers.get(SESSION_HEADER))
        hint = tool_wait_hint(request.headers.get(TOOL_WAIT_HEADER))
        return await _serve(st, request, "chat", req, params, _chat_payload(st, req, params, fmt), sid, hint,
                            tools=True, fmt=fmt)

    kept = responses.ResponseStore(worker.sessions.ttl_s)  # for previous_response_id

    @app.post(responses.PATH)
    async def openai_responses(request: Request):
        req, params, sid, fmt = responses_stream.prepare(await body(request), kept,
                                                             request.headers.get(SESSION_HEADER))
        hint = tool_wait_hint(request.headers.get(TOOL_WAIT_HEADER))
        return await _serve(st, request, "chat", req, params, _chat_payload(st, req, params, fmt), sid, hint,
                            tools=True, fmt=fmt)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(CompletionRequest, await body(request))
        prompt = req.single_prompt()
        sid = req.session(request.headers.get(SESSION_HEADER))
        return await _serve(st, request, "completion", req, req.params(), {"prompt": prompt}, sid,
                            req.tool_wait(request.headers.get(TOOL_WAIT_HEADER)))

    return app


def _chat_payload(st: _State, req, params, fmt=None) -> dict:
    """A chat job's payload: the messages and the prompt options of the model's chat format
    (K3's ``thinking`` / ``reasoning_effort`` / ``tool_choice`` / ``response_format``, a 400 when
    malformed, naming the field in the names of ``fmt``'s API; None for K2's template)."""
    chat_format = getattr(st.worker.tokenizer, "chat_format", None)
    try:
        options = req.prompt_options(chat_format, params)
    except ApiError as e:
        raise fmt.rename(e) if fmt is not None else e from None
    return {"messages": req.messages, "prompt_options": options}


def _error_body(path: str, e: ApiError) -> dict:
    """``e`` in the shape of the API at ``path``: Anthropic's for the Messages API, else OpenAI's."""
    return messages.error_body(e) if path == messages.PATH else e.body()


async def _serve(st: _State, request: Request, kind: str, req, params, payload: dict, session_id, hint,
                 tools: bool = False, fmt=None):
    """Queue one request and answer it: a body, or a stream of ``fmt``'s events. ``fmt`` (default:
    OpenAI chat / text completions) makes the id, the body and the stream writer (see
    :class:`kvtier.serve.api.chat_completions.OpenAIFormat`); the other APIs bring their own. ``tools``:
    compile the request's tool grammar on a request thread before it is queued."""
    opts = st.options
    if req.model != opts.model_name:
        raise ApiError(404, f"model: {req.model!r} does not exist; this server serves {opts.model_name!r}", "model")
    stops = req.stop_strings()
    fmt = fmt if fmt is not None else chat_completions.OpenAIFormat(kind, req.include_usage())
    if st.pending >= opts.max_queue:
        raise ApiError(503, f"overloaded: {st.pending} requests in flight (the limit is --max-queue "
                       f"{opts.max_queue}); retry later")
    loop = asyncio.get_running_loop()
    job = Job(kind, params, loop, asyncio.Queue(), payload, session_id, hint, stops, req.cache_salt or "")
    st.pending += 1
    if tools:
        try:
            job.tool_matcher = await st.worker.compile_grammar(params)
        except BaseException:
            st.pending -= 1
            raise
    released = False

    def release():
        nonlocal released
        if not released:
            released = True
            st.pending -= 1

    try:
        st.worker.submit(job)
        event, value = await job.queue.get()
    except BaseException:
        st.worker.abort(job)
        release()
        raise
    if event == "error":  # refused on the engine thread (the prompt over the context, ...): in this API's names
        release()
        raise fmt.rename(value) if hasattr(fmt, "rename") else value
    endpoint = request.url.path
    rid = fmt.new_id()
    created = int(time.time())
    tok = st.worker.tokenizer
    if not req.stream:
        try:
            final = await _collect(job, request)
        except _ClientGone:  # nobody to answer: free the request's pages
            st.worker.abort(job)
            st.metrics.disconnects.inc()
            return Response(status_code=499)
        except BaseException:
            st.worker.abort(job)
            raise
        finally:
            release()
        if final.error is not None:
            raise ApiError(final.error_status, f"request failed: {final.error}")
        st.metrics.requests.labels(endpoint, "200").inc()
        return JSONResponse(fmt.body(rid, created, opts.model_name, final, tok))
    writer = fmt.writer(rid, created, opts.model_name, tok, value)
    st.metrics.requests.labels(endpoint, "200").inc()
    flight = _Flight(st, job, release)
    return _JobStream(flight, _stream(job, writer, bool(params.logprobs), flight), media_type="text/event-stream")


class _Flight:
    """A streamed request's end: :meth:`close` (idempotent) releases its queue slot and, unless
    its final event was sent, aborts it (the client left, or the response never started)."""

    def __init__(self, st: _State, job: Job, release):
        self.st, self.job, self.release = st, job, release
        self.finished = self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.finished:
            self.st.worker.abort(self.job)
            self.st.metrics.disconnects.inc()
        self.release()


class _JobStream(StreamingResponse):
    """A streaming response that closes its :class:`_Flight` however it ends (a generator that
    was never started runs no ``finally``)."""

    def __init__(self, flight: _Flight, content, **kw):
        super().__init__(content, **kw)
        self.flight = flight

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.flight.close()


class _ClientGone(Exception):
    pass


async def _collect(job: Job, request: Request) -> Final:
    """The final event of a non-streaming request; raises :class:`_ClientGone` if its client
    disconnects first (the ASGI server then sends ``http.disconnect``)."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while True:
            get = asyncio.ensure_future(job.queue.get())
            await asyncio.wait((get, gone), return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                raise _ClientGone()
            event, value = get.result()
            if event == "final":
                return value
            if event == "error":
                raise value
    finally:
        gone.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _stream(job: Job, writer, logprobs: bool, flight: _Flight):
    try:
        first = writer.first()
        if first is not None:
            yield first
        while True:
            event, value = await job.queue.get()
            if event == "delta":
                for chunk in writer.delta(value, logprobs):
                    yield chunk
                continue
            flight.finished = True
            if event == "error" or value.error is not None:
                err = value if event == "error" else ApiError(value.error_status, f"request failed: {value.error}")
                for chunk in writer.error(err):
                    yield chunk
            else:
                for chunk in writer.final(value):
                    yield chunk
            end = writer.end()
            if end:
                yield end
            return
    finally:
        flight.close()
