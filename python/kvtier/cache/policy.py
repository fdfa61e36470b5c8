"""Eviction policies of the pool (``PoolConfig.cache_policy``) and the tool-wait estimate."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from kvtier.options import check_real


class LRUPolicy:
    """Evict the least recently freed device page first (the pool's free-page order)."""

    name = "lru"

    def pick_page(self, free_pages, page_hash, now: float) -> int:
        """The free page to reuse next; ``free_pages`` is in LRU order (front = oldest)."""
        return next(iter(free_pages))

    def tool_wait(self, session_id, hashes: list[bytes], expected_wait_s: float, now: float) -> None:
        """A session starts waiting on a tool (no effect under LRU)."""

    def tool_return(self, session_id) -> None:
        """The session's tool returned (no effect under LRU)."""

    def due_prefetches(self, now: float) -> list[list[bytes]]:
        """Block chains to load back onto the device now (none under LRU)."""
        return []


@dataclass
class _Waiting:
    hashes: list[bytes]
    keep_until: float
    prefetch_at: float
    prefetched: bool = False


class ToolAwarePolicy(LRUPolicy):
    """Keep a tool-waiting session's device blocks for a TTL, then demote, then prefetch back.

    While a session waits on a tool expected to take ``w`` seconds, its device blocks are
    skipped by eviction for ``ttl = min(ttl_fraction * w, max_ttl_s)`` (short waits: the
    session is back before the pages are needed elsewhere). After the TTL the blocks are
    ordinary LRU victims: they are demoted to the lower tiers (write-through copied them
    already; write-back copies them on eviction). ``prefetch_lead_s`` before the expected
    return, blocks no longer on the device are loaded back, so the next turn finds them there.
    If every free page is protected, the oldest is taken anyway (a TTL never blocks progress).

    Args:
        ttl_fraction: share of the expected wait during which blocks stay on the device.
        max_ttl_s: upper bound of the TTL in seconds.
        prefetch_lead_s: how long before the expected return to start loading back.
    """

    name = "tool-aware"

    def __init__(self, ttl_fraction: float = 0.5, max_ttl_s: float = 30.0, prefetch_lead_s: float = 2.0):
        if not (0 <= ttl_fraction and 0 <= max_ttl_s and 0 <= prefetch_lead_s):
            raise ValueError("ttl_fraction, max_ttl_s and prefetch_lead_s must be >= 0")
        self.ttl_fraction, self.max_ttl_s, self.prefetch_lead_s = ttl_fraction, max_ttl_s, prefetch_lead_s
        self.sessions: dict[object, _Waiting] = {}
        # A block is protected until the latest TTL of the waiting sessions that hold it; both
        # maps are kept up to date per session, so a tool event costs O(that session's blocks).
        self._protected: dict[bytes, float] = {}
        self._holders: dict[bytes, dict[object, float]] = {}  # block -> {waiting session: its TTL end}

    def tool_wait(self, session_id, hashes, expected_wait_s, now):
        check_real("expected_wait_s", expected_wait_s, min_value=0.0)
        self.tool_return(session_id)  # a new wait replaces the old one
        ttl = min(self.ttl_fraction * expected_wait_s, self.max_ttl_s)
        w = _Waiting(list(hashes), now + ttl, now + max(expected_wait_s - self.prefetch_lead_s, 0.0))
        self.sessions[session_id] = w
        for h in w.hashes:
            self._holders.setdefault(h, {})[session_id] = w.keep_until
            self._protected[h] = max(self._protected.get(h, 0.0), w.keep_until)

    def tool_return(self, session_id):
        w = self.sessions.pop(session_id, None)
        if w is None:
            return
        for h in w.hashes:
            holders = self._holders.get(h)
            if holders is None or holders.pop(session_id, None) is None:
                continue  # a block listed twice
            if holders:
                self._protected[h] = max(0.0, *holders.values())
            else:
                del self._holders[h]
                self._protected.pop(h, None)

    def pick_page(self, free_pages, page_hash, now):
        for page in free_pages:
            h = page_hash[page]
            if h is None or self._protected.get(h, 0.0) <= now:
                return page
        return next(iter(free_pages))

    def due_prefetches(self, now):
        due = []
        for w in self.sessions.values():
            if not w.prefetched and now >= w.prefetch_at:
                w.prefetched = True
                due.append(w.hashes)
        return due


def make_policy(name: str) -> LRUPolicy:
    """The eviction policy called ``name`` (see :data:`CACHE_POLICIES`)."""
    return {"lru": LRUPolicy, "tool-aware": ToolAwarePolicy}[name]()


class ToolWaitEstimate:
    """Median of the last ``window`` observed tool waits (seconds)."""

    def __init__(self, initial_s: float, window: int = 64):
        self.initial_s = initial_s
        self.observed: deque[float] = deque(maxlen=window)

    def value(self) -> float:
        return statistics.median(self.observed) if self.observed else self.initial_s
