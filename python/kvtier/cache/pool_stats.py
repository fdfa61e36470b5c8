"""Counters of a :class:`kvtier.cache.pool.KVPool` (``pool.stats``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PoolStats:
    """Counters of one pool: hit tokens and bytes per tier, evictions, copy errors.

    ``stores_refused[tier]``: blocks not copied down to ``tier`` because it had no room (every
    copy there in use, nothing of this pool's to evict, or a full filesystem; a write the
    filesystem refused is a copy error too). ``disk_capacity_blocks``: blocks the disk tier
    could hold for this pool at start-up (None without a disk tier; 0 = it can store nothing,
    also reported as a ``RuntimeWarning``). A pool with a remote tier also counts ``remote``
    in ``hit_tokens``, ``bytes_loaded`` and ``bytes_written`` (its misses are in
    ``KVPool.remote.stats``).
    """

    hit_tokens: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0})
    bytes_loaded: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    bytes_written: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    evictions: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0})
    copy_errors: int = 0
    prefetched_blocks: int = 0
    stores_refused: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    disk_capacity_blocks: int | None = None

    def add_tier(self, name: str) -> None:
        """Start counting hits, loads and writes of one more tier (e.g. ``remote``)."""
        for counts in (self.hit_tokens, self.bytes_loaded, self.bytes_written):
            counts.setdefault(name, 0)
