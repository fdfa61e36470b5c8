"""One pool's share of a disk tier: its own directory, its own budget, its evictable blocks.

A pool that opens its disk tier from ``disk_cache_dir`` stores its blocks in a subdirectory
named after the block layout and a digest of the hash salt (:func:`namespace_dir`). The salt
already binds the model's weights, the compute dtype and the tenant salt, so a block file is
only ever found by a pool whose salt and layout are the ones it was written with: engines of
other models, dtypes, page sizes or tenants that share ``disk_cache_dir`` each see their own
subdirectory, never count each other's files against their budget and can never be served
each other's blocks, whatever hash chain a caller hands them. Files of the pool's own
subdirectory with another layout (impossible unless written by hand) are deleted at start-up.

:class:`DiskBudget` decides when one more block file fits, counting each file once: in the
pool's own subdirectory, its indexed blocks plus its pending writes (whether or not a write
already ended in the tier: one that ended but was not collected yet is not counted twice); in
a tier passed in, the tier's ``used_bytes`` plus the pending writes it does not hold yet. Only
blocks in the pool's index can be evicted; bytes it cannot evict (another pool's blocks in a
tier passed in as ``disk=``) shrink what it can store, and a tier that can store nothing at all
(that, or a full filesystem) is reported at start-up. When the filesystem refuses a write the
budget had room for, the limit drops to the bytes stored then, for the life of the pool: each
later block replaces the least recently used one instead of failing.
"""

from __future__ import annotations

import hashlib
import shutil
import warnings
from collections.abc import Collection
from pathlib import Path

from kvtier.cache.block_layout import layout_name
from kvtier.cache.disk_tier import BlockMeta, DiskStatus, DiskTier
from kvtier.cache.host_tier import HostTier
from kvtier.cache.prefix_index import PrefixIndex, Tier


def namespace_dir(root, salt: bytes, meta: BlockMeta) -> Path:
    """``<root>/<layout_name(meta)>-<salt digest>``.

    Args:
        root: ``disk_cache_dir`` (str or path).
        salt: the pool's block-hash salt (bytes); 16 hex digits of its SHA-256 name it.
        meta: the layout of the pool's blocks.

    Example:
        >>> namespace_dir("/c", b"", BlockMeta(2, 16, 1152, 1, 36864)).name
        'kv-2l-16p-1152r-1d-e3b0c44298fc1c14'
    """
    digest = hashlib.sha256(salt).hexdigest()[:16]
    return Path(root) / f"{layout_name(meta)}-{digest}"


def check_budgets(config, block_bytes: int, disk) -> None:
    """Host and disk budgets of a pool of ``block_bytes``-byte blocks must each hold a block.

    Args:
        config: the pool's :class:`kvtier.cache.eviction.PoolConfig`.
        block_bytes: bytes of one page-first block.
        disk: the disk tier passed to the pool, or None (then ``config.disk_cache_dir`` is
            opened with budget ``config.disk_cache_bytes``).

    Raises:
        ValueError: ``0 < host_cache_bytes`` < one host slot, a disk tier with
            ``host_cache_bytes`` < one block, or ``disk_cache_bytes`` < one block file.
    """
    row = HostTier.row_bytes(block_bytes)
    if 0 < config.host_cache_bytes < row:
        raise ValueError(f"host_cache_bytes={config.host_cache_bytes} holds no block: one host slot takes {row} "
                         "bytes with this model and page_size; expected 0 (no host tier) or >= one slot")
    if (config.disk_cache_dir or disk is not None) and config.host_cache_bytes < block_bytes:
        raise ValueError(f"disk_cache_dir needs host_cache_bytes >= one block ({block_bytes} bytes): blocks "
                         f"reach the disk through host memory; got host_cache_bytes={config.host_cache_bytes}")
    file_bytes = DiskTier.file_bytes(block_bytes)
    if disk is None and config.disk_cache_dir and config.disk_cache_bytes < file_bytes:
        raise ValueError(f"disk_cache_bytes={config.disk_cache_bytes} holds no block: one block file takes "
                         f"{file_bytes} bytes with this model and page_size; expected >= {file_bytes}")


