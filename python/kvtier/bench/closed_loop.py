"""The closed loop of agent sessions (docs/workload.md), on an injected clock: one driver for the real
replay (:func:`kvtier.bench.replay.replay`, wall clock) and the simulator
(:func:`kvtier.sim.loop.simulate`, virtual clock).

At most ``concurrency`` sessions are active; the first ``concurrency`` start spread over
``ramp_s`` (session ``i`` at ``i * ramp_s / concurrency``: sessions of a running service are not in
phase, and starting them together would make the p99 TTFT measure one start-up burst), later
ones as soon as a slot frees. Turn ``k`` is due ``think_time_s`` after turn ``k - 1`` finished; its
TTFT counts from that due time, even when the loop was busy and submitted it later. A turn the
engine refuses (longer than the context, more pages than the device has) is recorded with its
error and the session goes on with its next turn.

Between a turn that stopped on ``tool_use`` and the next one the session waits on a tool: with
``tool_aware`` the pool hears of it with an *estimated* wait (the median of the tool waits
observed so far in this run; before any, docs/workload.md's p50 of 9 s times the workload's time
scale), never the trace's true wait, which a server cannot know; and of its end. With
``declared_waits`` the pool hears the recorded wait instead: what a client that declares how long
its tool will run (``expected_tool_wait_s`` on kvtier serve's APIs) tells the server.

A measurement window (``warmup_s``, ``duration_s``) makes a steady-state run of a long trace:
turns due at or after ``duration_s`` are not submitted (their sessions stop, no new session
starts), every submitted turn runs to its end, and only turns due at or after ``warmup_s`` are
reported. The defaults (0, infinity) report everything.

Warm-up turns (``warmup_turns`` = N > 0) make a steady-state run of sessions already deep in a
running service: each session's first N turns run through the same target before the window,
and its turn N is held (parked) once they finished. The window opens at the loop time
``window_s`` when every active session is parked (each slot holds a session that finished its
warm-up turns, or no session is left to start); then each parked session's turn N is due its own
think time after ``window_s`` (a tool wait, if its last warm-up turn stopped on ``tool_use``, is
told to the pool then), ``warmup_s`` and ``duration_s`` count from ``window_s``, and no new
session starts (a session that ends leaves its slot empty: the window measures the sessions that
were warmed, and none of their warm-up turns). Warm-up turns are never reported. With N = 0 the
window opens at 0 and nothing changes.

What runs the turns is a :class:`LoopTarget`: it queues a turn on an engine, and advances the
engines (a real step; virtual-time steps of several workers) until something finishes or the
next turn is due.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvtier.bench.records import ConfigRun, RequestRecord
from kvtier.bench.workload import Session, Turn, Workload
from kvtier.cache.eviction import ToolWaitEstimate
from kvtier.serve.engine import Engine
from kvtier.serve.stats import EngineStats
from kvtier.serve.params import RequestOutput

TOOL_WAIT_P50_S = 9.0  # docs/workload.md: think_time after tool_use, p50 over 710 sessions


@dataclass
class ActiveSession:
    """A session being replayed: its next turn and when it is due (loop seconds).

    Attributes:
        home: the worker its turns go to (sessions are dealt round-robin; a router may move it).
        in_flight: its turn is queued or running.
        state: the target's own state of this session (an encoder, the previous prompt, ...).
    """

    session: Session
    home: int = 0
    next_turn: int = 0
    due_s: float = 0.0
    in_flight: bool = False
    waiting_on_tool: bool = False
    state: object = None


class LoopTarget(Protocol):
    """What the closed loop runs its turns on."""

    def submit(self, a: ActiveSession, turn: Turn, arrival_time: float) -> None:
        """Queue ``a``'s next ``turn``, due at ``arrival_time`` (on the loop's clock).

        Raises:
            ValueError: the engine refuses the turn (recorded as an error).
        """
        ...

    def advance(self, until: float | None) -> list[tuple[ActiveSession, RequestOutput]] | None:
        """Run until some turns finish or the clock reads ``until`` (the next due turn; None:
        none); returns the finished turns, or None when nothing runs and nothing is due."""
        ...

    def tool_wait(self, a: ActiveSession, expected_wait_s: float) -> None:
        """``a`` waits on a tool after its last turn."""
        ...

    def tool_return(self, a: ActiveSession) -> None:
        """``a``'s tool returned, or ``a`` ended."""
        ...


