"""Host-memory tier: fixed-size slots holding page-first KV blocks.

One slot holds one block: page ``p`` of every layer, back to back (``block_bytes`` bytes).
The storage is pinned when a CUDA device is present (faster, asynchronous device copies),
plain memory otherwise. Blocks of 4096 bytes or more start each slot on a 4096-byte page
(rows padded to whole pages), so disk writes from a slot and reads into one go straight through
O_DIRECT without a copy; smaller blocks are packed (the disk tier copies them through an aligned
buffer), so padding never more than doubles a slot.
"""

from __future__ import annotations

import torch

from kvtier.cache.disk_tier import DISK_ALIGN, aligned_empty


class HostTier:
    """``num_slots`` block slots in one ``[num_slots, block_bytes]`` uint8 tensor.

    For ``block_bytes >= 4096`` the tensor is a view of page-aligned rows of ``block_bytes``
    rounded up to 4096 (contiguous only when ``block_bytes`` is a multiple of 4096); each slot
    is contiguous.

    Args:
        capacity_bytes: memory budget, padding included: ``capacity_bytes // row_bytes`` slots
            are made, where ``row_bytes`` is ``block_bytes`` (rounded up to 4096 when it is at
            least 4096).
        block_bytes: bytes of one page-first block (``num_layers * page_size * row * element_size``).
        pin: pin the storage (default: when CUDA is available).
        storage: allocate the slots' memory (False: slot bookkeeping only, ``storage`` is None;
            for a process that decides which slot holds what while another holds the bytes).

    Raises:
        ValueError: ``block_bytes <= 0`` or a negative capacity.
    """

    def __init__(self, capacity_bytes: int, block_bytes: int, pin: bool | None = None, storage: bool = True):
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be > 0, got {block_bytes}")
        if capacity_bytes < 0:
            raise ValueError(f"host_cache_bytes must be >= 0, got {capacity_bytes}")
        self.block_bytes = block_bytes
        row = self.row_bytes(block_bytes)
        self.num_slots = capacity_bytes // row
        self.storage: torch.Tensor | None = None
        if storage:
            pin = torch.cuda.is_available() if pin is None else pin
            try:
                rows = aligned_empty(self.num_slots * row, pin_memory=pin).view(self.num_slots, row)
            except RuntimeError as e:  # out of memory: name the budget, not torch's allocator
                raise ValueError(f"host_cache_bytes={capacity_bytes} cannot be allocated: {e}") from None
            self.storage = rows[:, :block_bytes]
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * self.num_slots

    @staticmethod
    def row_bytes(block_bytes: int) -> int:
        """Bytes one slot takes in the budget: ``block_bytes``, rounded up to 4096 when it is at least 4096."""
        return -(-block_bytes // DISK_ALIGN) * DISK_ALIGN if block_bytes >= DISK_ALIGN else block_bytes

    def allocate(self) -> int | None:
        """A free slot id, or None when every slot is taken."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._is_free[slot] = 0
        return slot

    def num_free(self) -> int:
        """Slots not allocated now."""
        return len(self._free)

    def release(self, slot: int) -> None:
        """Return ``slot`` to the free list.

        Raises:
            ValueError: the slot is out of range or already free.
        """
        if not 0 <= slot < self.num_slots or self._is_free[slot]:
            raise ValueError(f"host slot {slot} is not an allocated slot of [0, {self.num_slots})")
        self._is_free[slot] = 1
        self._free.append(slot)

    def slot(self, slot: int) -> torch.Tensor:
        """[block_bytes] uint8 view of one slot."""
        return self.storage[slot]

    def staging(self, num_blocks: int) -> torch.Tensor:
        """A [num_blocks, block_bytes] uint8 buffer for one copy job of several blocks, pinned
        when this tier is (so a copy to or from a GPU stays asynchronous)."""
        return torch.empty((num_blocks, self.block_bytes), dtype=torch.uint8, pin_memory=self.storage.is_pinned())

    def read(self, slots: list[int]) -> torch.Tensor:
        """The blocks in ``slots``, gathered into a :meth:`staging` buffer ([len(slots),
        block_bytes] uint8)."""
        out = self.staging(len(slots))
        torch.index_select(self.storage, 0, torch.tensor(slots, dtype=torch.long), out=out)
        return out

    def write(self, slots: list[int], blocks: torch.Tensor) -> None:
        """Copy ``blocks`` ([len(slots), block_bytes] uint8) into ``slots``."""
        self.storage[torch.tensor(slots, dtype=torch.long)] = blocks