class DiskBudget:
    """Room, eviction and start-up recovery of one pool's blocks in a disk tier.

    Args:
        disk: a :class:`kvtier.cache.disk_tier.DiskTier` or anything with its ``blocks``,
            ``remove``, ``contains``, ``used_bytes`` and ``capacity_bytes`` (the simulator's
            ``SimDisk``).
        index: the pool's prefix index; its disk copies are the blocks this pool may evict.
        meta: layout of this pool's blocks.
        stats: the pool's :class:`kvtier.cache.pool_stats.PoolStats` (evictions, ``disk_capacity_blocks``).
        private: the tier is this pool's own namespace directory (files of another layout
            found there are deleted).
    """

    def __init__(self, disk, index: PrefixIndex, meta: BlockMeta, stats, *, private: bool):
        self.disk, self.index, self.meta, self.stats = disk, index, meta, stats
        self.private = private
        self.file_bytes = DiskTier.file_bytes(meta.payload_bytes)
        self.limit_bytes = disk.capacity_bytes  # lowered when the filesystem refuses a write
        self.next_slot = 0

    def recover(self) -> None:
        """Index this layout's intact blocks already in the tier (after a restart); report, as a
        warning and ``stats.disk_capacity_blocks``, how many blocks the tier can hold for us."""
        for h, meta in self.disk.blocks():
            if meta == self.meta:
                self.add(h)
            elif self.private:
                self.disk.remove(h)
        self.stats.disk_capacity_blocks = blocks = self.capacity_blocks()
        if blocks == 0:
            warnings.warn(f"the disk tier can store no block of {self.file_bytes} bytes: {self._why_no_room()}; "
                          "every disk store will be refused (counted in stats.stores_refused['disk'])",
                          RuntimeWarning, stacklevel=4)

    def add(self, h: bytes) -> bool:
        """Index block ``h`` as stored in the tier; False if it was indexed already."""
        if self.index.insert(h, Tier.DISK, self.next_slot):
            self.next_slot += 1
            return True
        return False

    def own_bytes(self) -> int:
        """File bytes of the blocks this pool indexed (the ones it may evict)."""
        return self.index.num_copies(Tier.DISK) * self.file_bytes

    def capacity_blocks(self) -> int:
        """Blocks this pool could hold now if it evicted all of its own: the budget less the
        bytes it cannot evict, bounded by the free space of the tier's filesystem."""
        room = self.limit_bytes - max(0, self.disk.used_bytes - self.own_bytes())
        free = _free_bytes(self.disk)
        if free is not None:
            room = min(room, free + self.own_bytes())
        return max(0, room // self.file_bytes)

    def _why_no_room(self) -> str:
        foreign = max(0, self.disk.used_bytes - self.own_bytes())
        free = _free_bytes(self.disk)
        if free is not None and free + self.own_bytes() < self.file_bytes:
            return f"its filesystem has {free} bytes free"
        return f"of its budget of {self.limit_bytes} bytes, {foreign} are taken by blocks this pool cannot evict"

    def room(self, pending: Collection[bytes]) -> bool:
        """Evict least recently used blocks of this pool until one more file fits beside the
        ``pending`` writes (hashes of disk writes not collected yet, each once); False if it
        cannot. O(1) for a private tier, O(len(pending)) for a shared one."""
        while self._committed(pending) + self.file_bytes > self.limit_bytes:
            if not self.evict(1):
                return False
        return True

    def _committed(self, pending: Collection[bytes]) -> int:
        """Bytes the tier holds or will hold once ``pending`` writes end, each file counted once.

        In a private tier every file is an indexed block of this pool or a pending write: the
        count is exact whenever a write ends. A tier passed in may hold others' files:
        ``used_bytes`` (which includes writes that ended but were not collected) plus the
        pending writes it does not hold yet, read in that order (a write ending in between is
        counted twice for this call, never missed)."""
        if self.private:
            return self.own_bytes() + self.file_bytes * len(pending)
        in_flight = self.file_bytes * sum(1 for h in pending if not self.disk.contains(h))
        return self.disk.used_bytes + in_flight

    def evict(self, n: int) -> bool:
        """Drop up to ``n`` least recently used unreferenced blocks; False if none could go."""
        victims = self.index.eviction_candidates(Tier.DISK, n)
        for h, _ in victims:
            self.index.remove(h, Tier.DISK)
            self.disk.remove(h)
            self.stats.evictions["disk"] += 1
        return bool(victims)

    def refused(self, status: int) -> None:
        """A write ended FULL. If the budget had room, the filesystem is full: keep to the bytes
        stored now from here on (each later block replaces the least recently used one, rather
        than failing and losing valid blocks); else (a tier shared with other writers) make room
        for later writes."""
        assert status == DiskStatus.FULL
        used = self.disk.used_bytes
        if used + self.file_bytes <= self.disk.capacity_bytes:
            self.limit_bytes = min(self.limit_bytes, used)
        else:
            self.evict(2)


def _free_bytes(disk) -> int | None:
    """Free bytes of the filesystem holding ``disk``'s directory; None for a tier without one."""
    directory = getattr(disk, "directory", None)
    if directory is None:
        return None
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None
