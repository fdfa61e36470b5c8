"""Host memory, the staging layer: the slots every block passes through on its way down the tiers.

:class:`HostStore` is the host tier as a :class:`~kvtier.cache.tiers.protocol.TierStore` (loads
read it like any other tier) and, beside that, the staging layer the pool's writes use:

* :meth:`HostStore.allocate` / :meth:`HostStore.release`: free slots, evicting the least recently
  used unreferenced copies when none is free (under write-back the caller spills them down
  first, through ``spill``);
* :meth:`HostStore.staging`, :meth:`HostStore.slot`, :meth:`HostStore.copy_out`,
  :meth:`HostStore.fill`: buffers and slot bytes for the copy engine;
* :meth:`HostStore.held`, :meth:`HostStore.touch`, :meth:`HostStore.lock`,
  :meth:`HostStore.unlock`, :meth:`HostStore.index_copies`: the host column of the prefix index.

Everything above this file asks these verbs; none names the host tier or its index column.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch

from kvtier.cache.host_tier import HostTier
from kvtier.cache.prefix_index import PrefixIndex, RemoveResult, Tier
from kvtier.cache.seams import CopyJob
from kvtier.cache.tiers.protocol import Admit, DoneJob, ReadFailure, Stored

NO_SLOT = 1
"""Host write status of a block that found no free slot."""


class HostStore:
    """Host memory slots (:class:`HostTier`); the index (``index()``) maps a block to its slot.

    Reads and writes are synchronous memory copies (their jobs are done at once); a one-block
    read returns a view of the slot itself, no copy.

    Args:
        host: the slots.
        index: returns the pool's prefix index (looked up at each call: it may be replaced); None
            for an owner that indexes its copies itself and uses the slot verbs only.
        evictions: called with the number of copies :meth:`allocate` evicted (a counter).
    """

    tier, name, batch_reads, spills, copies_input, local = Tier.HOST, "host", True, False, True, True

    def __init__(self, host: HostTier, index: Callable[[], PrefixIndex] | None,
                 evictions: Callable[[int], None] = lambda n: None):
        self.host, self._index, self._evictions = host, index, evictions
        self.block_bytes = host.block_bytes

    # ---- TierStore ----------------------------------------------------------------------------
    def capacity_blocks(self) -> int:
        return self.host.num_slots

    def contains(self, hashes: Sequence[bytes]) -> list[bool]:
        return self.held(hashes)

    def read(self, hashes: Sequence[bytes], slots: Sequence[int]) -> tuple[torch.Tensor, CopyJob]:
        if len(slots) != len(hashes) or any(s < 0 for s in slots):
            raise ValueError(f"slots must be one host slot (>= 0) per hash, got {list(slots)} for {len(hashes)} hashes")
        buf = self.host.slot(int(slots[0])) if len(slots) == 1 else self.host.read([int(s) for s in slots])
        return buf, DoneJob([0] * len(hashes))

    def write(self, hashes: Sequence[bytes], blocks: torch.Tensor) -> CopyJob:
        """Copy ``blocks`` into free slots and index them; a block already held is left as it
        is (OK), one that finds no free slot gets :data:`NO_SLOT`."""
        hashes = list(hashes)
        rows = blocks.reshape(-1).view(torch.uint8).view(len(hashes), self.block_bytes) if hashes else blocks
        held = self.held(hashes)
        status = [0 if on else NO_SLOT for on in held]
        todo, slots = [], []
        for i, on in enumerate(held):
            if not on and (slot := self.host.allocate()) is not None:
                todo.append(i)
                slots.append(slot)
        if todo:
            self.host.write(slots, rows[todo])
            for i, slot, inserted in zip(todo, slots, self.index_copies([hashes[i] for i in todo], slots)):
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
        return Admit.YES if self.host.num_free() else Admit.FULL

    def stored(self, block_hash: bytes, status: list[int]) -> Stored:
        ok = status == [0]
        return Stored(indexed=ok, refused=status[:1] == [NO_SLOT], error=not ok and status[:1] != [NO_SLOT])

    # ---- staging: slots ------------------------------------------------------------------------
    def allocate(self, n: int, spill: Callable[[list[tuple[bytes, int]]], None] | None = None,
                 drain: Callable[[], bool] = lambda: False,
                 choose: Callable[[list[tuple[bytes, int]], int], list[tuple[bytes, int]]] | None = None
                 ) -> list[int]:
        """Up to ``n`` free slots, evicting least recently used unreferenced copies as needed
        (fewer when too few can be evicted). The copies to evict are asked of the index once for
        all ``n``: asked one at a time, each question walked past the same locked copies at the
        front of the LRU order (a prefix being loaded from this tier), thousands of times for one
        eviction of 1-token blocks.

        Args:
            n: slots wanted (>= 0).
            spill: called with the ``(hash, slot)`` copies about to be evicted, before their slots
                are reused (write-back copies them down from there); None: they are dropped.
            drain: called when every slot is held by copies still in flight (back-pressure): it
                finishes writes in flight and returns whether any ended.
            choose: picks ``k`` victims from LRU-ordered candidates (an eviction policy that
                protects some copies); None: the ``k`` least recently used.
        """
        slots = self._take_free(n)
        if len(slots) == n:
            return slots
        index = self._index()
        victims = self._victims(index, n - len(slots), choose)
        if not victims and drain():
            slots += self._take_free(n - len(slots))
            victims = self._victims(index, n - len(slots), choose)
        if not victims:
            return slots
        if spill is not None:
            spill(victims)
        results, freed = index.remove_many([h for h, _ in victims], Tier.HOST)
        removed = freed[results == RemoveResult.REMOVED].tolist()
        self._evictions(len(removed))
        return slots + removed

    @staticmethod
    def _victims(index: PrefixIndex, k: int, choose) -> list[tuple[bytes, int]]:
        if k <= 0:
            return []
        if choose is None:
            return index.eviction_candidates(Tier.HOST, k)
        return choose(index.eviction_candidates(Tier.HOST, max(64, k)), k)

    def _take_free(self, n: int) -> list[int]:
        slots: list[int] = []
        while len(slots) < n and (slot := self.host.allocate()) is not None:
            slots.append(slot)
        return slots

    def release(self, slots: Sequence[int]) -> None:
        """Give ``slots`` back (their copies were never indexed, or failed).

        Raises:
            ValueError: a slot out of range or already free.
        """
        for slot in slots:
            self.host.release(int(slot))

    # ---- staging: bytes ------------------------------------------------------------------------
    def staging(self, num_blocks: int) -> torch.Tensor:
        """A ``[num_blocks, block_bytes]`` uint8 buffer for one copy job, pinned when the slots are."""
        return self.host.staging(num_blocks)

    def slot(self, slot: int) -> torch.Tensor:
        """``[block_bytes]`` uint8 view of one slot."""
        return self.host.slot(slot)

    def copy_out(self, slots: Sequence[int]) -> torch.Tensor:
        """A private ``[len(slots), block_bytes]`` uint8 copy of ``slots`` (they may be reused
        at once)."""
        return self.host.read([int(s) for s in slots])

    def fill(self, slots: Sequence[int], blocks: torch.Tensor) -> CopyJob:
        """Copy ``blocks`` (``[len(slots), block_bytes]`` uint8) into ``slots``; returns the copy's
        job (done: the copy is synchronous)."""
        self.host.write([int(s) for s in slots], blocks)
        return DoneJob([0] * len(slots))

    def pinned(self) -> bool:
        """Whether the slots are pinned memory (buffers of the lower tiers are pinned to match)."""
        return self.host.storage is not None and self.host.storage.is_pinned()

    # ---- staging: the host column of the index ---------------------------------------------------
    def held(self, hashes: Sequence[bytes]) -> list[bool]:
        """Whether each block has a host copy."""
        hashes = list(hashes)
        return self._index().held(hashes, Tier.HOST).tolist() if hashes else []

    def touch(self, hashes: Sequence[bytes]) -> None:
        """Mark the host copies of ``hashes`` most recently used."""
        self._index().touch(list(hashes), [Tier.HOST])

    def lock(self, hashes: Sequence[bytes]) -> bool:
        """Reference the host copies of ``hashes`` (not evicted until :meth:`unlock`); False if
        one has none (then none is locked)."""
        return self._index().lock(list(hashes), Tier.HOST)

    def unlock(self, hashes: Sequence[bytes]) -> bool:
        return self._index().unlock(list(hashes), Tier.HOST)

    def index_copies(self, hashes: Sequence[bytes], slots: Sequence[int]) -> list[bool]:
        """Record blocks ``hashes`` as held in ``slots`` (one index call); False for a block
        that had a host copy already (its slot stays the caller's)."""
        if not len(hashes):
            return []
        return self._index().insert_many(list(hashes), Tier.HOST, list(slots)).tolist()
