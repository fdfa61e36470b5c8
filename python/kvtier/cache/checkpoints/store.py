"""Recurrent-state checkpoints of a hybrid model in every tier: the pool's second kind of object.

A checkpoint holds the KDA recurrent states and conv windows of all linear layers of one sequence
at one token boundary, as one fixed-size uint8 payload (``checkpoint_bytes``; the layout is the
model's, :meth:`kvtier.model.state_slots.StateSlots.pack`). Its key is the 16-byte chained block
hash of the last block before the boundary (:mod:`kvtier.cache.block_hash`), which already carries
the salt (model, dtypes, tenant) and every token before it: a checkpoint is valid exactly where
that block's MLA KV is.

:class:`CheckpointStore` keeps them in the tiers the pool has, each with its own byte budget,
separate from the KV budget (:class:`kvtier.cache.config.PoolConfig` ``state_*_bytes``):

- **device**: slots of ``checkpoint_bytes`` on the model's device (restored by a device copy);
- **host**: :class:`kvtier.cache.host_tier.HostTier` slots;
- **disk**: checkpoint files in their own namespace directory (a :class:`DiskTier` with a
  checkpoint layout: header, CRC-32C and key checked on every read);
- **remote**: the shared store under their own key prefix (:class:`RemoteTier`, checked likewise).

Saves are written through to every tier at once (device and host copies on the calling thread;
disk and remote writes on a writer thread, indexed when they ended, by :meth:`CheckpointStore.poll`).
Under pressure a tier drops its least valuable unprotected checkpoint: sparse-grid checkpoints
(:attr:`CheckpointKind.GRID`) before prompt and turn ends (:attr:`CheckpointKind.TURN`), least
recently used first within a kind. Checkpoints a session waiting on a tool resumes from are
protected (:meth:`CheckpointStore.protect`) in the tiers that hold them until the wait ends.

Reads never return wrong bytes: a disk or remote checkpoint that is missing, short, corrupt or
under another key is a failed :class:`CheckpointRead` with its reason, and the copy is dropped
from the index.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvtier.cache.checkpoints.index import TIER_NAMES, CheckpointIndex, CheckpointKind, IndexedCheckpoints
from kvtier.cache.disk_tier import BlockMeta, DiskStatus, DiskTier, aligned_empty
from kvtier.cache.host_tier import HostTier
from kvtier.cache.pool_stats import StateStats
from kvtier.cache.prefix_index import Tier
from kvtier.cache.remote import RemoteStatus, RemoteTier, open_remote
from kvtier.cache.tiers.disk_budget import namespace_dir

STATE_LAYOUT_CODE = 0x57A7E0
"""Layout code (bits 8-31 of :attr:`BlockMeta.dtype`) of a checkpoint file or value: it names their
own namespace directory and key prefix, apart from every KV block layout."""



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

    def __init__(self, key: bytes, tier: Tier, payload: torch.Tensor | None, future: Future | None = None,
                 status: int = 0, reason: str = ""):
        self.key, self.tier, self.payload = key, tier, payload
        self._future, self._status, self.reason = future, status, reason

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def wait(self, timeout_s: float | None = None) -> bool:
        if self._future is not None:
            try:
                self._future.result(timeout_s)
            except TimeoutError:
                return False
            except Exception:  # noqa: BLE001 - reported by result()
                pass
        return True

    def result(self) -> int:
        """0 when ``payload`` holds the checkpoint; else non-zero (``reason`` says why). Waits."""
        if self._future is not None:
            try:
                self._status, self.reason = self._future.result()
            except Exception:  # noqa: BLE001 - a read that raised is a failed read, never an error upward
                self._status, self.reason = 1, "error"
            self._future = None
        return self._status


class _DeviceSlots:
    """``num_slots`` checkpoint rows on ``device`` (the device tier)."""

    def __init__(self, num_slots: int, nbytes: int, device):
        self.num_slots = num_slots
        self.storage = torch.empty((num_slots, nbytes), dtype=torch.uint8, device=device) if num_slots else None
        self._free = list(range(num_slots - 1, -1, -1))

    def allocate(self) -> int | None:
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def slot(self, slot: int) -> torch.Tensor:
        return self.storage[slot]


def _budget(name: str, value: int, nbytes: int, per_copy: int) -> int:
    """Copies ``value`` bytes hold; 0 for 0; ValueError naming ``name`` when it holds none."""
    if value and value < per_copy:
        raise ValueError(f"{name}={value} is smaller than one state checkpoint ({per_copy} bytes for a "
                         f"{nbytes}-byte checkpoint): give it at least {per_copy} bytes, or 0 for no checkpoints "
                         "in that tier")
    return value // per_copy if value else 0


class CheckpointStore(IndexedCheckpoints):
    """Checkpoints of ``checkpoint_bytes`` bytes in the device, host, disk and remote tiers.

    Args:
        checkpoint_bytes: bytes of one checkpoint (> 0).
        device_bytes, host_bytes, disk_bytes: budgets of the device, host and disk tiers (0 = no
            checkpoints there); each budget that is not 0 must hold one checkpoint (a host slot
            rounds it up to 4096 bytes, a disk file adds a 4096-byte header).
        device: where device-tier checkpoints live (the model's device).
        disk_dir: the directory of the disk tier's checkpoint files (None = no disk tier); a pool
            gives its own namespace directory for :func:`checkpoint_meta`.
        remote: a remote tier opened for :func:`checkpoint_meta` (or None); ``remote_url`` opens one.
        clock: seconds, monotonic (recency of use).
        stats: the counters to update.
        names: the options to name in budget errors (``{"device": "state_device_bytes", ...}``).

    Raises:
        ValueError: ``checkpoint_bytes`` <= 0, or a budget that is not 0 but holds no checkpoint
            (the message names the budget's option).
    """

    def __init__(self, checkpoint_bytes: int, *, device_bytes: int = 0, host_bytes: int = 0, disk_bytes: int = 0,
                 device="cpu", disk_dir=None, remote: RemoteTier | None = None, remote_url: str | None = None,
                 remote_timeout_s: float = 1.0, clock=None, stats: StateStats | None = None,
                 names: dict[str, str] | None = None):
        if not isinstance(checkpoint_bytes, int) or checkpoint_bytes <= 0:
            raise ValueError(f"checkpoint_bytes must be a positive int, got {checkpoint_bytes!r}")
        import time

        names = {"device": "state_device_bytes", "host": "state_host_bytes", "disk": "state_disk_bytes",
                 **(names or {})}
        self.checkpoint_bytes = n = checkpoint_bytes
        self.meta = checkpoint_meta(n)
        self.clock = clock if clock is not None else time.monotonic
        self.stats = stats if stats is not None else StateStats()
        self.device = _DeviceSlots(_budget(names["device"], device_bytes, n, n), n, device)
        host_slots = _budget(names["host"], host_bytes, n, HostTier.row_bytes(n))
        self.host = HostTier(host_slots * HostTier.row_bytes(n), n) if host_slots else None
        self.disk: DiskTier | None = None
        self.disk_slots = 0
        if disk_dir is not None and disk_bytes:
            self.disk_slots = _budget(names["disk"], disk_bytes, n, DiskTier.file_bytes(n))
            self.disk = DiskTier(disk_dir, self.disk_slots * DiskTier.file_bytes(n))
        if remote is None and remote_url is not None:
            remote = open_remote(remote_url, self.meta, remote_timeout_s)
        self.remote = remote
        self.index = CheckpointIndex(lambda: self.clock())
        self._counts = {Tier.DEVICE: 0, Tier.HOST: 0, Tier.DISK: 0}
        self._capacity = {Tier.DEVICE: self.device.num_slots, Tier.HOST: 0 if self.host is None else self.host.num_slots,
                          Tier.DISK: self.disk_slots}
        # Reads on their own thread, so a restore never queues behind a save's writes. A host slot a
        # write reads from is not evicted until the write ended (``CheckpointEntry.pending``).
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kvtier-state-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvtier-state-write")
        self._writes: list[tuple[bytes, list[Tier], Future]] = []
        if self.disk is not None:
            for key, meta in self.disk.blocks():  # checkpoints a earlier run left: kept, dropped first
                if meta == self.meta:
                    self.index.add(key, CheckpointKind.GRID)
                    self.index.gain(key, Tier.DISK)
                    self._counts[Tier.DISK] += 1

    # ---- lookups ------------------------------------------------------------------------------
    def tiers(self) -> list[Tier]:
        """The tiers holding checkpoints in this store, fastest first."""
        have = {Tier.DEVICE: self.device.num_slots > 0, Tier.HOST: self.host is not None,
                Tier.DISK: self.disk is not None, Tier.REMOTE: self.remote is not None}
        return [t for t in Tier if have[t]]


    def lookup_remote(self, keys: list[bytes]) -> int:
        """Ask the remote store which of ``keys`` (not indexed anywhere yet) it holds and index
        those as remote copies; returns how many were found (0 without a remote tier)."""
        if self.remote is None:
            return 0
        ask = [k for k in keys if self.locate(k) is None]
        found = 0
        for k, present in zip(ask, self.remote.exists(ask)):
            if present:
                self.index.add(k, CheckpointKind.GRID)
                self.index.gain(k, Tier.REMOTE)
                found += 1
        return found

    def pending(self, key: bytes) -> bool:
        """Whether a disk or remote write of ``key`` is in flight (indexed by :meth:`poll` when it ends)."""
        e = self.index.get(key)
        return e is not None and e.pending > 0


    # ---- saves --------------------------------------------------------------------------------
    def save(self, key: bytes, payload: torch.Tensor, kind: CheckpointKind) -> bool:
        """Store ``payload`` (``[checkpoint_bytes]`` uint8, on any device) as checkpoint ``key`` in
        every tier with room (disk and remote in the background). A key already stored is only
        raised to ``kind`` (if higher) and touched. Returns whether it was new.

        Raises:
            ValueError: ``key`` not 16 bytes, or ``payload`` not ``checkpoint_bytes`` uint8 bytes.
        """
        if not isinstance(key, bytes) or len(key) != 16:
            raise ValueError(f"key must be a 16-byte block hash, got {key!r}")
        if payload.dtype != torch.uint8 or payload.numel() != self.checkpoint_bytes:
            raise ValueError(f"payload must be {self.checkpoint_bytes} uint8 bytes, got {payload.numel()} "
                             f"{payload.dtype}")
        e = self.index.add(key, kind)
        if e.slots:
            return False
        self.stats.saved[kind.name.lower()] += 1
        n = self.checkpoint_bytes
        if self._make_room(Tier.DEVICE):
            slot = self.device.allocate()
            self.device.slot(slot).copy_(payload)
            self.index.gain(key, Tier.DEVICE, slot)
            self._counts[Tier.DEVICE] += 1
            self.stats.bytes_written["device"] += n
        elif self.device.num_slots:
            self.stats.refused["device"] += 1
        host_copy = None
        if self.host is not None:
            if self._make_room(Tier.HOST):
                slot = self.host.allocate()
                host_copy = self.host.slot(slot)
                host_copy.copy_(payload)
                self.index.gain(key, Tier.HOST, slot)
                self._counts[Tier.HOST] += 1
                self.stats.bytes_written["host"] += n
            else:
                self.stats.refused["host"] += 1
        if self.disk is not None or self.remote is not None:
            if host_copy is None:
                host_copy = aligned_empty(n)
                host_copy.copy_(payload)
            self._write_below(key, e, host_copy)
        self.index.forget_if_idle(key)  # no tier took it
        return True

    def _write_below(self, key: bytes, e, buf: torch.Tensor) -> None:
        """Start the disk and remote writes of ``key`` from ``buf`` (its host slot, or a copy)."""
        jobs = []
        if self.disk is not None:
            if self._make_room(Tier.DISK):
                self._counts[Tier.DISK] += 1  # reserved now; given back if the write fails
                jobs.append(Tier.DISK)
            else:
                self.stats.refused["disk"] += 1
        if self.remote is not None:
            jobs.append(Tier.REMOTE)
        if not jobs:
            return
        e.pending += 1
        meta, disk, remote = self.meta, self.disk, self.remote

        def run() -> dict[Tier, bool]:
            out = {}
            if Tier.DISK in jobs:
                src = buf if buf.data_ptr() % 4096 == 0 else aligned_empty(meta.payload_bytes).copy_(buf)
                out[Tier.DISK] = disk.write(key, meta, src) == DiskStatus.OK
            if Tier.REMOTE in jobs:
                out[Tier.REMOTE] = remote.put([key], buf).result()[0] == RemoteStatus.OK
            return out

        self._writes.append((key, jobs, self._writer.submit(run)))

    def poll(self, wait: bool = False) -> None:
        """Index the disk and remote writes that ended (all of them, waiting, with ``wait``)."""
        pending = []
        for key, jobs, fut in self._writes:
            if not (wait or fut.done()):
                pending.append((key, jobs, fut))
                continue
            try:
                ok = fut.result()
            except Exception:  # noqa: BLE001 - a failed write is a missing copy, never an error upward
                ok = dict.fromkeys(jobs, False)
            e = self.index.get(key)  # kept while its write ran (pending)
            e.pending -= 1
            n = self.checkpoint_bytes
            for tier in (Tier.DISK, Tier.REMOTE):
                if tier not in ok:
                    continue
                if tier == Tier.DISK and not ok[tier]:
                    self._counts[Tier.DISK] -= 1
                if ok[tier]:
                    self.index.gain(key, tier)
                    self.stats.bytes_written[TIER_NAMES[tier]] += n
                else:
                    self.stats.refused[TIER_NAMES[tier]] += 1
            self.index.forget_if_idle(key)  # no tier kept it
        self._writes = pending

    # ---- reads --------------------------------------------------------------------------------
    def read(self, key: bytes, tier: Tier) -> CheckpointRead:
        """Start reading checkpoint ``key`` from ``tier`` (device and host reads end at once).
        A failed read drops that copy from the index (see the module docstring)."""
        e = self.index.get(key)
        if e is None or tier not in e.slots:
            return self._failed(key, tier, "missing")
        self.index.touch(key)
        n = self.checkpoint_bytes
        if tier == Tier.DEVICE:
            return CheckpointRead(key, tier, self.device.slot(e.slots[tier]).clone())
        if tier == Tier.HOST:
            self.stats.bytes_loaded["host"] += n
            return CheckpointRead(key, tier, self.host.slot(e.slots[tier]).clone())
        out = aligned_empty(n)
        if tier == Tier.DISK:
            disk, meta = self.disk, self.meta

            def run():
                status = disk.read(key, meta, out)
                if status == DiskStatus.OK:
                    return 0, ""
                return 1, {DiskStatus.MISSING: "missing", DiskStatus.CORRUPT: "corrupt"}.get(status, "error")
        else:
            remote = self.remote

            def run():
                status = remote.get([key], out).result()[0]
                if status == RemoteStatus.OK:
                    return 0, ""
                return 1, {RemoteStatus.MISSING: "missing", RemoteStatus.CORRUPT: "corrupt"}.get(status, "error")
        return CheckpointRead(key, tier, out, self._reader.submit(run))

    def ended(self, read: CheckpointRead) -> bool:
        """Account for ended ``read`` (its result waited for): count its bytes or its failure and
        drop a failed copy from the index. Returns whether it succeeded."""
        status = read.result()
        if status == 0:
            if read.tier in (Tier.DISK, Tier.REMOTE):
                self.stats.bytes_loaded[TIER_NAMES[read.tier]] += self.checkpoint_bytes
            return True
        self.stats.failures[read.reason if read.reason in self.stats.failures else "error"] += 1
        self.drop(read.key, read.tier)
        return False

    def _failed(self, key: bytes, tier: Tier, reason: str) -> CheckpointRead:
        return CheckpointRead(key, tier, None, status=1, reason=reason)

    # ---- eviction and protection --------------------------------------------------------------
    def _release(self, key: bytes, tier: Tier, slot: int) -> None:
        if tier == Tier.DEVICE:
            self.device.release(slot)
        elif tier == Tier.HOST:
            self.host.release(slot)
        elif tier == Tier.DISK:
            self.disk.remove(key)

    def _make_room(self, tier: Tier, skip=None) -> bool:
        """As :meth:`IndexedCheckpoints._make_room`; a host copy a write still reads is not dropped."""
        return super()._make_room(tier, (lambda e: e.pending > 0) if tier == Tier.HOST else skip)

    def close(self) -> None:
        """Wait for the writes in flight and stop the I/O thread (the remote tier is the pool's)."""
        self.poll(wait=True)
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)


def open_checkpoints(tiers) -> CheckpointStore:
    """The checkpoint store of a pool's ``tiers`` (a :class:`kvtier.cache.tiers.PoolTiers`):
    each budget the config leaves None is the tier's KV budget (a derived budget below one
    checkpoint holds none); the disk tier's files in their own namespace directory; the
    remote tier's values under their own key prefix."""
    c, n = tiers.config, tiers.config.state_checkpoint_bytes
    kv_budget = {"state_device_bytes": c.num_device_pages * tiers.block_bytes,
                 "state_host_bytes": c.host_cache_bytes if tiers.host is not None else 0,
                 "state_disk_bytes": c.disk_cache_bytes if c.disk_cache_dir is not None else 0}
    floor = {"state_device_bytes": n, "state_host_bytes": HostTier.row_bytes(n),
             "state_disk_bytes": DiskTier.file_bytes(n)}
    budget = {}
    for name, derived in kv_budget.items():
        given = getattr(c, name)
        budget[name] = given if given is not None else (derived if derived >= floor[name] else 0)
    disk_dir = None
    if c.disk_cache_dir is not None:
        disk_dir = namespace_dir(c.disk_cache_dir, c.salt, checkpoint_meta(n))
    remote = None
    if tiers.remote is not None:
        remote = RemoteTier(tiers.remote.backend, checkpoint_meta(n), timeout_s=tiers.remote.timeout_s)
    names = {k.split("_")[1]: f"{k} (--{k.replace('_', '-')})" for k in kv_budget}
    return CheckpointStore(n, device_bytes=budget["state_device_bytes"], host_bytes=budget["state_host_bytes"],
                           disk_bytes=budget["state_disk_bytes"], device=tiers.kv_caches[0].device,
                           disk_dir=disk_dir, remote=remote, clock=lambda: tiers.clock(), names=names)


__all__ = ["STATE_LAYOUT_CODE", "CheckpointKind", "CheckpointRead", "CheckpointStore", "checkpoint_meta",
           "open_checkpoints"]