class ClosedLoop:
    """Drives ``workload``'s sessions through ``target`` (module docstring).

    Args:
        workload: sessions, in order.
        target: runs the turns.
        clock: seconds, the clock of the target's engines (request metrics are read against it).
        concurrency: sessions active at once (>= 1).
        ramp_s: seconds over which the first ``concurrency`` sessions start.
        tool_aware: tell the pools about tool waits.
        declared_waits: with ``tool_aware``, tell each wait's recorded length (the client declares
            it) instead of the running median (module docstring).
        warmup_s, duration_s: the measurement window (module docstring), loop seconds after
            ``window_s``.
        warmup_turns: turns of each session run before the window and never reported (module
            docstring); 0 = none.
        on_window_open: called with the loop time ``window_s`` when the window opens (before
            any measured turn is due), e.g. to snapshot counters.
        keep_outputs: keep each request's generated tokens and logprobs in its record.
        num_homes: workers the sessions are dealt over.
        on_finish: called with each request's record as it finishes.

    Attributes:
        records: the reported turns' records; warmup_records: the others (warm-up turns, and
            turns due before ``window_s + warmup_s``).
        window_s: loop seconds at which the window opened (0 without warm-up turns; None while
            warm-up turns run).
        window_sessions: sessions active when the window opened.

    Raises:
        ValueError: ``concurrency`` < 1, ``ramp_s`` not finite and >= 0, not
            ``0 <= warmup_s < duration_s``, or ``warmup_turns`` not an int >= 0.
    """

    def __init__(self, workload: Workload, target: LoopTarget, clock: Callable[[], float], *, concurrency: int,
                 ramp_s: float = 0.0, tool_aware: bool = False, warmup_s: float = 0.0,
                 duration_s: float = math.inf, keep_outputs: bool = False, num_homes: int = 1,
                 on_finish: Callable[[RequestRecord], None] | None = None, declared_waits: bool = False,
                 warmup_turns: int = 0, on_window_open: Callable[[float], None] | None = None):
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        if not 0 <= ramp_s < math.inf:
            raise ValueError(f"ramp_s must be a finite number >= 0, got {ramp_s}")
        if not 0 <= warmup_s < duration_s:
            raise ValueError(f"need 0 <= warmup_s < duration_s, got warmup_s={warmup_s}, duration_s={duration_s}")
        if isinstance(warmup_turns, bool) or not isinstance(warmup_turns, int) or warmup_turns < 0:
            raise ValueError(f"warmup_turns must be an int >= 0, got {warmup_turns!r}")
        self.target, self.clock, self.concurrency, self.ramp_s = target, clock, concurrency, ramp_s
        self.tool_aware, self.warmup_s, self.duration_s = tool_aware, warmup_s, duration_s
        self.declared_waits = declared_waits
        self.keep_outputs, self.num_homes, self.on_finish = keep_outputs, num_homes, on_finish
        self.queue = deque(s for s in workload.sessions if s.turns)
        self.active: list[ActiveSession] = []
        self.records: list[RequestRecord] = []
        self.warmup_records: list[RequestRecord] = []
        self.tool_wait = ToolWaitEstimate(TOOL_WAIT_P50_S * workload.time_scale)
        self.t0 = clock()
        self._due: list = []  # heap of (due_s, order, session) not yet submitted
        self._order = itertools.count()
        self._started = 0
        self.warmup_turns, self.on_window_open = warmup_turns, on_window_open
        self.window_s: float | None = 0.0 if warmup_turns == 0 else None
        self.window_sessions = 0
        self._parked: list[tuple[ActiveSession, bool]] = []  # (session, tell the pool of a tool wait)

    def now(self) -> float:
        """Loop seconds (since the run started)."""
        return self.clock() - self.t0

    def run(self) -> float:
        """Run every session to its end; returns the loop time then (seconds)."""
        self._fill_slots()
        self._open_window()
        while True:
            now = self.now()
            while self._due and self._due[0][0] <= now:
                self._submit(heapq.heappop(self._due)[2], now)
            finished = self.target.advance(self.t0 + self._due[0][0] if self._due else None)
            if finished is None:
                return self.now()
            for a, out in finished:
                self._finish(a, self.record(a, out))
            self._fill_slots()
            self._open_window()

    def _cutoff_s(self) -> float:
        """Loop seconds from which no turn is submitted (infinite while warm-up turns run)."""
        return math.inf if self.window_s is None else self.window_s + self.duration_s

    def _open_window(self) -> None:
        """Open the window once every active session is parked after its warm-up turns and no
        slot can be filled (module docstring)."""
        if self.window_s is not None or len(self._parked) < len(self.active):
            return
        if self.queue and len(self.active) < self.concurrency:
            return
        now = self.now()
        self.window_s, self.window_sessions = now, len(self.active)
        if self.on_window_open is not None:
            self.on_window_open(now)
        for a, tell in self._parked:
            nxt = a.session.turns[a.next_turn]
            a.due_s = now + nxt.think_time_s
            if tell:
                self.target.tool_wait(a, nxt.think_time_s if self.declared_waits else self.tool_wait.value())
            self._push(a)
        self._parked = []

    def _push(self, a: ActiveSession) -> None:
        heapq.heappush(self._due, (a.due_s, next(self._order), a))

    def _fill_slots(self) -> None:
        now = self.now()
        if self.warmup_turns and self.window_s is not None:  # the window measures the warmed sessions only
            return
        while self.queue and len(self.active) < self.concurrency and now < self._cutoff_s():
            offset = min(self._started, self.concurrency - 1) * self.ramp_s / self.concurrency  # never ahead
            a = ActiveSession(self.queue.popleft(), home=self._started % self.num_homes, due_s=max(now, offset))
            self.active.append(a)
            self._started += 1
            self._push(a)

    def _submit(self, a: ActiveSession, now: float) -> None:
        turn = a.session.turns[a.next_turn]
        if a.due_s >= self._cutoff_s():  # past the window: the session stops here
            self.active.remove(a)
            if self.tool_aware:
                self.target.tool_return(a)
            return
        if a.waiting_on_tool:
            self.tool_wait.observed.append(turn.think_time_s + max(0.0, now - a.due_s))
            if self.tool_aware:
                self.target.tool_return(a)
        try:
            self.target.submit(a, turn, self.t0 + a.due_s)
        except ValueError as e:
            self._finish(a, RequestRecord(a.session.session_id, a.next_turn, turn.input_tokens, 0, a.due_s, None,
                                          now, 0, error=str(e)))
            return
        a.in_flight = True

    def _finish(self, a: ActiveSession, record: RequestRecord) -> None:
        measured = (self.window_s is not None and record.turn >= self.warmup_turns
                    and record.arrival_s >= self.window_s + self.warmup_s)
        (self.records if measured else self.warmup_records).append(record)
        if self.on_finish is not None:
            self.on_finish(record)
        turn = a.session.turns[a.next_turn]
        a.next_turn += 1
        a.in_flight = False
        if a.next_turn == len(a.session.turns):
            self.active.remove(a)
            if self.tool_aware:
                self.target.tool_return(a)
            return
        nxt = a.session.turns[a.next_turn]
        a.due_s = (record.finish_s if record.finish_s is not None else self.now()) + nxt.think_time_s
        a.waiting_on_tool = turn.stop == "tool_use"
        if self.window_s is None and a.next_turn == self.warmup_turns:  # warmed: held until the window opens
            self._parked.append((a, self.tool_aware and a.waiting_on_tool and record.error is None))
            return
        if self.tool_aware and a.waiting_on_tool and record.error is None:
            self.target.tool_wait(a, nxt.think_time_s if self.declared_waits else self.tool_wait.value())
        self._push(a)

    def record(self, a: ActiveSession, out: RequestOutput) -> RequestRecord:
        """The record of ``a``'s current turn from its engine output (times in loop seconds)."""
        m, keep = out.metrics, self.keep_outputs
        rel = lambda t: None if t is None else t - self.t0  # noqa: E731
        turn = a.session.turns[a.next_turn]
        return RequestRecord(
            session_id=a.session.session_id, turn=a.next_turn,
            input_tokens=turn.input_tokens if out.prompt_token_ids is None else len(out.prompt_token_ids),
            output_tokens=len(out.token_ids), arrival_s=a.due_s, first_token_s=rel(m.first_token_time),
            finish_s=rel(m.finish_time), cached_tokens=out.num_cached_tokens,
            cached_tokens_by_tier=dict(out.cached_tokens_by_tier), error=out.error,
            output_token_ids=list(out.token_ids) if keep else None,
            logprobs=list(out.logprobs) if keep and out.logprobs is not None else None,
            admitted_s=rel(m.admitted_time), loaded_s=rel(m.loaded_time), preemptions=m.num_preemptions)


