"""Counters of a :class:`kvtier.cache.pool.KVPool` (:class:`PoolStats`, updated by the pool's jobs)
and what the pool publishes of them (:class:`PoolSnapshot`, from :meth:`KVPool.stats`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


def series(name: str, doc: str, label: str | None = None, **kw):
    """A counter field of a pool's section (:meth:`PoolSnapshot.sections`) with the Prometheus series
    it is published as: ``name`` (``_total`` added), help ``doc``, and ``label`` naming the keys of a
    dict of counts (None: a plain count). ``kw`` go to :func:`dataclasses.field`."""
    return field(metadata={"series": (name, doc, label)}, **kw)


def series_table(section) -> dict[str, tuple[str, str, str | None]]:
    """``{field: (metric name, help, label or None)}`` of a section class or instance, in field order."""
    return {f.name: f.metadata["series"] for f in dataclasses.fields(section)}


@dataclass
class PoolStats:
    """Counters of one pool: hit tokens and bytes per tier, evictions, copy errors.

    The pool's jobs update them on the thread that drives the pool; readers take a
    :class:`PoolSnapshot` (:meth:`kvtier.cache.pool.KVPool.stats`) instead.

    ``stores_refused[tier]``: blocks not copied down to ``tier`` because it had no room (every
    copy there in use, nothing of this pool's to evict, or a full filesystem; a write the
    filesystem refused is a copy error too). ``disk_capacity_blocks``: blocks the disk tier
    could hold for this pool at start-up (None without a disk tier; 0 = it can store nothing,
    also reported as a ``RuntimeWarning``). A pool with a remote tier also counts ``remote``
    in ``hit_tokens``, ``bytes_loaded`` and ``bytes_written`` (its reads and writes by status
    are in :attr:`PoolSnapshot.remote`).
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


@dataclass(frozen=True)
class RemoteSnapshot:
    """A remote tier's block reads and writes by status name (``ok``, ``miss``, ``corrupt``, ...;
    :class:`kvtier.cache.remote.RemoteStatus`) and its failed existence queries, at one instant."""

    gets: dict[str, int] = series("kvtier_remote_gets", "remote tier block reads, by status (all but ok are misses)",
                                  "status")
    puts: dict[str, int] = series("kvtier_remote_puts", "remote tier block writes, by status", "status")
    exists_failures: int = series("kvtier_remote_lookup_failures", "remote lookups that failed or timed out (taken "
                                  "as absent)")

    @property
    def misses(self) -> int:
        """Reads that did not give a block, whatever the reason."""
        return sum(n for k, n in self.gets.items() if k != "ok")


@dataclass(frozen=True)
class PoolSnapshot:
    """What one pool reports at one instant (:meth:`kvtier.cache.pool.KVPool.stats`).

    Taken on the thread that drives the pool; every field is a copy the pool never touches
    again, so another thread (an HTTP scrape) may read it while the pool goes on. Readers must
    not modify its dicts (it may be shared).

    Attributes:
        hit_tokens, bytes_loaded, bytes_written, evictions, copy_errors, prefetched_blocks,
            stores_refused, disk_capacity_blocks: :class:`PoolStats`' counters (tokens, bytes,
            blocks), by tier name.
        num_pages: device pages in each layer's page pool.
        num_free_pages: of those, pages no request or copy holds (cached ones included).
        cached_blocks: ``{"device", "host", "disk"}``: blocks with a copy in that tier.
        sections: the counters this pool keeps beyond its blocks', by name (``remote``: a remote
            tier's reads and writes, :class:`RemoteSnapshot`; one per other kind of cached object the
            pool keeps, as its resume rule names them: :mod:`kvtier.cache.checkpoints.reuse`), each
            only where the pool has it and each a copy; each field's Prometheus series is in its
            metadata (:func:`series_table`).
    """

    hit_tokens: dict[str, int]
    bytes_loaded: dict[str, int]
    bytes_written: dict[str, int]
    evictions: dict[str, int]
    copy_errors: int
    prefetched_blocks: int
    stores_refused: dict[str, int]
    disk_capacity_blocks: int | None
    num_pages: int
    num_free_pages: int
    cached_blocks: dict[str, int]
    sections: dict[str, object] = field(default_factory=dict)

    @classmethod
    def of(cls, stats: PoolStats, *, num_pages: int, num_free_pages: int, cached_blocks: dict[str, int],
           remote=None, sections: dict[str, object] | None = None) -> PoolSnapshot:
        """A snapshot of ``stats`` (copied) with the pool's page and block counts; ``remote``: the
        remote tier's :class:`kvtier.cache.remote.RemoteStats` (copied), or None; ``sections``: the
        pool's other sections (copies)."""
        rs = {} if remote is None else {"remote": RemoteSnapshot(dict(remote.gets), dict(remote.puts),
                                                                 remote.exists_failures)}
        return cls(dict(stats.hit_tokens), dict(stats.bytes_loaded), dict(stats.bytes_written), dict(stats.evictions),
                   stats.copy_errors, stats.prefetched_blocks, dict(stats.stores_refused), stats.disk_capacity_blocks,
                   num_pages, num_free_pages, dict(cached_blocks), rs | (sections or {}))
