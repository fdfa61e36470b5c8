"""The disk tier as a :class:`~kvtier.cache.tiers.protocol.TierStore`: block files of a
:class:`kvtier.cache.seams.DiskStore`, read and written by I/O jobs (:class:`DiskJob`) that the
copy engine runs on workers of its own, within the pool's
:class:`~kvtier.cache.tiers.disk_budget.DiskBudget`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence
from dataclasses import astuple

import torch

from kvtier.cache.disk_tier import BlockMeta, DiskStatus, DiskTier, aligned_empty
from kvtier.cache.prefix_index import Tier
from kvtier.cache.seams import CopyEngine, CopyJob, DiskStore
from kvtier.cache.tiers.disk_budget import DiskBudget
from kvtier.cache.tiers.protocol import Admit, ReadFailure, Stored


@functools.lru_cache(maxsize=64)
def _meta_tuple(meta: BlockMeta) -> tuple:
    """``astuple(meta)`` of a (frozen, hashable) ``BlockMeta``, once per layout, not per job."""
    return astuple(meta)


class DiskJob:
    """The reads or writes of blocks ``hashes`` in one :class:`DiskStore`, as an
    :class:`kvtier.cache.seams.IOJob` a copy engine runs (``CopyEngine.run_io``).

    Args:
        disk: the store; :meth:`submit_native` needs one backed by the native tier
            (:class:`kvtier.cache.disk_tier.DiskTier`), :meth:`run` takes any.
        hashes: 16-byte block hashes.
        meta: the blocks' layout (``meta.payload_bytes`` bytes each).
        staging: contiguous CPU buffer of at least ``len(hashes) * meta.payload_bytes`` bytes:
            block ``i`` at byte ``i * meta.payload_bytes``, read from (``write``) or into.
        write: store the blocks (True) or read them (False).

    Raises:
        ValueError: a staging buffer that is not a contiguous CPU tensor or is too small.
    """

    __slots__ = ("disk", "hashes", "meta", "num_blocks", "staging", "write")

    def __init__(self, disk: DiskStore, hashes: Sequence[bytes], meta: BlockMeta, staging: torch.Tensor, *,
                 write: bool):
        need = len(hashes) * meta.payload_bytes
        if staging.device.type != "cpu" or not staging.is_contiguous() or staging.numel() * staging.element_size() < need:
            raise ValueError(f"staging must be a contiguous CPU tensor of at least {need} bytes")
        self.disk, self.hashes, self.meta, self.staging, self.write = disk, list(hashes), meta, staging, write
        self.num_blocks = len(self.hashes)

    def run(self) -> list[int]:
        """The reads or writes, one after another on this thread; a
        :class:`kvtier.cache.disk_tier.DiskStatus` per block."""
        n, flat = self.meta.payload_bytes, self.staging.reshape(-1).view(torch.uint8)
        op = self.disk.write if self.write else self.disk.read
        return [int(op(h, self.meta, flat[i * n:(i + 1) * n])) for i, h in enumerate(self.hashes)]

    def submit_native(self, workers) -> int:
        """Queue the job on native workers (``kvtier._C.CopyEngine``): the tier's checked,
        O_DIRECT reads and writes without the GIL."""
        return workers.submit_disk(self.disk.native, self.hashes, _meta_tuple(self.meta), self.staging.data_ptr(),
                                   self.write)


class DiskFiles:
    """Block files of a :class:`DiskStore`, read and written by :class:`DiskJob` s on the copy
    engine's I/O workers (``copy_engine()``: looked up at each call, the pool's may be replaced),
    within the pool's :class:`kvtier.cache.tiers.disk_budget.DiskBudget` (``budget``; None: the whole
    tier's capacity, nothing indexed by :meth:`stored`)."""

    tier, name, batch_reads, spills, copies_input, local = Tier.DISK, "disk", False, True, False, True

    def __init__(self, disk: DiskStore, meta: BlockMeta, copy_engine: Callable[[], CopyEngine],
                 pin: Callable[[], bool] = lambda: False, budget: DiskBudget | None = None):
        self.disk, self.meta, self._engine, self._pin, self.budget = disk, meta, copy_engine, pin, budget

    def capacity_blocks(self) -> int:
        if self.budget is not None:
            return self.budget.capacity_blocks()
        return self.disk.capacity_bytes // DiskTier.file_bytes(self.meta.payload_bytes)

    def contains(self, hashes: Sequence[bytes]) -> list[bool]:
        return [self.disk.contains(h) for h in hashes]

    def read(self, hashes: Sequence[bytes], slots: Sequence[int]) -> tuple[torch.Tensor, CopyJob]:
        buf = aligned_empty(len(hashes) * self.meta.payload_bytes, pin_memory=self._pin())
        return buf, self.read_into(hashes, buf)

    def read_into(self, hashes: Sequence[bytes], out: torch.Tensor) -> CopyJob:
        """Start reading blocks ``hashes`` into ``out`` (contiguous CPU, at least
        ``len(hashes) * payload_bytes`` bytes; 4096-byte aligned skips a bounce copy), back to
        back; one :class:`DiskStatus` per block.

        Raises:
            ValueError: an ``out`` that is not a contiguous CPU tensor or is too small.
        """
        return self._engine().run_io(DiskJob(self.disk, hashes, self.meta, out, write=False))

    def write(self, hashes: Sequence[bytes], blocks: torch.Tensor) -> CopyJob:
        return self._engine().run_io(DiskJob(self.disk, hashes, self.meta, blocks, write=True))

    def evict(self, hashes: Sequence[bytes]) -> int:
        return sum(bool(self.disk.remove(h)) for h in hashes)

    def failed_read(self, status: int) -> ReadFailure:
        # a corrupt file was deleted by the read; a missing one is gone: either way not there
        return ReadFailure(drop=status in (DiskStatus.CORRUPT, DiskStatus.MISSING), error=True)

    def admit(self, pending: Collection[bytes]) -> Admit:
        if self.budget is None:
            return Admit.YES
        return Admit.YES if self.budget.room(pending) else Admit.FULL

    def stored(self, block_hash: bytes, status: list[int]) -> Stored:
        ok = status == [0]
        if ok:
            return Stored(indexed=self.budget is not None and self.budget.add(block_hash), refused=False, error=False)
        full = status[:1] == [DiskStatus.FULL]
        if full and self.budget is not None:
            self.budget.refused(DiskStatus.FULL)
        return Stored(indexed=False, refused=full, error=True)  # a write the filesystem refused is an error too
