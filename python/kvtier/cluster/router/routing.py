"""Routing decisions: which worker serves a turn (pure logic, no I/O).

Policies:

* ``sticky``: a session stays on the worker that served its first turn (the baseline);
* ``least-loaded``: the worker with the fewest requests running or waiting;
* ``kv-aware``: the lowest predicted TTFT, ``queue wait + load of the cached prefix from that
  worker's best tier + recomputation of the rest``. Where the prefix is comes from the workers'
  KV events (:class:`kvtier.cache.kv_events.GlobalKVView`: which worker holds the block hash
  of the session's last prompt block in a local tier) when the router has them, else from
  where the session's last turn ran; a session leaves its worker only when
  another one wins by more than one request's time (the workers' load figures lag by up to a
  poll period). The worker that served the session's last
  turn holds its prefix in a local tier; with a shared remote tier every other worker can load
  it from the store (slower); without one they recompute it.

A worker that fails a request or its load poll is out of routing until a poll succeeds again;
its sessions go elsewhere (and find their blocks in the remote tier when there is one).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from kvtier.cache.kv_events import GlobalKVView

_LOCAL_TIERS = {"device", "host", "disk"}

POLICIES = ("sticky", "least-loaded", "kv-aware")


@dataclass
class CostParams:
    """Rates of the TTFT prediction (updated from observed requests).

    Attributes:
        request_s: seconds one request ahead in a worker's queue adds (EWMA of observed
            request times).
        prefill_tok_s: prompt tokens a worker computes per second.
        local_tok_s: cached prompt tokens per second loaded from a worker's own tiers.
        remote_tok_s: cached prompt tokens per second loaded from the remote tier.
        remote_latency_s: fixed cost of a remote lookup and load.
    """

    request_s: float = 0.5
    prefill_tok_s: float = 2000.0
    local_tok_s: float = 1e6
    remote_tok_s: float = 2e5
    remote_latency_s: float = 0.005
    alpha: float = 0.2

    def observe_request(self, seconds: float) -> None:
        self.request_s += self.alpha * (seconds - self.request_s)


@dataclass
class WorkerState:
    url: str
    healthy: bool = True
    waiting: int = 0
    running: int = 0
    inflight: int = 0  # requests this router sent that have not been answered yet

    @property
    def load(self) -> int:
        """Requests ahead of a new one: the worker's own count, or the router's when larger
        (between two polls)."""
        return max(self.waiting + self.running, self.inflight)


@dataclass
class Placement:
    """Where a session's last turn ran and how long its prompt was (tokens)."""

    worker: str
    prompt_tokens: int
    last_block: bytes | None = None  # hash of the prompt's last full block (from the response)


@dataclass
class Router:
    """Routing state: workers, their load, sessions' placements and the cost parameters."""

    urls: list[str]
    policy: str = "kv-aware"
    remote: bool = False
    cost: CostParams = field(default_factory=CostParams)
    view: GlobalKVView | None = None
    worker_ids: dict[str, str] = field(default_factory=dict)  # worker URL -> its KV events' worker id

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {list(POLICIES)}, got {self.policy!r}")
        if not self.urls:
            raise ValueError("workers must name at least one worker URL")
        self.workers = {u: WorkerState(u) for u in self.urls}
        self.sessions: dict[str, Placement] = {}
        self.moves = 0  # turns of a session served by another worker than its previous turn

    def healthy(self) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.healthy]

    def predicted_ttft(self, w: WorkerState, session_id: str | None, prompt_tokens: int) -> float:
        """Seconds until ``w`` would give the first token of a ``prompt_tokens``-token turn."""
        place = self.sessions.get(session_id) if session_id else None
        cached, load_s = 0, 0.0
        where = self.prefix_tier(w.url, place) if place is not None else None
        if where is not None:
            cached = min(place.prompt_tokens, prompt_tokens)
            load_s = cached / self.cost.local_tok_s if where == "local" else \
                self.cost.remote_latency_s + cached / self.cost.remote_tok_s
        return w.load * self.cost.request_s + load_s + (prompt_tokens - cached) / self.cost.prefill_tok_s

    def prefix_tier(self, url: str, place: Placement) -> str | None:
        """Where worker ``url`` would get the session's prefix: ``local`` (its own tiers),
        ``remote`` (the shared store) or None (recompute)."""
        wid = self.worker_ids.get(url)
        if self.view is not None and place.last_block is not None and wid in self.view.workers:
            if self.view.resume_tiers(wid, place.last_block) & _LOCAL_TIERS:  # hybrid: with its checkpoint
                return "local"
        elif place.worker == url:
            return "local"
        return "remote" if self.remote else None

    def choose(self, session_id: str | None, prompt_tokens: int) -> str:
        """The worker URL for this turn.

        Raises:
            RuntimeError: no worker is healthy.
        """
        live = self.healthy()
        if not live:
            raise RuntimeError("no healthy worker")
        place = self.sessions.get(session_id) if session_id else None
        if self.policy == "sticky":
            if place is not None and self.workers[place.worker].healthy:
                return place.worker
            if session_id:
                return live[zlib.crc32(session_id.encode()) % len(live)].url
            return min(live, key=lambda w: w.load).url
        if self.policy == "least-loaded":
            return min(live, key=lambda w: w.load).url
        ttft = {w.url: self.predicted_ttft(w, session_id, prompt_tokens) for w in live}
        best = min(ttft, key=ttft.get)
        if place is not None and place.worker in ttft and ttft[place.worker] <= ttft[best] + self.cost.request_s:
            return place.worker  # a move must win more than one request's time (load figures lag)
        return best

    def record(self, session_id: str | None, url: str, prompt_tokens: int, seconds: float,
               last_block: bytes | None = None) -> None:
        """A turn of ``session_id`` ran on ``url`` in ``seconds``; ``last_block``: the hash of
        its prompt's last full block (``usage.kv_last_block``)."""
        if session_id:
            before = self.sessions.get(session_id)
            self.moves += before is not None and before.worker != url
            self.sessions[session_id] = Placement(url, prompt_tokens, last_block)
        self.cost.observe_request(seconds)
