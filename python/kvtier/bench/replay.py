"""Closed-loop replay of agent sessions through one engine, in real time.

Each of up to ``concurrency`` active sessions submits its turns one after another: turn k is
submitted ``think_time_s`` after turn k-1 finished (WORKLOAD.md's closed loop). When a session
ends, the next one in the workload starts. The engine steps while it has work; when every
active session is thinking, the loop sleeps until the next submission is due.

The first ``concurrency`` sessions start evenly spread over ``ramp_s`` seconds (session i at
``i * ramp_s / concurrency``): sessions of a running service are not in phase, and starting
them all at once would make the p99 TTFT measure one start-up burst of first turns. Later
sessions start as soon as a slot frees.

A text workload (:mod:`kvtier.bench.conversations`) is encoded at submission by one
:class:`~kvtier.tokenize.SessionEncoder` per session, with the engine's page size and hash
salt, so TTFT includes the incremental encode and the prefix lookup gets the token buffer's
block hashes.

Between a turn that stopped on ``tool_use`` and the next one, the session is waiting on a
tool: with ``tool_aware`` the pool is told (``KVPool.tool_wait``) with an *estimated* wait (the
median of the tool waits observed so far in this run; before any, WORKLOAD.md's p50 of 9 s
times the workload's time scale) — never the trace's true wait, which a server cannot know.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.bench.records import ConfigRun, RequestRecord
from kvtier.bench.workload import Session, Workload, prompt_token_ids
from kvtier.cache.policy import ToolWaitEstimate
from kvtier.serve.engine import Engine
from kvtier.serve.params import RequestOutput, SamplingParams
from kvtier.tokenize import KimiTokenizer, SessionEncoder

TOOL_WAIT_P50_S = 9.0  # WORKLOAD.md: think_time after tool_use, p50 over 710 sessions
_TOKEN_LOW = 256  # synthetic prompt ids start here (clear of byte-level ids; any id is valid)


@dataclass
class _Active:
    """A session being replayed: its next turn and when it is due."""

    session: Session
    next_turn: int = 0
    due_s: float = 0.0
    request_id: int | None = None
    prompt: list[int] | None = None
    waiting_on_tool: bool = False
    encoder: SessionEncoder | None = None  # text workloads: this session's incremental encoder


def working_set_pages(workload: Workload, page_size: int, concurrency: int) -> int:
    """Pages (per layer) the ``concurrency`` largest sessions need at their peak, together.

    A session's peak is its longest turn, prompt plus output, in pages of ``page_size``
    tokens. This bounds what the device tier would need to keep every active session's
    context resident between its turns.
    """
    peaks = sorted((max(-(-(t.input_tokens + t.output_tokens) // page_size) for t in s.turns)
                    for s in workload.sessions if s.turns), reverse=True)
    return sum(peaks[:concurrency])


def replay(engine: Engine, workload: Workload, name: str, *, concurrency: int, tool_aware: bool = False,
           keep_outputs: bool = False, ramp_s: float = 0.0, on_finish: Callable[[RequestRecord], None] | None = None,
           tokenizer: KimiTokenizer | None = None,
           clock: Callable[[], float] = time.perf_counter,
           sleep: Callable[[float], None] = time.sleep) -> ConfigRun:
    """Replay ``workload`` through ``engine``; returns the run's records and counters.

    Args:
        engine: a fresh engine (its pool counters are reported as this run's).
        workload: sessions to replay, in order.
        name: the configuration's name, copied into the result.
        concurrency: sessions active at once (>= 1).
        tool_aware: tell the pool about tool waits (see the module docstring).
        keep_outputs: keep each request's generated tokens and logprobs in its record.
        ramp_s: seconds over which the first ``concurrency`` sessions start (see the module
            docstring); 0 starts them together.
        on_finish: called with each request's record as it finishes (progress display).
        tokenizer: encodes the turns of a text workload (required when a turn has ``chat``).
        clock, sleep: time source and sleep, in seconds (tests may pass fakes).

    Raises:
        ValueError: ``concurrency`` < 1, ``ramp_s`` < 0, or a text workload without ``tokenizer``.

    A turn the engine refuses (e.g. a prompt longer than the model's context) is recorded
    with its error and the session goes on with its next turn.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if not 0 <= ramp_s < float("inf"):
        raise ValueError(f"ramp_s must be a finite number >= 0, got {ramp_s}")
    if tokenizer is None and any(t.chat is not None for s in workload.sessions for t in s.turns):
        raise ValueError("a text workload needs tokenizer= (a KimiTokenizer) to encode its turns")
    vocab = engine.model_config.vocab_size
    block_size = workload.block_size
    queue = deque(s for s in workload.sessions if s.turns)
    active: list[_Active] = []
    by_request: dict[int, _Active] = {}
    records: list[RequestRecord] = []
    tool_wait = ToolWaitEstimate(TOOL_WAIT_P50_S * workload.time_scale)
    pool = engine.pool
    t0 = clock()

    def finish(a: _Active, record: RequestRecord) -> None:
        records.append(record)
        if on_finish is not None:
            on_finish(record)
        turn = a.session.turns[a.next_turn]
        a.next_turn += 1
        a.request_id = None
        if a.next_turn == len(a.session.turns):
            active.remove(a)
            if tool_aware:
                pool.tool_return(a.session.session_id)
            return
        nxt = a.session.turns[a.next_turn]
        a.due_s = (record.finish_s if record.finish_s is not None else clock() - t0) + nxt.think_time_s
        a.waiting_on_tool = turn.stop == "tool_use"
        if tool_aware and a.waiting_on_tool and record.error is None:
            pool.tool_wait(a.session.session_id, a.prompt, tool_wait.value())

    def submit(a: _Active, now: float) -> None:
        turn = a.session.turns[a.next_turn]
        if a.waiting_on_tool:
            tool_wait.observed.append(max(0.0, now - (a.due_s - turn.think_time_s)))
            if tool_aware:
                pool.tool_return(a.session.session_id)
        params = SamplingParams(max_tokens=turn.output_tokens, temperature=0.0, ignore_eos=True,
                                logprobs=keep_outputs)
        try:
            hashes = None
            if turn.chat is None:
                a.prompt = prompt_token_ids(turn, block_size, vocab, low=_TOKEN_LOW)
            else:
                hashes = _encode(a, turn.chat, tokenizer, engine)
            rid = engine.add_request(a.prompt, params, prompt_block_hashes=hashes)
        except ValueError as e:
            finish(a, RequestRecord(a.session.session_id, a.next_turn, turn.input_tokens, 0, now, None, now, 0,
                                    error=str(e)))
            return
        a.request_id = rid
        by_request[rid] = a

    started = 0
    while queue or active:
        while queue and len(active) < concurrency:
            offset = min(started, concurrency - 1) * ramp_s / concurrency  # never ahead of the ramp
            active.append(_Active(queue.popleft(), due_s=max(clock() - t0, offset)))
            started += 1
        now = clock() - t0
        for a in list(active):
            if a.request_id is None and a.due_s <= now:
                submit(a, now)
        if engine.has_unfinished():
            for out in engine.step():
                a = by_request.pop(out.request_id)
                finish(a, _record(out, a, t0, keep_outputs))
            continue
        due = [a.due_s for a in active if a.request_id is None]
        if due:
            sleep(max(0.0, min(due) - (clock() - t0)))
    return _run_result(name, engine, records, clock() - t0, workload, concurrency)


def _encode(a: _Active, chat, tokenizer: KimiTokenizer, engine: Engine) -> list[bytes] | None:
    """Encode a text turn with the session's encoder; sets ``a.prompt``, returns the block hashes."""
    if a.encoder is None:
        a.encoder = SessionEncoder(tokenizer, page_size=engine.config.pool.page_size, salt=engine.block_hash_salt)
    a.encoder.append(list(chat.messages), list(chat.tools) if chat.tools else None)
    a.prompt = a.encoder.ids
    return a.encoder.block_hashes()


def _record(out: RequestOutput, a: _Active, t0: float, keep_outputs: bool) -> RequestRecord:
    m = out.metrics
    rel = lambda t: None if t is None else t - t0  # noqa: E731
    return RequestRecord(
        session_id=a.session.session_id, turn=a.next_turn, input_tokens=len(out.prompt_token_ids),
        output_tokens=len(out.token_ids), arrival_s=min(a.due_s, m.arrival_time - t0), first_token_s=rel(m.first_token_time),
        finish_s=rel(m.finish_time), cached_tokens=out.num_cached_tokens,
        cached_tokens_by_tier=dict(out.cached_tokens_by_tier), error=out.error,
        output_token_ids=list(out.token_ids) if keep_outputs else None,
        logprobs=list(out.logprobs) if keep_outputs and out.logprobs is not None else None,
        admitted_s=rel(m.admitted_time), loaded_s=rel(m.loaded_time))


def _run_result(name: str, engine: Engine, records: list[RequestRecord], wall_s: float, workload: Workload,
                concurrency: int) -> ConfigRun:
    stats = engine.pool.stats
    return ConfigRun(
        name=name, records=records, wall_s=wall_s,
        recomputed_tokens=engine.num_prefill_tokens,
        bytes_moved={"device->host": stats.bytes_written["host"], "host->device": stats.bytes_loaded["host"],
                     "host->disk": stats.bytes_written["disk"], "disk->device": stats.bytes_loaded["disk"]},
        copy_errors=stats.copy_errors, evictions=dict(stats.evictions), stores_refused=dict(stats.stores_refused),
        preemptions=engine.scheduler.num_preemptions, device_pages=engine.config.pool.num_device_pages,
        working_set_pages=working_set_pages(workload, engine.config.pool.page_size, concurrency))
