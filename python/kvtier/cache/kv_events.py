"""KV events: what each worker's tiers gained and lost, published in batches over ZeroMQ.

A pool with an event sink (:meth:`kvtier.cache.pool.KVPool.publish_events_to`) drains its prefix
index's events once per ``poll`` (once per engine step) and hands them over as one batch. A
:class:`KVEventPublisher` sends each batch on a ZeroMQ PUB socket (as vLLM's KV events do) as two
frames: the topic :data:`TOPIC` and a JSON object

    {"worker": "<worker id>", "seq": <batch number, from 0>,
     "events": [["stored" | "removed", "device" | "host" | "disk" | "remote", "<32 hex digits>"], ...],
     "states": [same, for a hybrid model's state checkpoints keyed by the block hash before them]}

(``states`` only from a pool that keeps recurrent-state checkpoints,
:mod:`kvtier.cache.checkpoints.store`; a reader that does not know it ignores it).

A :class:`KVEventSubscriber` applies the batches of any number of workers to a
:class:`GlobalKVView`: which worker holds which block in which tier. Pub/sub is lossy (a
subscriber that joins late misses what came before; a gap in ``seq`` is counted in
``GlobalKVView.gaps``), so the view is a routing hint, never a promise that a block is there.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import zmq

from kvtier.cache.prefix_index import Event, Tier

TOPIC = b"kvtier.kv-events"


@dataclass(frozen=True)
class EventBatch:
    """One published batch: ``events`` are ``(stored, tier name, block hash)``; ``states`` the
    same for state checkpoints (keyed by the hash of the block before their boundary)."""

    worker: str
    seq: int
    events: list[tuple[bool, str, bytes]]
    states: list[tuple[bool, str, bytes]] = field(default_factory=list)

    def encode(self) -> list[bytes]:
        as_json = lambda evs: [["stored" if s else "removed", t, h.hex()] for s, t, h in evs]  # noqa: E731
        body = {"worker": self.worker, "seq": self.seq, "events": as_json(self.events)}
        if self.states:
            body["states"] = as_json(self.states)
        return [TOPIC, json.dumps(body, separators=(",", ":")).encode()]

    @staticmethod
    def decode(frames: list[bytes]) -> EventBatch:
        """Raises ValueError for frames that are not a batch of this format."""
        if len(frames) != 2 or frames[0] != TOPIC:
            raise ValueError(f"not a KV event batch: {len(frames)} frames, topic {frames[0][:40]!r}")
        body = json.loads(frames[1])
        parse = lambda evs: [(kind == "stored", tier, bytes.fromhex(h)) for kind, tier, h in evs]  # noqa: E731
        return EventBatch(str(body["worker"]), int(body["seq"]), parse(body["events"]), parse(body.get("states", [])))


class KVEventPublisher:
    """A ZeroMQ PUB socket publishing one worker's event batches; call it with index events.

    Args:
        endpoint: where to bind, e.g. ``tcp://127.0.0.1:5557``; port 0 picks a free port
            (``endpoint`` then holds the bound address).
        worker_id: the name subscribers see (e.g. the worker's URL).

    Raises:
        ValueError: an endpoint ZeroMQ cannot bind (names it).
    """

    def __init__(self, endpoint: str, worker_id: str):
        self.worker_id, self.seq = worker_id, 0
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 10000)
        try:
            if endpoint.endswith(":0"):
                port = self._sock.bind_to_random_port(endpoint[:-2])
                endpoint = f"{endpoint[:-2]}:{port}"
            else:
                self._sock.bind(endpoint)
        except zmq.ZMQError as e:
            self._sock.close()
            raise ValueError(f"kv events endpoint {endpoint!r} cannot be bound: {e}") from None
        self.endpoint = endpoint

    def __call__(self, events: list[Event], states: list[tuple[bool, Tier, bytes]] = ()) -> None:
        """Publish ``events`` (from :meth:`PrefixIndex.drain_events`) and ``states`` (a checkpoint
        store's ``(stored, tier, key)``) as one batch; empty lists send an empty batch (a heartbeat:
        subscribers learn the worker and its ``seq``)."""
        batch = EventBatch(self.worker_id, self.seq, [(e.added, e.tier.name.lower(), e.hash) for e in events],
                           [(s, t.name.lower(), k) for s, t, k in states])
        self.seq += 1
        try:
            self._sock.send_multipart(batch.encode(), flags=zmq.NOBLOCK)
        except zmq.Again:  # no room (a slow subscriber): dropped, the subscriber sees a seq gap
            pass

    def close(self) -> None:
        self._sock.close()


class GlobalKVView:
    """Which worker holds which block in which tier, rebuilt from event batches alone.

    Attributes:
        gaps: per worker, batches missed (``seq`` jumps); its view may be incomplete.
    """

    def __init__(self):
        self._tiers: dict[str, dict[bytes, set[str]]] = defaultdict(dict)
        self._states: dict[str, dict[bytes, set[str]]] = defaultdict(dict)
        self._next_seq: dict[str, int] = {}
        self.gaps: dict[str, int] = defaultdict(int)

    def apply(self, batch: EventBatch) -> None:
        expected = self._next_seq.get(batch.worker)
        if expected is not None and batch.seq > expected:
            self.gaps[batch.worker] += batch.seq - expected
        self._next_seq[batch.worker] = batch.seq + 1
        for held, events in ((self._tiers[batch.worker], batch.events), (self._states[batch.worker], batch.states)):
            for stored, tier, h in events:
                tiers = held.setdefault(h, set())
                if stored:
                    tiers.add(tier)
                else:
                    tiers.discard(tier)
                    if not tiers:
                        del held[h]

    @property
    def workers(self) -> list[str]:
        """Workers seen so far (a heartbeat is enough)."""
        return list(self._next_seq)

    def tiers(self, worker: str, block_hash: bytes) -> set[str]:
        """Tiers of ``worker`` holding ``block_hash`` (empty if none)."""
        return set(self._tiers.get(worker, {}).get(block_hash, ()))

    def state_tiers(self, worker: str, key: bytes) -> set[str]:
        """Tiers of ``worker`` holding the state checkpoint keyed ``key`` (empty if none)."""
        return set(self._states.get(worker, {}).get(key, ()))

    def resume_tiers(self, worker: str, block_hash: bytes) -> set[str]:
        """Tiers of ``worker`` a prefix ending with ``block_hash`` resumes from: the block's tiers,
        but for a worker that publishes state checkpoints (a hybrid model's), none unless it also
        holds the checkpoint keyed ``block_hash`` in a tier of its own (not only the remote store)."""
        tiers = self.tiers(worker, block_hash)
        if not self._states.get(worker):
            return tiers
        return tiers if self.state_tiers(worker, block_hash) - {"remote"} else set()

    def blocks(self, worker: str, tier: str) -> set[bytes]:
        """Every block ``worker`` holds in ``tier``."""
        return {h for h, ts in self._tiers.get(worker, {}).items() if tier in ts}

    def prefix_tiers(self, worker: str, hashes: Iterable[bytes]) -> list[str]:
        """For the longest prefix of ``hashes`` that ``worker`` holds, the fastest tier of each block."""
        order = [t.name.lower() for t in Tier]
        out = []
        for h in hashes:
            ts = self._tiers.get(worker, {}).get(h)
            if not ts:
                break
            out.append(min(ts, key=order.index))
        return out


class KVEventSubscriber:
    """A ZeroMQ SUB socket on the publishers at ``endpoints``, feeding ``view``."""

    def __init__(self, endpoints: Iterable[str], view: GlobalKVView | None = None):
        self.view = view if view is not None else GlobalKVView()
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        for ep in endpoints:
            self.connect(ep)
        self.bad_messages = 0

    def connect(self, endpoint: str) -> None:
        self._sock.connect(endpoint)

    def poll(self, timeout_s: float = 0.0) -> int:
        """Apply every batch that arrives within ``timeout_s`` of the first wait; returns how many."""
        n = 0
        while self._sock.poll(int(timeout_s * 1000) if n == 0 else 0):
            frames = self._sock.recv_multipart()
            try:
                self.view.apply(EventBatch.decode(frames))
                n += 1
            except (ValueError, KeyError, TypeError):
                self.bad_messages += 1
        return n

    def close(self) -> None:
        self._sock.close()
