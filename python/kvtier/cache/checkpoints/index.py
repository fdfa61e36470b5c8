"""Which tiers hold each recurrent-state checkpoint, and which one a full tier drops: the records and
rules of the checkpoint store (:mod:`kvtier.cache.checkpoints.store`).

A checkpoint is keyed by the 16-byte block hash of the block before its boundary. Its entry holds
its kind, when it was last used, its slot in each tier that holds it, how many tool waits protect
it and how many writes of it are in flight. Eviction order: an unprotected copy of the lowest kind
(:attr:`CheckpointKind.GRID` before :attr:`CheckpointKind.TURN`), least recently used first. An
entry with no copy, no write in flight and no protection is forgotten. Every copy gained or lost is
an event ``(stored, tier, key)`` (what :mod:`kvtier.cache.kv_events` publishes).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields

from kvtier.cache.pool_stats import series
from kvtier.cache.prefix_index import Tier


class CheckpointKind(enum.IntEnum):
    """Why a checkpoint was saved; under pressure lower kinds are dropped first."""

    GRID = 0
    """A point of the sparse grid (``state_checkpoint_tokens``)."""
    TURN = 1
    """The end of a prompt or of a finished turn: where a session's next request resumes."""


@dataclass(frozen=True)
class Checkpoint:
    """One recurrent-state checkpoint crossing the serving loop as data: a restore the pool hands
    the runner (on the step's batch) or a save the runner hands the pool (in its step result).

    Attributes:
        kv: the request it belongs to (a :class:`kvtier.cache.kv_state.KVState`); its block
            hashes key the checkpoint.
        num_tokens: the token boundary it stands at (a positive multiple of ``page_size``).
        payload: ``[checkpoint_bytes]`` uint8 (the model's layout,
            :meth:`kvtier.model.state_slots.StateSlots.pack`), on any device; None where no bytes
            are kept (the simulator).
        kind: why it was taken (:class:`CheckpointKind`).
    """

    kv: object = field(repr=False)
    num_tokens: int
    payload: object = field(default=None, repr=False)
    kind: CheckpointKind = CheckpointKind.TURN


@dataclass
class CheckpointEntry:
    """One checkpoint's record: ``slots`` by tier (a device or host slot id; 0 in keyed tiers),
    ``protected`` tool waits holding it, ``pending`` writes of it in flight."""

    kind: CheckpointKind
    last_use: float
    slots: dict[Tier, int] = field(default_factory=dict)
    protected: int = 0
    pending: int = 0

    @property
    def idle(self) -> bool:
        return not (self.slots or self.pending or self.protected)


class CheckpointIndex:
    """Checkpoint entries by key, with the eviction order and events (see the module docstring).

    Args:
        clock: seconds, monotonic (recency of use).
    """

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.entries: dict[bytes, CheckpointEntry] = {}
        self._events: list[tuple[bool, Tier, bytes]] = []

    # ---- lookups ------------------------------------------------------------------------------
    def get(self, key: bytes) -> CheckpointEntry | None:
        """``key``'s entry (16-byte block hash), or None."""
        return self.entries.get(key)

    def locate(self, key: bytes) -> Tier | None:
        """The fastest tier holding a copy of ``key``, or None."""
        e = self.entries.get(key)
        return min(e.slots) if e is not None and e.slots else None

    def where(self, key: bytes) -> list[Tier]:
        """Every tier holding a copy of ``key``, fastest first."""
        e = self.entries.get(key)
        return sorted(e.slots) if e is not None else []

    def count(self, tier: Tier) -> int:
        """Checkpoints with a copy in ``tier``."""
        return sum(1 for e in self.entries.values() if tier in e.slots)

    def __len__(self) -> int:
        return sum(1 for e in self.entries.values() if e.slots)

    # ---- changes ------------------------------------------------------------------------------
    def add(self, key: bytes, kind: CheckpointKind) -> CheckpointEntry:
        """``key``'s entry (made if new), raised to ``kind`` if higher and touched."""
        e = self.entries.get(key)
        if e is None:
            e = self.entries[key] = CheckpointEntry(kind, self.clock())
        else:
            e.kind, e.last_use = max(e.kind, kind), self.clock()
        return e

    def touch(self, key: bytes) -> None:
        """Mark ``key`` used now (clock seconds): it is evicted after less recently used ones."""
        e = self.entries.get(key)
        if e is not None:
            e.last_use = self.clock()

    def gain(self, key: bytes, tier: Tier, slot: int = 0) -> None:
        """``tier`` now holds a copy of ``key`` (its entry must exist) in ``slot``."""
        self.entries[key].slots[tier] = slot
        self._events.append((True, tier, key))

    def lose(self, key: bytes, tier: Tier) -> int | None:
        """``tier`` no longer holds ``key``: its slot (None when it held none). Forgets an idle entry."""
        e = self.entries.get(key)
        if e is None or tier not in e.slots:
            return None
        slot = e.slots.pop(tier)
        self._events.append((False, tier, key))
        self.forget_if_idle(key)
        return slot

    def forget_if_idle(self, key: bytes) -> None:
        e = self.entries.get(key)
        if e is not None and e.idle:
            del self.entries[key]

    def victim(self, tier: Tier, skip: Callable[[CheckpointEntry], bool] | None = None) -> bytes | None:
        """The copy ``tier`` drops first: the unprotected entry of the lowest kind, least recently
        used (``skip``: entries not to drop now); None when there is none."""
        best = None
        for k, e in self.entries.items():
            if tier in e.slots and not e.protected and not (skip is not None and skip(e)):
                rank = (e.kind, e.last_use)
                if best is None or rank < best[0]:
                    best = (rank, k)
        return None if best is None else best[1]

    def protect(self, keys: Iterable[bytes]) -> None:
        """Keep ``keys`` (those indexed) from eviction until :meth:`unprotect`."""
        for k in keys:
            if k in self.entries:
                self.entries[k].protected += 1

    def unprotect(self, keys: Iterable[bytes]) -> None:
        """Undo one :meth:`protect` of each of ``keys``; an idle entry is then forgotten."""
        for k in keys:
            e = self.entries.get(k)
            if e is not None and e.protected:
                e.protected -= 1
                self.forget_if_idle(k)

    def drain_events(self) -> list[tuple[bool, Tier, bytes]]:
        """``(stored, tier, key)`` for each copy gained or lost since the last call."""
        events, self._events = self._events, []
        return events