def working_set_pages(workload: Workload, page_size: int, concurrency: int) -> int:
    """Pages (per layer) the ``concurrency`` largest sessions need at their peak, together.

    A session's peak is its longest turn, prompt plus output, in pages of ``page_size``
    tokens. This bounds what the device tier would need to keep every active session's
    context resident between its turns.
    """
    peaks = sorted((max(-(-(t.input_tokens + t.output_tokens) // page_size) for t in s.turns)
                    for s in workload.sessions if s.turns), reverse=True)
    return sum(peaks[:concurrency])


def whole_working_set_pages(workload: Workload, page_size: int, concurrency: int) -> int:
    """Device pages (per layer) that hold every page the replay of ``workload`` ever caches, so
    that a pool of this size never evicts and never preempts for lack of pages: the ``ideal``
    configuration's device tier (:mod:`kvtier.bench.configs`).

    Counted as: the distinct prompt pages over all turns (a page is its chain of block ids from
    the prompt's start, as the pool's block hash chains them; with ``page_size`` a multiple of
    the workload's block size), plus each turn's output pages and one partial page
    (``ceil(output_tokens / page_size) + 1``: generated tokens hash to pages no prompt repeats),
    plus one partial prompt page per active session and 16 spare. With a ``page_size`` that is
    not a multiple of the block size, every turn's whole context counts (an upper bound).

    Args:
        workload: the sessions (``Workload.block_size`` tokens per block id).
        page_size: tokens per device page (> 0).
        concurrency: sessions active at once.

    Raises:
        ValueError: ``page_size`` < 1.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1 token, got {page_size}")
    turns = [t for s in workload.sessions for t in s.turns]
    outputs = sum(-(-t.output_tokens // page_size) + 1 for t in turns)
    if page_size % workload.block_size:
        return sum(-(-(t.input_tokens + t.output_tokens) // page_size) + 1 for t in turns) + concurrency + 16
    per_page = page_size // workload.block_size
    pages: set[int] = set()
    for t in turns:
        key = 0
        for i in range(0, len(t.block_ids), per_page):
            key = hash((key, t.block_ids[i:i + per_page]))
            pages.add(key)
    return len(pages) + outputs + concurrency + 16


def run_result(name: str, loop: ClosedLoop, wall_s: float, workload: Workload, engines: list[Engine],
               bytes_scale: list[float] | None = None, since: list[EngineStats] | None = None) -> ConfigRun:
    """The run of ``loop`` over ``engines`` (counters summed; each pool's bytes times its
    ``bytes_scale``, 1 by default: the simulator's pools count placeholder bytes); with ``since``
    (each engine's :meth:`Engine.stats` at the window's opening, in order) the counters are
    those of the window only (:func:`stats_since`)."""
    scales = bytes_scale or [1.0] * len(engines)
    keys = {"device->host": ("bytes_written", "host"), "host->device": ("bytes_loaded", "host"),
            "host->disk": ("bytes_written", "disk"), "disk->device": ("bytes_loaded", "disk")}
    snaps = [e.stats() for e in engines]
    if since is not None:
        snaps = [stats_since(end, start) for end, start in zip(snaps, since, strict=True)]
    stats = [s.pool for s in snaps]

    def total(counts: str) -> dict[str, int]:
        return {k: sum(getattr(s, counts)[k] for s in stats) for k in getattr(stats[0], counts)}

    return ConfigRun(
        name=name, records=loop.records, wall_s=max(wall_s, 0.0),
        recomputed_tokens=sum(s.prefill_tokens for s in snaps),
        bytes_moved={k: sum(round(getattr(s, c)[t] * x) for s, x in zip(stats, scales)) for k, (c, t) in keys.items()},
        copy_errors=sum(s.copy_errors for s in stats), evictions=total("evictions"),
        stores_refused=total("stores_refused"), preemptions=sum(s.scheduler.preemptions for s in snaps),
        device_pages=sum(e.config.pool.num_device_pages for e in engines),
        working_set_pages=working_set_pages(workload, engines[0].config.pool.page_size, loop.concurrency),
        sections=sum_sections([s.sections for s in stats], scales))


def sum_sections(sections: list[dict], bytes_scale: list[float]) -> dict:
    """Several pools' counter sections (each pool's :attr:`PoolSnapshot.sections`) added up by name:
    every int and every dict of ints by name, a field named ``bytes_*`` times its pool's
    ``bytes_scale``; a section only some pools keep sums over those."""
    def added(name: str, values: list[tuple[object, float]]):
        scale = name.startswith("bytes_")
        if isinstance(values[0][0], dict):
            keys = dict.fromkeys(k for v, _ in values for k in v)
            return {k: sum(round(v.get(k, 0) * x) if scale else v.get(k, 0) for v, x in values) for k in keys}
        return sum(round(v * x) if scale else v for v, x in values)

    def summed(kept: list[tuple[object, float]]):
        return type(kept[0][0])(**{f.name: added(f.name, [(getattr(s, f.name), x) for s, x in kept])
                                   for f in dataclasses.fields(kept[0][0])})

    names = dict.fromkeys(n for secs in sections for n in secs)
    return {n: summed([(secs[n], x) for secs, x in zip(sections, bytes_scale, strict=True) if n in secs])
            for n in names}


def _minus(end, start):
    """``end - start`` of a counter: an int, a dict of ints by name (names only in ``end`` kept) or a
    dataclass of counters (each field's)."""
    if isinstance(end, dict):
        return {k: v - start.get(k, 0) for k, v in end.items()}
    if dataclasses.is_dataclass(end):
        return type(end)(**{f.name: _minus(getattr(end, f.name), getattr(start, f.name))
                            for f in dataclasses.fields(end)})
    return end - start


def stats_since(end: EngineStats, start: EngineStats) -> EngineStats:
    """What one engine counted between two of its :meth:`Engine.stats` snapshots: ``end`` with
    every counter (prefill tokens, steps, preemptions, the pool's hits, bytes, evictions, copy
    errors, prefetches, refused stores and every counter of its sections, :attr:`PoolSnapshot.sections`)
    less ``start``'s; the gauges (queues, free pages, cached blocks) and the grammar counters are ``end``'s."""
    p, q = end.pool, start.pool
    counters = ("hit_tokens", "bytes_loaded", "bytes_written", "evictions", "copy_errors", "prefetched_blocks",
                "stores_refused")
    pool = dataclasses.replace(p, **{k: _minus(getattr(p, k), getattr(q, k)) for k in counters},
                               sections={k: _minus(v, q.sections[k]) for k, v in p.sections.items()})
    sched = dataclasses.replace(end.scheduler, preemptions=end.scheduler.preemptions - start.scheduler.preemptions)
    return dataclasses.replace(end, scheduler=sched, pool=pool, prefill_tokens=end.prefill_tokens - start.prefill_tokens,
                               steps=end.steps - start.steps)
