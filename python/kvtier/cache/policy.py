"""Pool configuration and the names of its policies."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from kvtier.cache.remote import check_remote_url
from kvtier.options import check_bool, check_choice, check_int, check_path, check_real

WRITE_POLICIES = ("write-through", "write-back")
CACHE_POLICIES = ("lru", "tool-aware")


@dataclass(frozen=True)
class PoolConfig:
    """Sizes and policies of a :class:`kvtier.cache.pool.KVPool`.

    Attributes:
        page_size: tokens per page/block (power of two).
        num_device_pages: pages in each layer's device pool.
        host_cache_bytes: host tier budget in bytes (0 = no host tier).
        disk_cache_dir: directory of the disk tier (None = no disk tier).
        disk_cache_bytes: disk tier budget in bytes.
        cache_policy: eviction policy: ``lru`` or ``tool-aware`` (:class:`ToolAwarePolicy`).
        write_policy: ``write-through`` (copy each full block down at once) or ``write-back``
            (copy down only when evicted).
        enable_prefix_caching: reuse blocks by hash at all.
        salt: tenant salt of the block hashes.
        copy_threads: copy-engine worker threads.
        remote_cache_url: the shared remote tier's store (:mod:`kvtier.cache.remote`):
            ``redis://HOST:PORT`` or ``mooncake://HOST:PORT[?...]``; None = no remote tier.
            Needs a host tier (blocks are written through to it from host memory).
        remote_timeout_s: seconds a remote read, write or lookup may take before it counts as
            a miss (and the store is left alone for a while).

    Sizes that depend on the model (host or disk budgets smaller than one block) are checked
    by :class:`kvtier.cache.pool.KVPool`, which knows the block size.

    Raises:
        ValueError: a field of the wrong type (a bool is not an int, a str not a size) or out
            of range, naming it; ``disk_cache_dir`` with ``disk_cache_bytes == 0``.
    """

    page_size: int = 16
    num_device_pages: int = 1024
    host_cache_bytes: int = 0
    disk_cache_dir: str | None = None
    disk_cache_bytes: int = 0
    cache_policy: str = "lru"
    write_policy: str = "write-through"
    enable_prefix_caching: bool = True
    salt: bytes = b""
    copy_threads: int = 2
    remote_cache_url: str | None = None
    remote_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        ps = check_int("page_size", self.page_size, min_value=1)
        if ps & (ps - 1):
            raise ValueError(f"page_size must be a power of two, got {ps!r}")
        check_int("num_device_pages", self.num_device_pages, min_value=1)
        check_int("host_cache_bytes", self.host_cache_bytes, min_value=0)
        check_path("disk_cache_dir", self.disk_cache_dir)
        check_int("disk_cache_bytes", self.disk_cache_bytes, min_value=0)
        if self.disk_cache_dir is not None and self.disk_cache_bytes == 0:
            raise ValueError(f"disk_cache_dir={self.disk_cache_dir!r} needs disk_cache_bytes > 0 (a budget of 0 "
                             "holds no block); got disk_cache_bytes=0")
        check_choice("cache_policy", self.cache_policy, CACHE_POLICIES)
        check_choice("write_policy", self.write_policy, WRITE_POLICIES)
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        if not isinstance(self.salt, bytes):
            raise ValueError(f"salt must be bytes, got {self.salt!r} ({type(self.salt).__name__})")
        check_int("copy_threads", self.copy_threads, min_value=1)
        check_remote_url("remote_cache_url", self.remote_cache_url)
        check_real("remote_timeout_s", self.remote_timeout_s, min_value=0.0, min_open=True)
        if self.remote_cache_url is not None and self.host_cache_bytes == 0:
            raise ValueError(f"remote_cache_url={self.remote_cache_url!r} needs host_cache_bytes > 0: blocks reach "
                             "the remote tier through host memory; got host_cache_bytes=0")


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