TIER_NAMES = {Tier.DEVICE: "device", Tier.HOST: "host", Tier.DISK: "disk", Tier.REMOTE: "remote"}
"""Tier names as :class:`StateStats` counts them."""


@dataclass
class StateStats:
    """Counters of a hybrid pool's recurrent-state checkpoints (:mod:`kvtier.cache.checkpoints.store`)
    by tier (``device``, ``host``, ``disk``, ``remote``), kind or reason; bytes in bytes. Each field
    means what the help of its series says (:func:`kvtier.cache.pool_stats.series`), and: ``bytes_loaded`` has no device
    entry (a device hit moves no bytes between tiers); ``refused`` counts a tier where everything is
    protected or the budget holds none; ``failures``: ``missing`` (gone from the tier), ``corrupt``
    (failed the disk or remote tier's check: CRC-32C, size or key, so a short read or a value under
    another key counts here), ``error`` (the store failed or timed out); ``fallbacks`` include a
    fall back to token 0; ``tokens_lost`` counts exact hits only.
    """

    hits: dict[str, int] = series(
        "kvtier_state_checkpoint_hits", "recurrent-state checkpoints restored into a request, by the tier they came "
        "from (device: a device checkpoint slot)", "tier",
        default_factory=lambda: {"device": 0, "host": 0, "disk": 0, "remote": 0})
    bytes_loaded: dict[str, int] = series(
        "kvtier_state_checkpoint_bytes_loaded", "checkpoint bytes read from a tier below the device, by tier", "tier",
        default_factory=lambda: {"host": 0, "disk": 0, "remote": 0})
    bytes_written: dict[str, int] = series(
        "kvtier_state_checkpoint_bytes_written", "checkpoint bytes written, by tier", "tier",
        default_factory=lambda: {"device": 0, "host": 0, "disk": 0, "remote": 0})
    saved: dict[str, int] = series(
        "kvtier_state_checkpoints_saved", "checkpoints saved, by kind (grid: the prefill's sparse grid; turn: a "
        "prompt's or a turn's end)", "kind", default_factory=lambda: {"grid": 0, "turn": 0})
    evictions: dict[str, int] = series(
        "kvtier_state_checkpoint_evictions", "checkpoints dropped to make room, by tier", "tier",
        default_factory=lambda: {"device": 0, "host": 0, "disk": 0})
    refused: dict[str, int] = series(
        "kvtier_state_checkpoints_refused", "checkpoints not stored in a tier that had no room, by tier", "tier",
        default_factory=lambda: {"device": 0, "host": 0, "disk": 0, "remote": 0})
    failures: dict[str, int] = series(
        "kvtier_state_checkpoint_failures", "checkpoint reads that failed (each fell back to an earlier point), by "
        "reason: missing, corrupt, error", "reason", default_factory=lambda: {"missing": 0, "corrupt": 0, "error": 0})
    fallbacks: int = series("kvtier_state_checkpoint_fallbacks", "restores that fell back to an earlier point after "
                            "a failed checkpoint or a missing MLA block", default=0)
    tokens_lost: int = series("kvtier_state_tokens_lost", "prompt tokens whose MLA blocks were reachable but not "
                              "reused: no checkpoint was reachable at their boundary", default=0)

    def copy(self) -> StateStats:
        return StateStats(**{f.name: (dict(v) if isinstance(v := getattr(self, f.name), dict) else v)
                             for f in fields(self)})


__all__ = ["TIER_NAMES", "Checkpoint", "CheckpointEntry", "CheckpointIndex", "CheckpointKind", "StateStats"]
