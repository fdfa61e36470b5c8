"""The engine thread: the only thread that touches the engine, its pool and the sessions.

The asyncio side hands over commands through a thread-safe queue (:meth:`EngineWorker.submit`,
:meth:`abort`, :meth:`call`); the thread drains them, steps the engine while it has work, and
after each step sends every request's new tokens as events to that request's ``asyncio.Queue``
(``loop.call_soon_threadsafe``). Nothing on the event loop ever calls the engine: ``/metrics``
reads the frozen :class:`WorkerStats` the thread publishes after each step and while idle.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

from kvtier.serve.api.jobs import Final, Job
from kvtier.serve.api.protocol import ApiError, value_error
from kvtier.serve.api.sessions import DECLARED_WAIT, SessionStore
from kvtier.serve.chat import add_chat_request
from kvtier.serve.engine import Engine
from kvtier.serve.outputs import request_output
from kvtier.serve.stats import EngineStats

log = logging.getLogger("kvtier.serve")
HOUSEKEEPING_S = 0.2  # seconds between session expiry checks (and snapshots while idle)


@dataclass(frozen=True)
class WorkerStats:
    """What ``/metrics`` reads: the engine thread's last snapshot (:attr:`EngineWorker.snapshot`).

    Attributes:
        engine: the engine's :class:`kvtier.serve.stats.EngineStats` (scheduler, pool, counters).
        sessions: chat sessions kept; ``sessions_waiting``: of those, waiting on tools;
            ``sessions_expired``: dropped after their idle TTL so far.
        engine_errors: engine steps or commands that failed.
        in_flight: requests handed to the engine and not finished.
        busy_s: seconds the engine thread spent in ``Engine.step``.
        resume: :meth:`kvtier.serve.api.resume.ResumeTracker.snapshot`.
        sessions_evicted: sessions (and encoders kept by content) evicted by the session store's
            token limit so far.
    """

    engine: EngineStats
    sessions: int
    sessions_waiting: int
    sessions_expired: int
    engine_errors: int
    in_flight: int
    busy_s: float
    resume: dict
    sessions_evicted: int = 0


class EngineWorker:
    """Owns ``engine`` on a background thread.

    Args:
        engine: an engine with a tokenizer attached.
        tokenizer: the Kimi tokenizer (chat templates, text prompts).
        session_ttl_s: idle time after which a session is dropped.
        metrics: a :class:`kvtier.serve.api.metrics.ServerMetrics` to update, or None.
    """

    def __init__(self, engine: Engine, tokenizer, session_ttl_s: float = 600.0, metrics=None):
        self.engine, self.tokenizer, self.metrics = engine, tokenizer, metrics
        self.sessions = SessionStore(engine, tokenizer, session_ttl_s)
        self._inbox: queue.Queue = queue.Queue()
        self._jobs: dict[int, Job] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-engine", daemon=True)
        self.snapshot: WorkerStats | None = None  # published by the engine thread after each step and while idle
        self.engine_errors = 0
        self.busy_s = 0.0  # seconds the engine thread spent in Engine.step (utilisation)
        self._last_housekeeping = 0.0
        self.heartbeat = time.monotonic()  # when the engine thread last finished a loop (a step, or a wait)

    # -- asyncio side ------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """The engine thread is running."""
        return self._thread.is_alive()

    def stalled(self, after_s: float) -> str | None:
        """Why the engine thread looks stuck: it has not completed a step (or an idle wait) for
        more than ``after_s`` seconds while requests are queued or running; None when healthy."""
        waiting = len(self._jobs) + self._inbox.qsize()
        quiet = time.monotonic() - self.heartbeat
        if waiting and quiet > after_s:
            return (f"the engine thread has not completed a step for {quiet:.1f} s (the limit is "
                    f"--health-stall-s {after_s:g}) while {waiting} request(s) wait")
        return None

    async def compile_grammar(self, params):
        """``params``' tool grammar compiled on a request thread (never the engine thread), for
        :attr:`Job.tool_matcher`; None without tools.

        Raises:
            ApiError: 400 naming the tool and schema keyword when it does not compile or exceeds
                a grammar limit.
        """
        if params.tool_grammar is None:
            return None
        from starlette.concurrency import run_in_threadpool

        from kvtier.toolcall import GrammarError

        try:
            return await run_in_threadpool(self.engine.grammar.compile, params)
        except GrammarError as e:
            raise ApiError(400, str(e), e.path or "tools") from None

    def start(self) -> None:
        self._publish()  # /metrics has a snapshot from the start, before the first step or idle tick
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout_s)

    def submit(self, job: Job) -> None:
        """Queue ``job``; its events arrive on ``job.queue``."""
        self._inbox.put(("submit", job))

    def abort(self, job: Job) -> None:
        """Drop ``job``'s request (client gone): its pages are freed; no more events."""
        self._inbox.put(("abort", job))

    async def call(self, fn):
        """Run ``fn()`` on the engine thread; returns its result (or raises its exception)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._inbox.put(("call", fn, loop, fut))
        return await fut

    # -- engine thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self.heartbeat = time.monotonic()
            try:
                self._drain(block=not self.engine.has_unfinished())
            except Exception as e:  # noqa: BLE001 - a bug handling a command: fail what is in flight, keep serving
                log.exception("engine command failed")
                self.engine_errors += 1
                self._fail_all(f"{type(e).__name__}: {e}")
                continue
            if self.engine.has_unfinished():
                t0 = time.perf_counter()
                try:
                    outs = self.engine.step()
                except Exception as e:  # noqa: BLE001 - fail the requests in flight, keep serving
                    log.exception("engine step failed")
                    self.engine_errors += 1
                    self._fail_all(f"{type(e).__name__}: {e}")
                    continue
                finally:
                    self.busy_s += time.perf_counter() - t0
                self._progress({o.request_id: o for o in outs})
                try:
                    self._publish()
                except Exception:  # noqa: BLE001 - metrics must not stop the engine thread
                    log.exception("metrics snapshot failed")
            now = time.monotonic()
            if now - self._last_housekeeping >= HOUSEKEEPING_S:
                self._last_housekeeping = now
                try:
                    if not self.engine.has_unfinished():  # idle: background writes and KV events go on
                        self.engine.pool.poll()
                    self.sessions.expire()
                    self._publish()
                except Exception:  # noqa: BLE001 - housekeeping must not stop the engine thread
                    log.exception("housekeeping failed")

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=HOUSEKEEPING_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "submit":
            self._submit(cmd[1])
        elif kind == "abort":
            job = cmd[1]
            if job.request_id is not None and self._jobs.pop(job.request_id, None) is not None:
                self.engine.abort([job.request_id])
                self.sessions.aborted(job.session_id)
        elif kind == "call":
            _, fn, loop, fut = cmd
            try:
                result, exc = fn(), None
            except Exception as e:  # noqa: BLE001 - handed to the caller
                result, exc = None, e
            deliver = (lambda: fut.cancelled() or fut.set_exception(exc)) if exc else \
                (lambda: fut.cancelled() or fut.set_result(result))
            try:
                loop.call_soon_threadsafe(deliver)
            except RuntimeError:
                pass

    def _submit(self, job: Job) -> None:
        try:
            if job.kind == "chat":
                enc = job.encoder = self.sessions.encoder(job.session_id, job.cache_salt, job.payload["messages"])
                try:
                    rid = add_chat_request(self.engine, enc, job.payload["messages"], job.params, job.cache_salt,
                                           job.tool_matcher, job.payload.get("prompt_options"))
                except BaseException:
                    self.sessions.refused(job.session_id)
                    raise
                self.sessions.accepted(job.session_id)
            else:
                prompt = job.payload["prompt"]
                ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
                if job.session_id is not None:
                    self.sessions.encoder(job.session_id, job.cache_salt)  # the session, for its tool waits
                try:
                    rid = self.engine.add_request(ids, job.params, cache_salt=job.cache_salt)
                except BaseException:
                    self.sessions.refused(job.session_id)
                    raise
                self.sessions.accepted(job.session_id, ids)
        except ApiError as e:
            job.emit("error", e)
            return
        except ValueError as e:
            job.emit("error", _prompt_error(e, job.kind))
            return
        except Exception as e:  # noqa: BLE001 - this request fails, the server goes on
            log.exception("request submission failed")
            job.emit("error", ApiError(500, f"{type(e).__name__}: {e}"))
            return
        job.request_id = rid
        job.start(self.tokenizer)
        self._jobs[rid] = job
        seq = self.engine.sequence(rid)
        job.prompt_ids = seq.prompt_token_ids if seq is not None else []
        job.block_hashes = seq.block_hashes if seq is not None else []  # extended by the pool as pages fill
        job.emit("accepted", len(job.prompt_ids))

    def _progress(self, finished: dict) -> None:
        for rid, job in list(self._jobs.items()):
            out = finished.get(rid)
            progress = out if out is not None else self.engine.sequence(rid)
            if progress is None:
                continue
            ids = progress.token_ids if out is not None else progress.output_token_ids
            lps, tops = progress.logprobs or [], progress.top_logprobs or []
            if len(ids) > job.sent or out is not None:
                new, new_lps, new_tops = list(ids[job.sent:]), list(lps[job.sent:len(ids)]), list(tops[job.sent:len(ids)])
                job.sent = len(ids)
                delta = job.feed(new, new_lps, final=out is not None, events=self._parsed(job, out),
                                 top_logprobs=new_tops)
                if delta.text or delta.reasoning or delta.tool_calls or delta.token_ids:
                    job.emit("delta", delta)
            if out is not None:
                self._finish(job, job.final(out, out.finish_reason, out.error))
            elif job.stop is not None and job.stop.hit:  # a stop string: end it here, with the usage
                out = request_output(progress, self.engine.num_steps, self.engine.config.pool.page_size)
                self.engine.abort([rid])  # of any finished request (last prompt block, engine steps)
                self._finish(job, job.final(out, "stop"))

    def _parsed(self, job: Job, out) -> list:
        """The engine's tool-call parser events of ``job``'s new tokens (a chat job parses nothing
        itself): those of its finished output ``out``, else the ones the live request has now."""
        if job.kind != "chat":
            return []
        if out is not None:
            return out.events or []
        return self.engine.take_events(job.request_id)

    def _finish(self, job: Job, final: Final) -> None:
        self._jobs.pop(job.request_id, None)
        tools = [c["name"] for c in final.tool_calls] if final.finish_reason == "tool_calls" else []
        if job.kind == "completion" and job.expected_tool_wait_s is not None and final.error is None:
            tools = [DECLARED_WAIT]  # a text completion's client declared its tool wait
        ids = list(job.prompt_ids) + list(final.token_ids) if tools else None
        if job.kind == "chat":  # the next turn keeps the ids this one sampled
            self.sessions.generated(job.session_id, final, job.encoder, job.payload.get("messages"), job.cache_salt)
        self.sessions.turn_ended(job.session_id, ids, tools, job.expected_tool_wait_s, final, job.block_hashes)
        if self.metrics is not None:
            self.metrics.observe_final(final)
        job.emit("final", final)

    def _fail_all(self, message: str) -> None:
        self.engine.abort(list(self._jobs))
        for job in list(self._jobs.values()):
            job.emit("error", ApiError(500, f"engine error: {message}"))
            self.sessions.aborted(job.session_id)
        self._jobs.clear()

    def _publish(self) -> None:
        """Swap in a fresh :class:`WorkerStats` (one attribute store: the event loop sees the old
        snapshot or the new one, never a half-built one)."""
        s = self.sessions
        self.snapshot = WorkerStats(self.engine.stats(), len(s.sessions), s.num_waiting, s.num_expired,
                                    self.engine_errors, len(self._jobs), self.busy_s, s.resumes.snapshot(),
                                    s.num_evicted)


def _prompt_error(e: ValueError, kind: str) -> ApiError:
    """A refused prompt as a 400: the engine names ``prompt_token_ids[0]``, the API ``messages``
    or ``prompt``."""
    msg = str(e)
    if msg.startswith("prompt_token_ids[0]"):
        field = "messages" if kind == "chat" else "prompt"
        return ApiError(400, f"{field}: the prompt{msg[len('prompt_token_ids[0]'):]}", field)
    return value_error(ValueError(msg.replace("prompt_token_ids[0]", "the prompt")))
