"""Closed-loop agent sessions over one or more simulated workers, in virtual time.

The sessions are driven by the real replay's loop (:class:`kvtier.bench.closed_loop.ClosedLoop`:
concurrency, ramp, think times, tool waits, refused turns, the measurement window) on a virtual
clock; this module is its target: it turns a turn into block hashes, routes it, and advances the
workers' steps and copies as discrete events. Each worker steps as soon as it has work: a step
begun at ``t`` ends at ``t + step_s``; a worker that can run nothing while its prefix loads run
wakes when the next copy ends. Events at one virtual time are handled together; then turns due
by then are submitted and every idle worker with work starts its next step, so a turn that comes
due during a step waits for the step's end, as in the real loop. With a window, ``wall_s`` is
``min(window_s + duration_s, last finish) - (window_s + warmup_s)``, ``window_s`` the virtual time
the window opened (0 unless ``warmup_turns``: the closed loop's docstring); with warm-up turns the
run's counters (recomputed tokens, bytes, evictions, preemptions, checkpoint counters) are the
window's: the workers' counters when it opened are taken off.

Routing (several workers) runs the real router's policy (:class:`kvtier.cluster.router.routing.Router`,
as ``kvtier router --policy`` runs it): ``sticky``, ``least-loaded`` (the fewest requests in
flight) or ``kv-aware`` (the lowest predicted TTFT from the session's last placement and whether
the other workers reach its prefix through a shared store). Each turn the router sees every
worker's requests in flight, and each finished turn is recorded with its latency, as the HTTP
router records them. A session whose turn goes elsewhere has migrated.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from kvtier.bench.closed_loop import ActiveSession, ClosedLoop, run_result
from kvtier.bench.records import ConfigRun, RequestRecord
from kvtier.sim.engine import SimWorker
from kvtier.bench.workload import Turn, Workload
from kvtier.cache.block_hash import block_hashes
from kvtier.cluster.router.routing import POLICIES, CostParams, Router
from kvtier.serve.params import RequestOutput, SamplingParams

ROUTERS = POLICIES
_FRESH_ID_BASE = 2**31  # ids of blocks that hold generated tokens: never a workload block id


@dataclass
class _Prompt:
    """A session's last prompt: its full pages' workload block ids and block hashes."""

    ids: np.ndarray | None = None
    hashes: list[bytes] = field(default_factory=list)


class _Hasher:
    """Block hashes of turns: a page of ``page_size`` tokens covers ``page_size / block_size``
    consecutive workload block ids; its hash chains those ids (so equal id prefixes give equal
    hashes, as equal token prefixes do in the real replay). Pages that will hold generated tokens
    get fresh ids (the real replay's outputs never match a later prompt's blocks either)."""

    def __init__(self, block_size: int, page_size: int, salt: bytes):
        if page_size % block_size:
            raise ValueError(f"page_size {page_size} must be a multiple of the workload's block size {block_size}")
        self.per_page, self.page_size, self.salt = page_size // block_size, page_size, salt
        self._fresh = itertools.count(_FRESH_ID_BASE)

    def turn(self, p: _Prompt, turn: Turn) -> list[bytes]:
        """Hashes of every full page of ``turn``'s prompt + output; updates ``p``."""
        m, ps = self.per_page, self.page_size
        full = turn.input_tokens // ps
        ids = np.asarray(turn.block_ids[: full * m], dtype=np.int64)
        keep = 0
        if p.ids is not None:
            n = min(len(ids), len(p.ids))
            diff = np.flatnonzero(ids[:n] != p.ids[:n])
            keep = min((int(diff[0]) if diff.size else n) // m, len(p.hashes))
        parent = p.hashes[keep - 1] if keep else None
        p.ids, p.hashes = ids, p.hashes[:keep] + block_hashes(ids[keep * m:], m, parent, self.salt)
        extra = (turn.input_tokens + turn.output_tokens) // ps - full
        if extra <= 0:
            return list(p.hashes)
        fresh = [next(self._fresh) for _ in range(extra * m)]
        return p.hashes + block_hashes(fresh, m, p.hashes[-1] if p.hashes else None, self.salt)


class _SimTarget:
    """The workers as the closed loop's target (virtual clock ``now``)."""

    def __init__(self, workers: list[SimWorker], workload: Workload, router: str, shared_store: bool):
        self.workers = workers
        self.now, self.migrations = 0.0, 0
        first = workers[0]
        self.names = [f"worker-{i}" for i in range(len(workers))]
        self.router = Router(self.names, policy=router, remote=shared_store,
                             cost=CostParams(prefill_tok_s=first.pool.costs().prefill_tok_s))
        self.submitted: dict[int, tuple[float, int]] = {}  # id(session) -> (arrival, prompt tokens)
        self.hasher = _Hasher(workload.block_size, first.config.pool.page_size, first.pool.config.salt)
        self.events: list = []  # heap of (time, order, worker)
        self._order = itertools.count()

    def submit(self, a: ActiveSession, turn: Turn, arrival_time: float) -> None:
        a.state = a.state or _Prompt()
        hashes = self.hasher.turn(a.state, turn)
        w = self._route(a, hashes, turn.input_tokens)
        self.migrations += w != a.home and a.next_turn > 0
        a.home = w
        params = SamplingParams(max_tokens=turn.output_tokens, temperature=0.0, ignore_eos=True)
        rid = self.workers[w].engine.add_hashed_request(turn.input_tokens, hashes, params, arrival_time=arrival_time)
        self.workers[w].running[rid] = a
        self.submitted[id(a)] = (arrival_time, turn.input_tokens)

    def _route(self, a: ActiveSession, hashes: list[bytes], n_in: int) -> int:
        if len(self.workers) == 1:
            return 0
        for name, w in zip(self.names, self.workers):  # the load figures the router polls
            self.router.workers[name].running = len(w.running)
        return self.names.index(self.router.choose(a.session.session_id, n_in))

    def advance(self, until: float | None) -> list[tuple[ActiveSession, RequestOutput]] | None:
        for w in self.workers:  # every idle worker with work begins its next step now
            if not w.busy and w.engine.has_unfinished():
                w.clock.advance_to(self.now)
                t, w.step = w.begin()
                w.busy = True
                heapq.heappush(self.events, (t, next(self._order), w))
        if not self.events and until is None:
            return None
        self.now = min(self.events[0][0] if self.events else math.inf, math.inf if until is None else until)
        finished = []
        while self.events and self.events[0][0] == self.now:
            w = heapq.heappop(self.events)[2]
            w.clock.advance_to(self.now)
            step, w.step, w.busy = w.step, None, False
            if step is not None:
                done = [(w.running.pop(out.request_id), out) for out in w.engine.end_step(step)]
                for a, _ in done:  # as the HTTP router records an answered turn
                    arrival, n_in = self.submitted.pop(id(a))
                    self.router.record(a.session.session_id, self.names[a.home], n_in, self.now - arrival)
                finished += done
        return finished

    def tool_wait(self, a: ActiveSession, expected_wait_s: float) -> None:
        self.workers[a.home].pool.tool_wait_blocks(a.session.session_id, a.state.hashes, expected_wait_s)

    def tool_return(self, a: ActiveSession) -> None:
        self.workers[a.home].pool.tool_return(a.session.session_id)


@dataclass
class SimRun:
    """A simulated configuration: the run as ``kvtier bench`` reports it, plus what only the
    simulator knows.

    Attributes:
        run: records of the turns due in the window, virtual times (seconds), counters summed
            over workers, ``bytes_moved`` in modelled bytes.
        migrations: turns served by another worker than the session's previous turn.
        warmup_records: warm-up turns and turns due before ``window_s + warmup_s`` (run, not
            reported).
        busy_s: per worker, virtual seconds spent in steps (the whole run's).
        end_s: virtual time of the last finish.
        window_s: virtual time the measurement window opened (0 without warm-up turns).
        window_sessions: sessions active when it opened.
    """

    run: ConfigRun
    migrations: int = 0
    warmup_records: list[RequestRecord] = field(default_factory=list)
    busy_s: list[float] = field(default_factory=list)
    end_s: float = 0.0
    window_s: float = 0.0
    window_sessions: int = 0


def simulate(workers: list[SimWorker], workload: Workload, name: str, *, concurrency: int, tool_aware: bool = False,
             ramp_s: float = 0.0, router: str = "sticky", warmup_s: float = 0.0, duration_s: float = math.inf,
             on_finish: Callable[[RequestRecord], None] | None = None, shared_store: bool | None = None,
             declared_waits: bool = False, warmup_turns: int = 0) -> SimRun:
    """Replay ``workload`` over ``workers`` in virtual time; returns the run as ``kvtier bench`` does.

    Args:
        workers: fresh workers (their counters are reported as this run's); they must share a
            page size.
        workload: sessions, in order; its block size must divide the page size.
        name: the configuration's name.
        router: a routing policy of :data:`kvtier.cluster.router.routing.POLICIES` (module docstring).
        shared_store: the workers share a remote or disk tier (a moved session can load its
            prefix there); None: whether the first two workers' pools share a disk tier object.
        concurrency, tool_aware, ramp_s, warmup_s, duration_s, on_finish, declared_waits, warmup_turns:
            as :class:`~kvtier.bench.closed_loop.ClosedLoop` (times in virtual seconds).

    Returns:
        :class:`SimRun`; its ``run.device_pages`` is summed over workers.

    Raises:
        ValueError: no worker, bad loop options (:class:`ClosedLoop`), an unknown router, or page
            sizes that differ or do not fit the workload's blocks.
        RuntimeError: a worker's page pool cannot hold a waiting request (as ``Engine.step``).
    """
    if not workers:
        raise ValueError("simulate needs at least one worker")
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    if len({w.config.pool.page_size for w in workers}) != 1:
        raise ValueError("all workers must have the same page_size")
    if shared_store is None:
        shared_store = len(workers) > 1 and workers[0].pool.shares_disk_with(workers[1].pool)
    target = _SimTarget(workers, workload, router, shared_store)
    opened: dict = {}  # the workers' counters when the window opened (warm-up turns only)

    def snapshot(_: float) -> None:
        opened["engines"] = [w.engine.stats() for w in workers]

    loop = ClosedLoop(workload, target, lambda: target.now, concurrency=concurrency, ramp_s=ramp_s,
                      tool_aware=tool_aware, warmup_s=warmup_s, duration_s=duration_s, num_homes=len(workers),
                      on_finish=on_finish, declared_waits=declared_waits, warmup_turns=warmup_turns,
                      on_window_open=snapshot if warmup_turns else None)
    end_s = loop.run()
    window_s = loop.window_s if loop.window_s is not None else end_s
    run = run_result(name, loop, min(end_s, window_s + duration_s) - (window_s + warmup_s), workload,
                     [w.engine for w in workers], [w.bytes_scale for w in workers], since=opened.get("engines"))
    return SimRun(run, target.migrations, loop.warmup_records, [w.runner.busy_s for w in workers], end_s, window_s,
                  loop.window_sessions)
