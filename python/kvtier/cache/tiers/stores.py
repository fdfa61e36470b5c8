"""The three :class:`~kvtier.cache.tiers.protocol.TierStore` s: host memory, disk, remote store.

Each wraps the tier's own class (:class:`kvtier.cache.host_tier.HostTier`,
:class:`kvtier.cache.seams.DiskStore`, :class:`kvtier.cache.remote.RemoteTier`) and speaks the
protocol: the pool's loads and writes call these and never branch on which tier they talk to.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch

from kvtier.cache.disk_budget import DiskBudget
from kvtier.cache.disk_tier import BlockMeta, DiskStatus, DiskTier, aligned_empty
from kvtier.cache.host_tier import HostTier
from kvtier.cache.prefix_index import PrefixIndex, RemoveResult, Tier
from kvtier.cache.remote import RemoteStatus, RemoteTier
from kvtier.cache.seams import CopyEngine, CopyJob, DiskStore
from kvtier.cache.tiers.protocol import Admit, DoneJob, ReadFailure, Stored

NO_SLOT = 1
"""Host write status of a block that found no free slot."""


class HostStore:
    """Host memory slots (:class:`HostTier`); the index (``index()``) maps a block to its slot.

    Reads and writes are synchronous memory copies (their jobs are done at once); a one-block
    read returns a view of the slot itself, no copy.
    """

    tier, name, batch_reads, spills, copies_input = Tier.HOST, "host", True, False, True

    def __init__(self, host: HostTier, index: Callable[[], PrefixIndex]):
        self.host, self._index = host, index

    def capacity_blocks(self) -> int:
        return self.host.num_slots

    def contains(self, hashes: Sequence[bytes]) -> list[bool]:
        return self._index().held(list(hashes), Tier.HOST).tolist()

    def read(self, hashes: Sequence[bytes], slots: Sequence[int]) -> tuple[torch.Tensor, CopyJob]:
        if len(slots) != len(hashes) or any(s < 0 for s in slots):
            raise ValueError(f"slots must be one host slot (>= 0) per hash, got {list(slots)} for {len(hashes)} hashes")
        buf = self.host.slot(int(slots[0])) if len(slots) == 1 else self.host.read([int(s) for s in slots])
        return buf, DoneJob([0] * len(hashes))

    def write(self, hashes: Sequence[bytes], blocks: torch.Tensor) -> CopyJob:
        """Copy ``blocks`` into free slots and index them; a block already held is left as it
        is (OK), one that finds no free slot gets :data:`NO_SLOT`."""
        index, hashes = self._index(), list(hashes)
        rows = blocks.reshape(-1).view(torch.uint8).view(len(hashes), self.host.block_bytes) if hashes else blocks
        held = index.held(hashes, Tier.HOST).tolist() if hashes else []
        status = [0 if on else NO_SLOT for on in held]
        todo, slots = [], []
        for i, on in enumerate(held):
            if not on and (slot := self.host.allocate()) is not None:
                todo.append(i)
                slots.append(slot)
        if todo:
            self.host.write(slots, rows[todo])
            for i, slot, inserted in zip(todo, slots, index.insert_many([hashes[i] for i in todo], Tier.HOST,
                                                                        slots).tolist()):
                status[i] = 0
                if not inserted:  # the same hash twice in one call: the first copy is the one kept
                    self.host.release(slot)
        return DoneJob(status)

    def evict(self, hashes: Sequence[bytes]) -> int:
        results, freed = self._index().remove_many(list(hashes), Tier.HOST)
        removed = freed[results == RemoveResult.REMOVED].tolist()
        for slot in removed:
            self.host.release(slot)
        return len(removed)

    def failed_read(self, status: int) -> ReadFailure:
        return ReadFailure(drop=False, error=True)  # the slot is intact: a copy error, kept

    def admit(self, pending: Collection[bytes]) -> Admit:
        return Admit.YES if self.host._free else Admit.FULL

    def stored(self, block_hash: bytes, status: list[int]) -> Stored:
        ok = status == [0]
        return Stored(indexed=ok, refused=status[:1] == [NO_SLOT], error=not ok and status[:1] != [NO_SLOT])


class DiskFiles:
    """Block files of a :class:`DiskStore`, read and written on the copy engine's disk worker
    threads (``copy_engine()``: looked up at each call, the pool's may be replaced), within the
    pool's :class:`kvtier.cache.disk_budget.DiskBudget` (``budget``; None: the whole tier's
    capacity, nothing indexed by :meth:`stored`)."""

    tier, name, batch_reads, spills, copies_input = Tier.DISK, "disk", False, True, False

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
        return buf, self._engine().disk_read(self.disk, list(hashes), self.meta, buf)

    def write(self, hashes: Sequence[bytes], blocks: torch.Tensor) -> CopyJob:
        return self._engine().disk_write(self.disk, list(hashes), self.meta, blocks)

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


class RemoteStore:
    """A shared store (:class:`RemoteTier`): lossy by contract, its misses are counted in
    ``remote.stats``, not as copy errors."""

    tier, name, batch_reads, spills, copies_input = Tier.REMOTE, "remote", False, False, True

    def __init__(self, remote: RemoteTier, index: Callable[[], PrefixIndex] | None = None,
                 pin: Callable[[], bool] = lambda: False):
        self.remote, self._index, self._pin = remote, index, pin

    def capacity_blocks(self) -> int:
        return -1  # the store's own (shared, evicting) budget: not known here

    def contains(self, hashes: Sequence[bytes]) -> list[bool]:
        return self.remote.exists(list(hashes))

    def read(self, hashes: Sequence[bytes], slots: Sequence[int]) -> tuple[torch.Tensor, CopyJob]:
        buf = aligned_empty(len(hashes) * self.remote.meta.payload_bytes, pin_memory=self._pin())
        return buf, self.remote.get(list(hashes), buf)

    def write(self, hashes: Sequence[bytes], blocks: torch.Tensor) -> CopyJob:
        return self.remote.put(list(hashes), blocks)

    def evict(self, hashes: Sequence[bytes]) -> int:
        return 0  # a shared store evicts on its own; other workers may still read these

    def failed_read(self, status: int) -> ReadFailure:
        # UNAVAILABLE was never asked (the store is left alone for a while): the block may be there
        return ReadFailure(drop=status != RemoteStatus.UNAVAILABLE, error=False)

    def admit(self, pending: Collection[bytes]) -> Admit:
        return Admit.YES if self.remote.available() else Admit.SKIP

    def stored(self, block_hash: bytes, status: list[int]) -> Stored:
        # a failed remote write is counted in remote.stats, not as a copy error
        indexed = status == [0] and self._index is not None and self._index().insert(block_hash, Tier.REMOTE, 0)
        return Stored(indexed=bool(indexed), refused=False, error=False)
