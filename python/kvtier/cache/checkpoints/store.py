"""Recurrent-state checkpoints of a hybrid model in every tier: the pool's second kind of object.

A checkpoint holds the KDA recurrent states and conv windows of all linear layers of one sequence
at one token boundary, as one fixed-size uint8 payload (``checkpoint_bytes``; the layout is the
model's, :meth:`kvtier.model.state_slots.StateSlots.pack`). Its key is the 16-byte chained block
hash of the last block before the boundary (:mod:`kvtier.cache.block_hash`), which already carries
the salt (model, dtypes, tenant) and every token before it: a checkpoint is valid exactly where
that block's MLA KV is.

:class:`CheckpointStore` keeps them in device slots of ``checkpoint_bytes`` (restored by a device
copy) and in the tiers below the device that blocks use, opened by the same factory
(:func:`kvtier.cache.tiers.open_stores`) for the checkpoint layout (:func:`checkpoint_meta`): host
slots (:class:`~kvtier.cache.tiers.host.HostStore`), files of a disk tier in their own namespace
directory (:class:`~kvtier.cache.tiers.disk.DiskFiles`, read and written on the copy engine's I/O
workers, header, CRC-32C and key checked on every read) and the remote store under their own key
prefix (:class:`~kvtier.cache.tiers.remote.RemoteStore`). Each tier has its own budget, counted in
checkpoints apart from the KV budget (:class:`kvtier.cache.config.PoolConfig` ``state_*_bytes``).
The simulator passes its virtual-time tiers (:mod:`kvtier.sim.copies`) to this same store.

Saves are written through to every tier at once: device and host copies on the calling thread, the
lower tiers' writes as their jobs, indexed when they ended (:meth:`CheckpointStore.poll`). Under
pressure a tier drops its least valuable unprotected checkpoint: sparse-grid checkpoints
(:attr:`CheckpointKind.GRID`) before prompt and turn ends (:attr:`CheckpointKind.TURN`), least
recently used first within a kind. Checkpoints a session waiting on a tool resumes from are
protected (:meth:`CheckpointStore.protect`) in the tiers that hold them until the wait ends.

Reads never return wrong bytes: a copy that is missing, short, corrupt or under another key is a
failed :class:`CheckpointRead` with its reason, and the copy is dropped from the index.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

import torch

from kvtier.cache.checkpoints.index import TIER_NAMES, CheckpointIndex, CheckpointKind, StateStats
from kvtier.cache.checkpoints.options import BUDGETS, budget_slots, bytes_per_copy
from kvtier.cache.disk_tier import BlockMeta, DiskTier, aligned_empty
from kvtier.cache.host_tier import HostTier
from kvtier.cache.prefix_index import Tier
from kvtier.cache.seams import CopyEngine, CopyJob
from kvtier.cache.tiers import HostStore, TierStore, open_stores
from kvtier.cache.tiers.disk_budget import namespace_dir
from kvtier.cache.tiers.protocol import Admit
from kvtier.cache.remote import RemoteTier
from kvtier.options import flag

STATE_LAYOUT_CODE = 0x57A7E0
"""Layout code (bits 8-31 of :attr:`BlockMeta.dtype`) of a checkpoint file or value: it names their
own namespace directory and key prefix, apart from every KV block layout."""

_REASONS = {1: "missing", 2: "corrupt"}  # DiskStatus and RemoteStatus: 1 MISSING, 2 CORRUPT; else "error"


def checkpoint_meta(checkpoint_bytes: int) -> BlockMeta:
    """The :class:`BlockMeta` a checkpoint file or remote value records (one ``checkpoint_bytes``
    row, layout :data:`STATE_LAYOUT_CODE`)."""
    return BlockMeta(1, 1, checkpoint_bytes, STATE_LAYOUT_CODE << 8, checkpoint_bytes)


class CheckpointRead:
    """One checkpoint read from one tier (``done``/``wait``/``result`` as a copy job).

    Attributes:
        key, tier: what is read, from where.
        payload: the ``[checkpoint_bytes]`` uint8 bytes once ``result() == 0`` (on the device for
            a device read, CPU otherwise); undefined otherwise.
        reason: why it failed (``missing``; ``corrupt``: failed the tier's CRC, size or key check;
            ``error``), once done with a non-zero result; ``""`` while running or after success.
    """

    def __init__(self, key: bytes, tier: Tier, payload: torch.Tensor | None, job: CopyJob | None = None,
                 reason: str = ""):
        self.key, self.tier, self.payload, self._job, self.reason = key, tier, payload, job, reason
        self._status = 1 if reason else 0

    def done(self) -> bool:
        return self._job is None or self._job.done()

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._job is None or self._job.wait(timeout_s)

    def result(self) -> int:
        """0 when ``payload`` holds the checkpoint; else non-zero (``reason`` says why). Waits."""
        if self._job is not None:
            try:
                self._status = int(self._job.result()[0])
            except Exception:  # noqa: BLE001 - a read that raised is a failed read, never an error upward
                self._status = -1
            self.reason = _REASONS.get(self._status, "error") if self._status else ""
            self._job = None
        return self._status


class _DeviceSlots:
    """``num_slots`` checkpoint rows on ``device`` (the device tier)."""

    def __init__(self, num_slots: int, nbytes: int, device):
        self.num_slots = num_slots
        self.storage = torch.empty((num_slots, nbytes), dtype=torch.uint8, device=device) if num_slots else None
        self._free = list(range(num_slots - 1, -1, -1))

    def allocate(self) -> int:
        return self._free.pop()

    def release(self, slot: int) -> None:
        self._free.append(slot)


class CheckpointStore:
    """Checkpoints of ``checkpoint_bytes`` bytes in device slots and the tiers below.

    Args:
        checkpoint_bytes: bytes of one checkpoint (> 0).
        device_slots: checkpoints the device tier holds (0: none).
        device: where device-tier checkpoints live (the model's device).
        stores: the tiers below the device, by :class:`Tier`, as :func:`kvtier.cache.tiers.open_stores`
            opens them for :func:`checkpoint_meta` (without an index: this store indexes its
            copies); the host store's slots hold host copies, the others are written from them.
        clock: seconds, monotonic (recency of use).
        stats: the counters to update.
        counted_bytes: what the byte counters add per checkpoint (default ``checkpoint_bytes``;
            the simulator counts the bytes its placeholder checkpoints stand for).

    Raises:
        ValueError: ``checkpoint_bytes`` <= 0.
    """

    def __init__(self, checkpoint_bytes: int, *, device_slots: int = 0, device="cpu",
                 stores: Mapping[Tier, TierStore] | None = None, clock=None,
                 stats: StateStats | None = None, counted_bytes: float | None = None):
        if not isinstance(checkpoint_bytes, int) or checkpoint_bytes <= 0:
            raise ValueError(f"checkpoint_bytes must be a positive int, got {checkpoint_bytes!r}")
        self.checkpoint_bytes = checkpoint_bytes
        self.counted_bytes = checkpoint_bytes if counted_bytes is None else counted_bytes
        self.meta = checkpoint_meta(checkpoint_bytes)
        self.clock = clock if clock is not None else time.monotonic
        self.stats = stats if stats is not None else StateStats()
        self.device = _DeviceSlots(device_slots, checkpoint_bytes, device)
        self.stores = dict(stores or {})
        self.host: HostStore | None = self.stores.get(Tier.HOST)
        self.lower = [s for t, s in self.stores.items() if t != Tier.HOST]
        self.index = CheckpointIndex(lambda: self.clock())
        # checkpoints each local tier holds (a shared remote store evicts on its own)
        self._capacity = {Tier.DEVICE: device_slots} | {t: s.capacity_blocks() for t, s in self.stores.items() if s.local}
        self._counts = dict.fromkeys(self._capacity, 0)
        self._writes: list[tuple[bytes, TierStore, CopyJob]] = []  # lower tiers' writes in flight
        self._copies: list[CopyJob] = []  # host copies still running (a timed host tier's)
        if Tier.DISK in self.stores:
            for key, meta in self.stores[Tier.DISK].disk.blocks():  # what an earlier run left: kept, dropped first
                if meta == self.meta:
                    self.index.add(key, CheckpointKind.GRID)
                    self.index.gain(key, Tier.DISK)
                    self._counts[Tier.DISK] += 1

    # ---- lookups ------------------------------------------------------------------------------
    def locate(self, key: bytes) -> Tier | None:
        """The fastest tier whose copy of checkpoint ``key`` is indexed, or None."""
        return self.index.locate(key)

    def where(self, key: bytes) -> list[Tier]:
        """Every tier whose copy of ``key`` is indexed, fastest first."""
        return self.index.where(key)

    def count(self, tier: Tier) -> int:
        """Copies held or reserved (a write in flight) in ``tier``; checkpoints indexed there for
        the remote store."""
        return self._counts[tier] if tier in self._counts else self.index.count(tier)

    def __len__(self) -> int:
        return len(self.index)

    def lookup_remote(self, keys: list[bytes]) -> int:
        """Ask the remote store which of ``keys`` (not indexed anywhere yet) it holds and index
        those as remote copies; returns how many were found (0 without a remote tier)."""
        remote = self.stores.get(Tier.REMOTE)
        if remote is None:
            return 0
        ask = [k for k in keys if self.locate(k) is None]
        found = [k for k, present in zip(ask, remote.contains(ask)) if present]
        for k in found:
            self.index.add(k, CheckpointKind.GRID)
            self.index.gain(k, Tier.REMOTE)
        return len(found)

    def pending(self, key: bytes) -> bool:
        """Whether a lower tier's write of ``key`` is in flight (indexed by :meth:`poll` when it ends)."""
        e = self.index.get(key)
        return e is not None and e.pending > 0

    # ---- saves --------------------------------------------------------------------------------
    def save(self, key: bytes, payload: torch.Tensor, kind: CheckpointKind) -> bool:
        """Store ``payload`` (``[checkpoint_bytes]`` uint8, on any device) as checkpoint ``key`` in
        every tier with room (the lower tiers by their write jobs). A key already stored is only
        raised to ``kind`` (if higher) and touched. Returns whether it was new.

        Raises:
            ValueError: ``key`` not 16 bytes, or ``payload`` not ``checkpoint_bytes`` uint8 bytes.
        """
        if not isinstance(key, bytes) or len(key) != 16:
            raise ValueError(f"key must be a 16-byte block hash, got {key!r}")
        n = self.checkpoint_bytes
        if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.numel() != n:
            got = f"{payload.numel()} {payload.dtype}" if isinstance(payload, torch.Tensor) else repr(payload)
            raise ValueError(f"payload must be {n} uint8 bytes, got {got}")
        e = self.index.add(key, kind)
        if e.slots:
            return False
        self.stats.saved[kind.name.lower()] += 1
        if self._room(Tier.DEVICE):
            slot = self.device.allocate()
            self.device.storage[slot].copy_(payload)
            self._gain(key, Tier.DEVICE, slot)
        source = None
        if self._room(Tier.HOST):
            slot = self.host.allocate(1)[0]
            job = self.host.fill([slot], payload.view(1, n))
            if not job.done():
                self._copies.append(job)
            source = self.host.slot(slot)
            self._gain(key, Tier.HOST, slot)
        for store in self.lower:
            if store.tier in self._counts:
                if not self._room(store.tier):
                    continue
                self._counts[store.tier] += 1  # reserved now; given back if the write fails
            elif store.admit(()) != Admit.YES:
                self.stats.refused[store.name] += 1
                continue
            if source is None:
                source = aligned_empty(n).copy_(payload)
            e.pending += 1
            self._writes.append((key, store, store.write([key], source)))
        self.index.forget_if_idle(key)  # no tier took it
        return True

    def _gain(self, key: bytes, tier: Tier, slot: int = 0, reserved: bool = False) -> None:
        self.index.gain(key, tier, slot)
        if tier in self._counts and not reserved:
            self._counts[tier] += 1
        self.stats.bytes_written[TIER_NAMES[tier]] += self.counted_bytes

    def poll(self, wait: bool = False) -> None:
        """Index the lower tiers' writes that ended (all of them, waiting, with ``wait``) and
        collect the host copies that ended."""
        copies, self._copies = self._copies, []
        for job in copies:
            if wait or job.done():
                job.result()
            else:
                self._copies.append(job)
        pending = []
        for key, store, job in self._writes:
            if not (wait or job.done()):
                pending.append((key, store, job))
                continue
            try:
                ok = job.result() == [0]
            except Exception:  # noqa: BLE001 - a failed write is a missing copy, never an error upward
                ok = False
            e = self.index.get(key)  # kept while its write ran (pending)
            e.pending -= 1
            if ok:
                self._gain(key, store.tier, reserved=True)
            else:
                self.stats.refused[store.name] += 1
                if store.tier in self._counts:
                    self._counts[store.tier] -= 1
            self.index.forget_if_idle(key)  # no tier kept it
        self._writes = pending

    # ---- reads --------------------------------------------------------------------------------
    def read(self, key: bytes, tier: Tier) -> CheckpointRead:
        """Start reading checkpoint ``key`` from ``tier`` (a device read ends at once). A failed
        read drops that copy from the index (see the module docstring)."""
        e = self.index.get(key)
        if e is None or tier not in e.slots:
            return CheckpointRead(key, tier, None, reason="missing")
        self.index.touch(key)
        if tier == Tier.DEVICE:
            return CheckpointRead(key, tier, self.device.storage[e.slots[tier]].clone())
        buf, job = self.stores[tier].read([key], [e.slots[tier]])
        payload = buf.reshape(-1)[:self.checkpoint_bytes]
        return CheckpointRead(key, tier, payload.clone() if tier == Tier.HOST else payload, job)

    def ended(self, read: CheckpointRead) -> bool:
        """Account for ended ``read`` (its result waited for): count its bytes or its failure and
        drop a failed copy from the index. Returns whether it succeeded."""
        if read.result() == 0:
            if read.tier != Tier.DEVICE:
                self.stats.bytes_loaded[TIER_NAMES[read.tier]] += self.counted_bytes
            return True
        self.stats.failures[read.reason] += 1
        self.drop(read.key, read.tier)
        return False

    # ---- eviction and protection --------------------------------------------------------------
    def protect(self, keys: Iterable[bytes]) -> None:
        """Keep checkpoints ``keys`` (those stored) from eviction until :meth:`unprotect`."""
        self.index.protect(keys)

    def unprotect(self, keys: Iterable[bytes]) -> None:
        """Undo one :meth:`protect` of each of ``keys``."""
        self.index.unprotect(keys)

    def drain_events(self) -> list[tuple[bool, Tier, bytes]]:
        """``(stored, tier, key)`` for each copy gained or lost since the last call."""
        return self.index.drain_events()

    def drop(self, key: bytes, tier: Tier) -> None:
        """Drop ``key``'s copy in ``tier`` (nothing when there is none)."""
        slot = self.index.lose(key, tier)
        if slot is None:
            return
        if tier == Tier.DEVICE:
            self.device.release(slot)
        elif tier == Tier.HOST:
            self.host.release([slot])
        else:
            self.stores[tier].evict([key])
        if tier in self._counts:
            self._counts[tier] -= 1

    def _room(self, tier: Tier) -> bool:
        """Whether ``tier`` has room for one more checkpoint, evicting its least valuable
        unprotected copy (:meth:`CheckpointIndex.victim`) when full; a host copy a lower tier's
        write still reads is not dropped. Counts a refusal in a tier that has a budget."""
        cap = self._capacity.get(tier, 0)
        if cap == 0:
            return False
        if self._counts[tier] < cap:
            return True
        skip = (lambda e: e.pending > 0) if tier == Tier.HOST else None
        key = self.index.victim(tier, skip)
        if key is None:
            self.stats.refused[TIER_NAMES[tier]] += 1
            return False
        self.drop(key, tier)
        self.stats.evictions[TIER_NAMES[tier]] += 1
        return True

    def close(self) -> None:
        """Wait for the writes in flight (the tiers' I/O workers and the remote store are the pool's)."""
        self.poll(wait=True)


def open_store(checkpoint_bytes: int, *, device_bytes: int = 0, host_bytes: int = 0, disk_bytes: int = 0,
               device="cpu", disk_dir=None, remote: RemoteTier | None = None,
               copy_engine: Callable[[], CopyEngine] | None = None, clock=None,
               names: Mapping[str, str] | None = None) -> CheckpointStore:
    """A :class:`CheckpointStore` with byte budgets, its tiers opened by
    :func:`kvtier.cache.tiers.open_stores` for :func:`checkpoint_meta`.

    Args:
        checkpoint_bytes: bytes of one checkpoint (> 0).
        device_bytes, host_bytes, disk_bytes: budgets of the device, host and disk tiers (0 = no
            checkpoints there); each budget that is not 0 must hold one checkpoint (a host slot
            rounds it up to 4096 bytes, a disk file adds a 4096-byte header).
        device: where device-tier checkpoints live (the model's device).
        disk_dir: the disk tier's directory (None = no disk tier); a pool gives its own namespace
            directory for :func:`checkpoint_meta`.
        remote: a remote tier opened for :func:`checkpoint_meta` (or None).
        copy_engine: returns the copy engine whose I/O workers run the disk tier's reads and
            writes (a pool's :class:`kvtier.cache.seams.CopyEngine`, looked up at each call; None: a
            :class:`kvtier.transfer.CopyEngine` of its own when there is a disk tier).
        clock: seconds, monotonic (recency of use).
        names: the options to name in budget errors (``{"device": "state_device_bytes", ...}``).

    Raises:
        ValueError: ``checkpoint_bytes`` <= 0, or a budget that is not 0 but holds no checkpoint
            (the message names the budget's option).
    """
    n = checkpoint_bytes
    if not isinstance(n, int) or n <= 0:
        raise ValueError(f"checkpoint_bytes must be a positive int, got {n!r}")
    names = {name.split("_")[1]: name for name in BUDGETS} | dict(names or {})
    per_copy = bytes_per_copy(n)
    budgets = {"device": device_bytes, "host": host_bytes, "disk": disk_bytes if disk_dir is not None else 0}
    slots = {t: budget_slots(names[t], value, per_copy[t], n) for t, value in budgets.items()}
    meta = checkpoint_meta(n)
    host = HostTier(slots["host"] * per_copy["host"], n) if slots["host"] else None
    disk = DiskTier(disk_dir, slots["disk"] * per_copy["disk"]) if slots["disk"] else None
    if copy_engine is None and disk is not None:
        from kvtier.transfer import CopyEngine

        own = CopyEngine(1)
        copy_engine = lambda: own  # noqa: E731
    stores = open_stores(meta, host, disk, remote, copy_engine)
    return CheckpointStore(n, device_slots=slots["device"], device=device, stores=stores, clock=clock)


def open_checkpoints(tiers) -> CheckpointStore:
    """The checkpoint store of a pool's ``tiers`` (a :class:`kvtier.cache.tiers.PoolTiers`), on the
    tiers it has (:func:`open_store`): each budget the config leaves None is the tier's KV budget
    (a derived budget below one checkpoint holds none); the disk tier's files in their own
    namespace directory; the remote tier's values under their own key prefix; disk reads and
    writes on the pool's copy engine.

    Raises:
        ValueError: a budget that is not 0 but holds no checkpoint (names its option).
    """
    c, n = tiers.config, tiers.config.state_checkpoint_bytes
    per_copy = bytes_per_copy(n)
    kv_budget = {"device": c.num_device_pages * tiers.block_bytes,
                 "host": c.host_cache_bytes if tiers.host is not None else 0,
                 "disk": c.disk_cache_bytes if c.disk_cache_dir is not None else 0}
    budget, names = {}, {}
    for name in BUDGETS:
        t, given = name.split("_")[1], getattr(c, name)
        budget[t] = given if given is not None else (kv_budget[t] if kv_budget[t] >= per_copy[t] else 0)
        names[t] = f"{name} ({flag(name)})"
    disk_dir = None
    if c.disk_cache_dir is not None:
        disk_dir = namespace_dir(c.disk_cache_dir, c.salt, checkpoint_meta(n))
    remote = None
    if tiers.remote is not None:
        remote = RemoteTier(tiers.remote.backend, checkpoint_meta(n), timeout_s=tiers.remote.timeout_s)
    return open_store(n, device_bytes=budget["device"], host_bytes=budget["host"], disk_bytes=budget["disk"],
                      device=tiers.kv_caches[0].device, disk_dir=disk_dir, remote=remote,
                      copy_engine=lambda: tiers.copy_engine, clock=lambda: tiers.clock(), names=names)


__all__ = ["STATE_LAYOUT_CODE", "CheckpointKind", "CheckpointRead", "CheckpointStore",
           "checkpoint_meta", "open_checkpoints", "open_store"]
