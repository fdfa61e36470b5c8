"""A hybrid model's recurrent state in virtual time: a checkpoint store that keeps no bytes.

Kimi K3's checkpoint (the KDA states and conv windows of its 69 linear layers at one token
boundary) is 449 MB in fp32, so the simulator keeps only its bookkeeping:

- :class:`SimCheckpointStore` has :class:`kvtier.cache.checkpoints.store.CheckpointStore`'s
  methods and policies (per-tier budgets, counted in checkpoints; sparse-grid checkpoints dropped
  before prompt and turn ends, least recently used first within a kind; tool-wait protection;
  write-through to every tier) without payloads. Its copies are jobs of the worker's
  :class:`~kvtier.sim.copies.SimCopyEngine`, queued on the same modelled links as the KV
  blocks: a save's host copy on the device -> host link, its disk copy on the storage link
  (indexed when it ended, by :meth:`SimCheckpointStore.poll`); a host read on the host -> device
  link, a disk read on the storage link then the host -> device link. A device read ends at once.
  The pool waits for a read as it waits for a block load (the request stays LOADING), so a
  restored checkpoint's load time is charged before the request runs.
- the timed runner (:class:`kvtier.sim.engine.TimedRunner`) takes the engine's checkpoints
  (:class:`kvtier.serve.hybrid_state.CheckpointPlan`: the last page boundary of each prompt
  chunk that reaches the sequence's end as ``TURN``, every ``state_checkpoint_tokens`` as
  ``GRID``, and the last decode page boundary of a sequence that stops running as ``TURN``) and
  returns them in its step result, without bytes, for the engine to hand the pool. The ``grid``
  policy saves only the grid points.

Bytes: under tensor parallelism each device holds ``1 / tp`` of a sequence's KDA state (its KDA
heads) and copies its share over its own host link, as it loads its replica of the MLA blocks.
So a host copy moves ``state_bytes / tp`` bytes per device (``link_bytes``), a disk copy the
whole ``state_bytes`` through the node's storage link. The pool's cost model prices a checkpoint
by ``checkpoint_bytes``: the per-device share in the pool's placeholder units (see
:class:`~kvtier.sim.copies.TierLinks`). The byte counters (``stats``) count ``counted_bytes`` per checkpoint: a
worker's store counts ``state_bytes`` (all devices together) in its pool's placeholder units, as
its KV counters, so reports scale both alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.cache.checkpoints.index import TIER_NAMES, CheckpointIndex, CheckpointKind, IndexedCheckpoints
from kvtier.cache.pool_stats import StateStats
from kvtier.cache.prefix_index import Tier
from kvtier.options import check_int
from kvtier.serve.hybrid_state import CheckpointPlan
from kvtier.sim.copies import SimCopyEngine, SimCopyHandle

CHECKPOINT_POLICIES = CheckpointPlan.POLICIES
"""``turn``: prompt ends, turn ends and the grid (the engine's); ``grid``: the sparse grid only."""



class SimCheckpointRead:
    """A checkpoint read ending at a virtual time (the :class:`CheckpointRead` interface).

    Attributes:
        key, tier: what is read, from where.
        payload: always None (no bytes are kept).
        reason: ``"missing"`` for a read of a copy the store does not hold; ``""`` otherwise.
    """

    def __init__(self, key: bytes, tier: Tier, handle: SimCopyHandle | None, status: int = 0, reason: str = ""):
        self.key, self.tier, self.payload = key, tier, None
        self._handle, self._status, self.reason = handle, status, reason

    def done(self) -> bool:
        return self._handle is None or self._handle.done()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Stall the clock until the read ended (or ``timeout_s`` passed); True if it ended."""
        return True if self._handle is None else self._handle.wait(timeout_s)

    def result(self) -> int:
        """0 once the read ended well (stalls until then); 1 for a missing copy."""
        if self._handle is not None:
            self._handle.result()
        return self._status


@dataclass(frozen=True)
class CheckpointSizes:
    """A hybrid model's checkpoint sizes and per-worker budgets (:mod:`kvtier.sim.run` sizes them).

    Attributes:
        state_bytes: one sequence's KDA states and conv windows, all devices, bytes.
        link_bytes: the share one device holds and copies over its host link, bytes.
        checkpoint_tokens: the grid spacing, tokens.
        device_checkpoints, host_checkpoints, disk_checkpoints: checkpoints each tier holds.
        state_slots: state slots on the devices (one per running sequence).
    """

    state_bytes: int
    link_bytes: float
    checkpoint_tokens: int
    device_checkpoints: int
    host_checkpoints: int
    disk_checkpoints: int
    state_slots: int


class SimCheckpointStore(IndexedCheckpoints):
    """State checkpoints in the device, host and disk tiers, without bytes (module docstring).

    Args:
        checkpoint_bytes: one checkpoint in the pool's units (what its cost model prices), > 0.
        state_bytes: modelled bytes of one checkpoint, all devices (the counters' unit), > 0.
        link_bytes: modelled bytes one device's host link moves per checkpoint (> 0).
        copy_engine: the worker's copy engine (its clock and links).
        device_slots, host_slots, disk_slots: checkpoints each tier holds (0 = none there).
        counted_bytes: what the byte counters add per checkpoint (default ``state_bytes``; a
            worker counts in its pool's placeholder units, as its KV counters).

    Attributes:
        stats: a :class:`kvtier.cache.pool_stats.StateStats`, bytes in modelled bytes.

    Raises:
        ValueError: a size or budget that is not a positive (budgets: non-negative) int.
    """

    def __init__(self, checkpoint_bytes: int, state_bytes: int, link_bytes: float, copy_engine: SimCopyEngine, *,
                 device_slots: int = 0, host_slots: int = 0, disk_slots: int = 0, counted_bytes: float | None = None):
        self.checkpoint_bytes = check_int("checkpoint_bytes", checkpoint_bytes, min_value=1)
        self.state_bytes = check_int("state_bytes", state_bytes, min_value=1)
        if not link_bytes > 0:
            raise ValueError(f"link_bytes must be > 0, got {link_bytes!r}")
        self.link_bytes = float(link_bytes)
        self._counted = state_bytes if counted_bytes is None else counted_bytes
        self.copies, self.clock = copy_engine, copy_engine.clock
        self._capacity = {Tier.DEVICE: check_int("device_slots", device_slots, min_value=0),
                          Tier.HOST: check_int("host_slots", host_slots, min_value=0),
                          Tier.DISK: check_int("disk_slots", disk_slots, min_value=0)}
        self._counts = dict.fromkeys(self._capacity, 0)
        self.index = CheckpointIndex(self.clock)
        self._writes: list[tuple[bytes, SimCopyHandle]] = []  # disk writes in flight
        self._copies: list[SimCopyHandle] = []  # host copies in flight (collected by poll)
        self.stats = StateStats()
        self.remote = None

    # ---- lookups ------------------------------------------------------------------------------
    def tiers(self) -> list[Tier]:
        return [t for t, cap in self._capacity.items() if cap]


    def lookup_remote(self, keys: list[bytes]) -> int:
        """No remote tier in the simulator: 0."""
        return 0

    def count(self, tier: Tier) -> int:
        """Copies held or reserved (a disk write in flight) in ``tier``."""
        return self._counts.get(tier, 0)

    # ---- saves --------------------------------------------------------------------------------
    def save(self, key: bytes, payload=None, kind: CheckpointKind = CheckpointKind.TURN) -> bool:
        """Index checkpoint ``key`` in every tier with room (``payload`` is ignored): the device copy
        at once, the host copy at once with its device -> host job queued, the disk copy once its
        write job ended. A key already kept is raised to ``kind`` and touched. Returns whether it
        was new.

        Raises:
            ValueError: ``key`` not a 16-byte block hash.
        """
        if not isinstance(key, bytes) or len(key) != 16:
            raise ValueError(f"key must be a 16-byte block hash, got {key!r}")
        e = self.index.add(key, kind)
        if e.slots:
            return False
        self.stats.saved[kind.name.lower()] += 1
        for tier in (Tier.DEVICE, Tier.HOST):
            if not self._capacity[tier]:
                continue
            if not self._make_room(tier):
                self.stats.refused[TIER_NAMES[tier]] += 1
                continue
            self.index.gain(key, tier)
            self._counts[tier] += 1
            self.stats.bytes_written[TIER_NAMES[tier]] += self._counted
            if tier == Tier.HOST:
                self._copies.append(self.copies.submit_bytes("device->host", self.link_bytes))
        if self._capacity[Tier.DISK]:
            if self._make_room(Tier.DISK):
                self._counts[Tier.DISK] += 1  # reserved now, indexed when the write ended
                e.pending += 1
                self._writes.append((key, self.copies.submit_bytes("disk", self.state_bytes)))
            else:
                self.stats.refused["disk"] += 1
        self.index.forget_if_idle(key)  # no tier took it
        return True

    def poll(self, wait: bool = False) -> None:
        """Index the disk writes that ended (all of them, stalling the clock, with ``wait``) and
        collect the host copies that ended."""
        copies, self._copies = self._copies, []
        for handle in copies:
            if wait or handle.done():
                handle.result()
            else:
                self._copies.append(handle)
        pending = []
        for key, handle in self._writes:
            if not (wait or handle.done()):
                pending.append((key, handle))
                continue
            handle.result()
            self.index.get(key).pending -= 1  # kept while its write ran
            self.index.gain(key, Tier.DISK)
            self.stats.bytes_written["disk"] += self._counted
        self._writes = pending

    # ---- reads --------------------------------------------------------------------------------
    def read(self, key: bytes, tier: Tier) -> SimCheckpointRead:
        """Start reading ``key`` from ``tier``: a device read ends now; a host read after its
        host -> device job, a disk read after its storage job and then its host -> device job."""
        e = self.index.get(key)
        if e is None or tier not in e.slots:
            return SimCheckpointRead(key, tier, None, 1, "missing")
        self.index.touch(key)
        if tier == Tier.DEVICE:
            return SimCheckpointRead(key, tier, None)
        after = 0.0
        if tier == Tier.DISK:
            after = self.copies.submit_bytes("disk", self.state_bytes).end_s
        return SimCheckpointRead(key, tier, self.copies.submit_bytes("host->device", self.link_bytes,
                                                                     not_before=after))

    def ended(self, read: SimCheckpointRead) -> bool:
        """Account for ended ``read``: its bytes, or its failure (the copy dropped)."""
        if read.result() == 0:
            if read.tier in (Tier.HOST, Tier.DISK):
                self.stats.bytes_loaded[TIER_NAMES[read.tier]] += self._counted
            return True
        self.stats.failures[read.reason if read.reason in self.stats.failures else "error"] += 1
        self.drop(read.key, read.tier)
        return False

    # ---- eviction and protection --------------------------------------------------------------
    def drain_events(self) -> list:
        """No KV events from the simulator's checkpoints (nobody subscribes)."""
        self.index.drain_events()
        return []

    def close(self) -> None:
        self.poll(wait=True)


__all__ = ["CHECKPOINT_POLICIES", "CheckpointSizes", "SimCheckpointRead", "SimCheckpointStore"]
