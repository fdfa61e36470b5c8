"""Prefix index of the tiered KV pool (native, ``kvtier._C.PrefixIndex``).

Keyed by the 128-bit chained block hash (:mod:`kvtier.cache.block_hash`; at 1e9 distinct
blocks the collision probability is ~1.5e-21). For each block it records the slot of its copy
in each tier (device page id, host slot, disk slot, remote key id; -1 = no copy), keeps
per-tier reference counts (a referenced copy is never removed, evicted or overwritten) and a
per-tier LRU order, and emits an event for every copy added or removed. All methods are
thread-safe and release the GIL while the index works.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvtier import _C


class Tier(enum.IntEnum):
    """Storage tiers, fastest first."""

    DEVICE = 0
    HOST = 1
    DISK = 2
    REMOTE = 3


ALL_TIERS = (1 << _C.NUM_TIERS) - 1


class RemoveResult(enum.IntEnum):
    REMOVED = 0
    ABSENT = 1
    LOCKED = 2


class Event(NamedTuple):
    """A copy of block ``hash`` was ``added`` (True) or removed (False) at ``slot`` of ``tier``."""

    added: bool
    tier: Tier
    hash: bytes
    slot: int


class PrefixIndex:
    """Which tiers hold each KV block, with locks, LRU order and events.

    Args:
        max_events: undrained events kept at most; older ones are dropped and counted.

    Example:
        >>> from kvtier.cache import block_hashes
        >>> idx = PrefixIndex()
        >>> hs = block_hashes(list(range(64)), 16)
        >>> idx.insert(hs[0], Tier.DEVICE, 7)
        True
        >>> idx.match(hs).tolist()          # one block matched, on device page 7
        [[7, -1, -1, -1]]
    """

    def __init__(self, max_events: int = 1 << 16):
        self._native = _C.PrefixIndex(max_events)

    def insert(self, block_hash: bytes, tier: Tier, slot: int) -> bool:
        """Record a copy at ``slot`` (>= 0) of ``tier``; False (no change) if that tier already has one.

        Raises:
            ValueError: a hash that is not 16 bytes, a tier outside [0, 4), or slot < 0.
        """
        return self._native.insert(block_hash, int(tier), slot)

    def remove(self, block_hash: bytes, tier: Tier) -> tuple[RemoveResult, int]:
        """Drop the copy in ``tier``: (REMOVED, its slot), (ABSENT, -1) or (LOCKED, -1) if referenced."""
        res, slot = self._native.remove(block_hash, int(tier))
        return RemoveResult(res), slot

    def insert_many(self, hashes: Sequence[bytes], tier: Tier, slots: Sequence[int] | np.ndarray) -> np.ndarray:
        """:meth:`insert` of each block at its slot, in one call.

        Returns:
            [len(hashes)] bool array: which were recorded (False: the tier had a copy already).

        Raises:
            ValueError: as :meth:`insert` (nothing is inserted then), or ``slots`` not 1-D with
                one slot per hash.
        """
        return self._native.insert_many(hashes, int(tier), slots)

    def remove_many(self, hashes: Sequence[bytes], tier: Tier) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`remove` of each block's copy in ``tier``, in one call.

        Returns:
            ``(results, slots)``: [n] int8 :class:`RemoveResult` values and [n] int64 slots
            removed (-1 where nothing was).
        """
        return self._native.remove_many(hashes, int(tier))

    def held(self, hashes: Sequence[bytes], tier: Tier) -> np.ndarray:
        """[len(hashes)] bool array: whether each block has a copy in ``tier`` (each block on
        its own, unlike :meth:`match`, which stops at the first missing one)."""
        return self._native.held_in(hashes, int(tier))

    def match(self, hashes: Sequence[bytes], tiers: Sequence[Tier] | None = None) -> np.ndarray:
        """Slots of the longest prefix of ``hashes`` held in any of ``tiers`` (default: all).

        Returns:
            [num_matched, 4] int64 array; row i holds block i's slot per tier (-1 = no copy).
        """
        mask = ALL_TIERS if tiers is None else sum(1 << int(t) for t in tiers)
        return self._native.match(hashes, mask)

    def touch(self, hashes: Sequence[bytes], tiers: Sequence[Tier] | None = None) -> None:
        """Make these blocks the most recently used in every tier of ``tiers`` (default: all)
        holding them."""
        self._native.touch(hashes, ALL_TIERS if tiers is None else sum(1 << int(t) for t in tiers))

    def lock(self, hashes: Sequence[bytes], tier: Tier) -> bool:
        """Reference each block's copy in ``tier``; all-or-nothing (False if one has no copy there)."""
        return self._native.lock(hashes, int(tier))

    def unlock(self, hashes: Sequence[bytes], tier: Tier) -> bool:
        """Drop one reference each; all-or-nothing (False if one is absent or unreferenced)."""
        return self._native.unlock(hashes, int(tier))

    def eviction_candidates(self, tier: Tier, max_n: int) -> list[tuple[bytes, int]]:
        """Up to ``max_n`` unreferenced (hash, slot) copies in ``tier``, least recently used first."""
        return self._native.eviction_candidates(int(tier), max_n)

    def drain_events(self, max_n: int | None = None) -> list[Event]:
        """Remove and return the oldest events (all when ``max_n`` is None)."""
        raw = self._native.drain_events() if max_n is None else self._native.drain_events(max_n)
        return [Event(kind == 0, Tier(tier), h, slot) for kind, tier, h, slot in raw]

    @property
    def dropped_events(self) -> int:
        return self._native.dropped_events()

    def num_blocks(self) -> int:
        """Blocks with a copy in at least one tier."""
        return self._native.num_blocks()

    def num_copies(self, tier: Tier) -> int:
        return self._native.num_copies(int(tier))

    def ref_count(self, block_hash: bytes, tier: Tier) -> int:
        return self._native.ref_count(block_hash, int(tier))

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken internal invariant (for tests)."""
        problem = self._native.check_invariants()
        if problem:
            raise AssertionError(problem)
