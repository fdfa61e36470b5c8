"""The discrete-event loop: closed-loop agent sessions over one or more simulated workers.

Sessions follow :func:`kvtier.bench.replay.replay` exactly, in virtual time: at most
``concurrency`` sessions are active; the first ``concurrency`` start spread over ``ramp_s``
(session ``i`` at ``i * ramp_s / concurrency``), later ones when a slot frees; turn ``k`` is due
``think_time_s`` after turn ``k - 1`` finished and its TTFT counts from that due time; with
``tool_aware`` the pool hears of each tool wait (estimated as the median of the waits seen so
far, never the trace's) and of its end; a turn the engine would refuse (longer than the context,
or more pages than the device has) is recorded with its error and the session goes on.

A measurement window (``warmup_s``, ``duration_s``) makes a steady-state run of a long trace:
turns due at or after ``duration_s`` are not submitted (their sessions stop, no new session
starts), every submitted turn runs to its end, and only turns due at or after ``warmup_s`` are
reported; the run's ``wall_s`` is then the window, ``min(duration_s, last finish) - warmup_s``.
The defaults (0, infinity) report everything, as the real replay does.

Events at one virtual time are handled together (step ends, then due turns), then every idle
worker with work starts its next step at that time, so a turn that comes due during a step
waits for the step's end, as in the real loop.

Routing (several workers): ``sticky`` keeps each session on the worker it started on (sessions
are dealt round-robin); ``least-loaded`` sends each turn to the worker where it would start
soonest: the lowest ``(queued prefill tokens + this turn's tokens not cached there) /
prefill rate``, where "cached there" is the prefix the worker's own index matches in any of its
tiers (a shared store's blocks included). A session whose turn goes elsewhere has migrated.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from kvtier.bench.records import ConfigRun, RequestRecord
from kvtier.bench.replay import TOOL_WAIT_P50_S, ToolWaitEstimate, working_set_pages
from kvtier.bench.sim.engine import SimEngine, Step
from kvtier.bench.workload import Session, Turn, Workload
from kvtier.cache.block_hash import block_hashes
from kvtier.serve.request import Sequence

ROUTERS = ("sticky", "least-loaded")
_FRESH_ID_BASE = (
    2**31
)  # ids of blocks that hold generated tokens: never a workload block id


@dataclass
class _Active:
    """A session being replayed."""

    session: Session
    home: int
    next_turn: int = 0
    due_s: float = 0.0
    waiting_on_tool: bool = False
    seq: Sequence | None = None
    prompt_hashes: list[bytes] = field(default_factory=list)
    _ids: np.ndarray | None = None  # block ids of the previous prompt's full pages


@dataclass
class _Worker:
    engine: SimEngine
    step: Step | None = None
    waking: bool = False
    running: dict[int, _Active] = field(default_factory=dict)


class _Hasher:
    """Block hashes of turns: a page of ``page_size`` tokens covers ``page_size / block_size``
    consecutive workload block ids; its hash chains those ids (so equal id prefixes give equal
    hashes, as equal token prefixes do in the real replay). Pages that will hold generated tokens
    get fresh ids (the real replay's outputs never match a later prompt's blocks either)."""

    def __init__(self, block_size: int, page_size: int, salt: bytes):
        if page_size % block_size:
            raise ValueError(
                f"page_size {page_size} must be a multiple of the workload's block size {block_size}"
            )
        self.per_page, self.page_size, self.salt = (
            page_size // block_size,
            page_size,
            salt,
        )
        self._fresh = itertools.count(_FRESH_ID_BASE)

    def turn(self, a: _Active, turn: Turn) -> list[bytes]:
        """Hashes of every full page of ``turn``'s prompt + output; updates ``a.prompt_hashes``."""
        m, ps = self.per_page, self.page_size
        full = turn.input_tokens // ps
        ids = np.asarray(turn.block_ids[: full * m], dtype=np.int64)
        keep = 0
        if a._ids is not None:
            n = min(len(ids), len(a._ids))
            diff = np.flatnonzero(ids[:n] != a._ids[:n])
            keep = min((int(diff[0]) if diff.size else n) // m, len(a.prompt_hashes))
        parent = a.prompt_hashes[keep - 1] if keep else None
        hashes = a.prompt_hashes[:keep] + block_hashes(
            ids[keep * m :], m, parent, self.salt
        )
        a._ids, a.prompt_hashes = ids, hashes
        extra = (turn.input_tokens + turn.output_tokens) // ps - full
        if extra <= 0:
            return list(hashes)
        fresh = [next(self._fresh) for _ in range(extra * m)]
        return hashes + block_hashes(
            fresh, m, hashes[-1] if hashes else None, self.salt
        )


def _backlog_tokens(engine: SimEngine) -> int:
    """Prompt tokens queued or being prefilled on a worker."""
    s = engine.scheduler
    return sum(
        max(0, q.num_prompt_tokens - q.num_computed_tokens)
        for q in (*s.waiting, *s.loading, *s.running)
    )


def _route(
    workers: list[_Worker], a: _Active, hashes: list[bytes], n_in: int, router: str
) -> int:
    if router == "sticky" or len(workers) == 1:
        return a.home
    best, best_s = a.home, float("inf")
    for i in sorted(
        range(len(workers)), key=lambda i: i != a.home
    ):  # the home worker wins ties
        pool = workers[i].engine.pool
        cached = (
            len(pool.index.match(hashes[: n_in // pool.page_size])) * pool.page_size
        )
        t = (
            _backlog_tokens(workers[i].engine) + n_in - cached
        ) / pool.cost_model.prefill_tok_s
        if t < best_s:
            best, best_s = i, t
    return best


def _refusal(engine: SimEngine, turn: Turn, max_context_tokens: int) -> str | None:
    """The error ``Engine.check_request`` would raise for this turn, or None."""
    cfg = engine.config
    if turn.input_tokens > max_context_tokens:
        return f"prompt has {turn.input_tokens} tokens, more than max_position_embeddings={max_context_tokens}"
    pages = -(
        -(min(turn.input_tokens + turn.output_tokens, max_context_tokens) - 1)
        // cfg.pool.page_size
    )
    if pages > cfg.pool.num_device_pages:
        return (
            f"prompt with max_tokens={turn.output_tokens} needs {pages} pages of {cfg.pool.page_size} tokens, "
            f"more than num_device_pages={cfg.pool.num_device_pages}"
        )
    return None


def _record(
    a: _Active, turn: Turn, seq: Sequence | None, error: str | None = None
) -> RequestRecord:
    if seq is None:
        return RequestRecord(
            a.session.session_id,
            a.next_turn,
            turn.input_tokens,
            0,
            a.due_s,
            None,
            a.due_s,
            0,
            error=error,
        )
    m = seq.metrics
    return RequestRecord(
        a.session.session_id,
        a.next_turn,
        turn.input_tokens,
        len(seq.output_token_ids),
        a.due_s,
        m.first_token_time,
        m.finish_time,
        seq.num_cached_tokens,
        dict(seq.cached_tokens_by_tier),
        admitted_s=m.admitted_time,
        loaded_s=m.loaded_time,
    )


@dataclass
class SimRun:
    """A simulated configuration: the run as ``kvtier bench`` reports it, plus what only the
    simulator knows.

    Attributes:
        run: records of the turns due in the window, virtual times (seconds), counters summed
            over workers, ``bytes_moved`` in modelled bytes.
        migrations: turns served by another worker than the session's previous turn.
        warmup_records: turns due before ``warmup_s`` (run, not reported).
        busy_s: per worker, virtual seconds spent in steps.
        end_s: virtual time of the last finish.
    """

    run: ConfigRun
    migrations: int = 0
    warmup_records: list[RequestRecord] = field(default_factory=list)
    busy_s: list[float] = field(default_factory=list)
    end_s: float = 0.0


class _Loop:
    def __init__(
        self,
        engines: list[SimEngine],
        workload: Workload,
        *,
        concurrency: int,
        tool_aware: bool,
        ramp_s: float,
        router: str,
        max_context_tokens: int,
        on_finish,
        warmup_s: float = 0.0,
        duration_s: float = float("inf"),
    ):
        self.workers = [_Worker(e) for e in engines]
        self.workload, self.concurrency, self.tool_aware, self.ramp_s = (
            workload,
            concurrency,
            tool_aware,
            ramp_s,
        )
        self.router, self.max_context_tokens, self.on_finish = (
            router,
            max_context_tokens,
            on_finish,
        )
        self.warmup_s, self.duration_s = warmup_s, duration_s
        self.warmup_records: list[RequestRecord] = []
        first = engines[0]
        self.hasher = _Hasher(
            workload.block_size, first.config.pool.page_size, first.pool.config.salt
        )
        self.queue = deque(s for s in workload.sessions if s.turns)
        self.active: list[_Active] = []
        self.records: list[RequestRecord] = []
        self.tool_wait = ToolWaitEstimate(TOOL_WAIT_P50_S * workload.time_scale)
        self.events: list = []
        self._order = itertools.count()
        self.started = 0
        self.migrations = 0
        self.now = 0.0

    def push(self, t: float, kind: str, ref) -> None:
        heapq.heappush(self.events, (t, next(self._order), kind, ref))

    def fill_slots(self) -> None:
        while (
            self.queue
            and len(self.active) < self.concurrency
            and self.now < self.duration_s
        ):
            offset = (
                min(self.started, self.concurrency - 1) * self.ramp_s / self.concurrency
            )
            a = _Active(
                self.queue.popleft(),
                home=self.started % len(self.workers),
                due_s=max(self.now, offset),
            )
            self.active.append(a)
            self.started += 1
            self.push(a.due_s, "due", a)

    def submit(self, a: _Active) -> None:
        turn = a.session.turns[a.next_turn]
        if a.due_s >= self.duration_s:  # past the window: the session stops here
            self.active.remove(a)
            if self.tool_aware:
                self.workers[a.home].engine.pool.tool_return(a.session.session_id)
            return
        if a.waiting_on_tool:
            self.tool_wait.observed.append(turn.think_time_s)
            if self.tool_aware:
                self.workers[a.home].engine.pool.tool_return(a.session.session_id)
        hashes = self.hasher.turn(a, turn)
        w = _route(self.workers, a, hashes, turn.input_tokens, self.router)
        self.migrations += w != a.home and a.next_turn > 0
        a.home = w
        engine = self.workers[w].engine
        error = _refusal(engine, turn, self.max_context_tokens)
        if error is not None:
            self.finish(a, _record(a, turn, None, error))
            return
        a.seq = engine.new_sequence(
            turn.input_tokens, turn.output_tokens, hashes, a.due_s
        )
        self.workers[w].running[a.seq.seq_id] = a
        engine.add(a.seq)

    def finish(self, a: _Active, record: RequestRecord) -> None:
        (
            self.records if record.arrival_s >= self.warmup_s else self.warmup_records
        ).append(record)
        if self.on_finish is not None:
            self.on_finish(record)
        turn = a.session.turns[a.next_turn]
        a.next_turn += 1
        a.seq = None
        pool = self.workers[a.home].engine.pool
        if a.next_turn == len(a.session.turns):
            self.active.remove(a)
            if self.tool_aware:
                pool.tool_return(a.session.session_id)
            return
        nxt = a.session.turns[a.next_turn]
        a.due_s = (
            record.finish_s if record.finish_s is not None else self.now
        ) + nxt.think_time_s
        a.waiting_on_tool = turn.stop == "tool_use"
        if self.tool_aware and a.waiting_on_tool and record.error is None:
            pool.tool_wait_blocks(
                a.session.session_id, a.prompt_hashes, self.tool_wait.value()
            )
        self.push(a.due_s, "due", a)

    def handle(self, kind: str, ref) -> None:
        if kind == "due":
            self.submit(ref)
            return
        w: _Worker = ref
        w.engine.clock.advance_to(self.now)
        if kind == "wake":
            w.waking = False
            return
        step, w.step = w.step, None
        for seq in w.engine.end_step(step):
            a = w.running.pop(seq.seq_id)
            self.finish(a, _record(a, a.session.turns[a.next_turn], seq))

    def kick(self, w: _Worker) -> None:
        w.engine.clock.advance_to(self.now)
        res = w.engine.begin_step()
        if isinstance(res, Step):
            w.step = res
            self.push(res.end_s, "step", w)
        else:
            w.waking = True
            self.push(res, "wake", w)

    def run(self) -> float:
        """Run to the last finish; returns it (virtual seconds)."""
        self.fill_slots()
        while self.events:
            self.now = self.events[0][0]
            while self.events and self.events[0][0] == self.now:
                _, _, kind, ref = heapq.heappop(self.events)
                self.handle(kind, ref)
            self.fill_slots()
            for w in self.workers:
                if w.step is None and not w.waking and w.engine.has_unfinished():
                    self.kick(w)
        return self.now


def simulate(
    engines: list[SimEngine],
    workload: Workload,
    name: str,
    *,
    concurrency: int,
    max_context_tokens: int,
    tool_aware: bool = False,
    ramp_s: float = 0.0,
    router: str = "sticky",
    warmup_s: float = 0.0,
    duration_s: float = float("inf"),
    on_finish: Callable[[RequestRecord], None] | None = None,
) -> SimRun:
    """Replay ``workload`` over ``engines`` in virtual time; returns the run as ``kvtier bench`` does.

    Args:
        engines: fresh workers (their counters are reported as this run's); they must share a
            page size.
        workload: sessions, in order; its block size must divide the page size.
        name: the configuration's name.
        concurrency: sessions active at once (>= 1).
        max_context_tokens: longest prompt a worker accepts (the model's context).
        tool_aware: tell the pools about tool waits.
        ramp_s: seconds over which the first ``concurrency`` sessions start.
        router: ``"sticky"`` or ``"least-loaded"`` (module docstring).
        warmup_s, duration_s: the measurement window in virtual seconds (module docstring).
        on_finish: called with each request's record as it finishes.

    Returns:
        :class:`SimRun`; its ``run.device_pages`` is summed over workers.

    Raises:
        ValueError: no engine, ``concurrency`` < 1, ``ramp_s`` < 0, a window with
            ``0 <= warmup_s < duration_s`` broken, an unknown router, or page sizes that differ
            or do not fit the workload's blocks.
        RuntimeError: a worker's page pool cannot hold a waiting request (as ``Engine.step``).
    """
    if not engines:
        raise ValueError("simulate needs at least one engine")
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if not 0 <= ramp_s < float("inf"):
        raise ValueError(f"ramp_s must be a finite number >= 0, got {ramp_s}")
    if not 0 <= warmup_s < duration_s:
        raise ValueError(
            f"need 0 <= warmup_s < duration_s, got warmup_s={warmup_s}, duration_s={duration_s}"
        )
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    if len({e.config.pool.page_size for e in engines}) != 1:
        raise ValueError("all engines must have the same page_size")
    loop = _Loop(
        engines,
        workload,
        concurrency=concurrency,
        tool_aware=tool_aware,
        ramp_s=ramp_s,
        router=router,
        max_context_tokens=max_context_tokens,
        on_finish=on_finish,
        warmup_s=warmup_s,
        duration_s=duration_s,
    )
    end_s = loop.run()
    run = _run_result(
        name, engines, loop, min(end_s, duration_s) - warmup_s, workload, concurrency
    )
    return SimRun(
        run, loop.migrations, loop.warmup_records, [e.busy_s for e in engines], end_s
    )


def _run_result(
    name,
    engines: list[SimEngine],
    loop: _Loop,
    wall_s: float,
    workload: Workload,
    concurrency: int,
) -> ConfigRun:
    moved: dict[str, int] = {}
    evictions: dict[str, int] = {}
    for e in engines:
        for k, v in e.pool_bytes_moved().items():
            moved[k] = moved.get(k, 0) + v
        for k, v in e.pool.stats.evictions.items():
            evictions[k] = evictions.get(k, 0) + v
    return ConfigRun(
        name=name,
        records=loop.records,
        wall_s=max(wall_s, 0.0),
        recomputed_tokens=sum(e.num_prefill_tokens for e in engines),
        bytes_moved=moved,
        copy_errors=sum(e.pool.stats.copy_errors for e in engines),
        evictions=evictions,
        stores_refused={t: sum(e.pool.stats.stores_refused[t] for e in engines) for t in ("host", "disk")},
        preemptions=sum(e.scheduler.num_preemptions for e in engines),
        device_pages=sum(e.config.pool.num_device_pages for e in engines),
        working_set_pages=working_set_pages(
            workload, engines[0].config.pool.page_size, concurrency
        ),
    )
