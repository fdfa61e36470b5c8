"""Host-memory tier: fixed-size slots holding page-first KV blocks.

One slot holds one block: page ``p`` of every layer, back to back (``block_bytes`` bytes).
The storage is pinned when a CUDA device is present (faster, asynchronous device copies),
plain memory otherwise. Every slot starts on a 4096-byte page (rows are padded to whole pages),
so disk writes from a slot and reads into one go straight through O_DIRECT without a copy.
"""

from __future__ import annotations

import torch

from kvtier.cache.disk_tier import DISK_ALIGN, aligned_empty


class HostTier:
    """``num_slots`` block slots in one ``[num_slots, block_bytes]`` uint8 tensor.

    The tensor is a view of page-aligned rows of ``block_bytes`` rounded up to 4096 (so it is
    contiguous only when ``block_bytes`` is a multiple of 4096); each slot is contiguous.

    Args:
        capacity_bytes: memory budget; ``capacity_bytes // block_bytes`` slots are made (the
            page padding, under 4 KiB a slot, is not counted).
        block_bytes: bytes of one page-first block (``num_layers * page_size * row * element_size``).
        pin: pin the storage (default: when CUDA is available).

    Raises:
        ValueError: ``block_bytes <= 0`` or a negative capacity.
    """

    def __init__(self, capacity_bytes: int, block_bytes: int, pin: bool | None = None):
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be > 0, got {block_bytes}")
        if capacity_bytes < 0:
            raise ValueError(f"host_cache_bytes must be >= 0, got {capacity_bytes}")
        self.block_bytes = block_bytes
        self.num_slots = capacity_bytes // block_bytes
        pin = torch.cuda.is_available() if pin is None else pin
        row = -(-block_bytes // DISK_ALIGN) * DISK_ALIGN
        rows = aligned_empty(self.num_slots * row, pin_memory=pin).view(self.num_slots, row)
        self.storage = rows[:, :block_bytes]
        self._free = list(range(self.num_slots - 1, -1, -1))

    def allocate(self) -> int | None:
        """A free slot id, or None when every slot is taken."""
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        """Return ``slot`` to the free list.

        Raises:
            ValueError: the slot is out of range or already free.
        """
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"host slot {slot} is not an allocated slot of [0, {self.num_slots})")
        self._free.append(slot)

    def slot(self, slot: int) -> torch.Tensor:
        """[block_bytes] uint8 view of one slot."""
        return self.storage[slot]
