"""One SGLang host pool's pages in kvtier's tiers: host slots, disk files, the remote store.

A page is one SGLang storage object: the flat bytes of one page of one host pool (a KV page of
every layer, or one state page), keyed by a 16-byte block hash the backend derives from SGLang's
key (:mod:`kvtier.integrations.sglang.storage`). :class:`PageTiers` keeps a pool's pages in the
tiers the config asks for, each a :class:`kvtier.cache.tiers.protocol.TierStore` built by
``cache/``'s own classes (:class:`~kvtier.cache.tiers.host.HostStore`,
:class:`~kvtier.cache.tiers.disk.DiskFiles`, :class:`~kvtier.cache.tiers.remote.RemoteStore`):

* writes go through to every tier (a page already held by a tier is not written again);
* reads try the tiers fastest first; a page read from the disk or remote tier is copied into the
  host slots. A page is served only when its tier's checks passed (the disk and remote tiers
  check a header and a CRC-32C): a missing, corrupt, short or timed-out read is a miss for SGLang,
  counted per tier in :class:`TierCounters`, never wrong bytes.

Host slots evict their least recently used pages when full (the lower tiers keep them); a full
disk refuses a write (counted), and the remote store evicts on its own.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from kvtier.cache.disk_tier import BlockMeta, DiskStatus, DiskTier, aligned_empty
from kvtier.cache.host_tier import HostTier
from kvtier.cache.prefix_index import PrefixIndex, Tier
from kvtier.cache.remote import RemoteBackend, RemoteStatus, RemoteTier
from kvtier.cache.tiers.disk import DiskFiles
from kvtier.cache.tiers.disk_budget import namespace_dir
from kvtier.cache.tiers.host import HostStore
from kvtier.cache.tiers.protocol import TierStore
from kvtier.cache.tiers.remote import RemoteStore
from kvtier.integrations.sglang.config import StorageConfig
from kvtier.transfer import CopyEngine

TIER_NAMES = ("host", "disk", "remote")

_MISS = {"disk": int(DiskStatus.MISSING), "remote": int(RemoteStatus.MISSING)}

DISK_JOBS = 4
"""Disk copy jobs one read or write of many pages is split into (the copy engine's I/O workers
take them in parallel)."""


@dataclass
class TierCounters:
    """Counters of one tier (pages and bytes since start-up).

    Attributes:
        hits: pages read from this tier and served.
        bytes_read: their bytes.
        misses: pages asked of this tier that it did not hold.
        failures: reads that failed a check or the store (corrupt, short, error, timeout, store
            down): the page is not served, SGLang sees a miss.
        writes: pages stored.
        bytes_written: their bytes.
        write_failures: writes refused (tier full) or failed (I/O error, store down).
    """

    hits: int = 0
    bytes_read: int = 0
    misses: int = 0
    failures: int = 0
    writes: int = 0
    bytes_written: int = 0
    write_failures: int = 0

    def add(self, other: TierCounters) -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)


class PageTiers:
    """One pool's pages in the tiers ``config`` asks for.

    Args:
        config: the tiers' budgets and places (each budget is this pool's).
        meta: the layout of one page (``meta.payload_bytes`` bytes): what the disk and remote
            tiers record in their headers and check on every read.
        salt: bytes naming the pool's pages (model, shard, pool, layout): the disk tier's
            subdirectory is :func:`kvtier.cache.tiers.disk_budget.namespace_dir` of it.
        engine: the copy engine whose I/O workers run the disk reads and writes.
        remote: the remote store's connection (shared by every pool), or None.

    Raises:
        ValueError: a host or disk budget too small for one page (naming it).
    """

    def __init__(self, config: StorageConfig, meta: BlockMeta, salt: bytes, engine: CopyEngine,
                 remote: RemoteBackend | None = None):
        self.meta, self.page_bytes = meta, meta.payload_bytes
        self.counters = {name: TierCounters() for name in TIER_NAMES}
        self._host_lock, self._count_lock = threading.Lock(), threading.Lock()
        self._index = PrefixIndex()
        self.host: HostStore | None = None
        self.stores: list[TierStore] = []
        if config.host_cache_bytes:
            slots = HostTier(config.host_cache_bytes, self.page_bytes, pin=False)
            if slots.num_slots == 0:
                raise ValueError(f"host_cache_bytes={config.host_cache_bytes} holds no page of "
                                 f"{self.page_bytes} bytes; expected at least {HostTier.row_bytes(self.page_bytes)}")
            self.host = HostStore(slots, lambda: self._index)
            self.stores.append(self.host)
        if config.disk_cache_dir is not None:
            need = DiskTier.file_bytes(self.page_bytes)
            if config.disk_cache_bytes < need:
                raise ValueError(f"disk_cache_bytes={config.disk_cache_bytes} holds no page file of {need} bytes "
                                 f"(a {self.page_bytes}-byte page); expected at least {need}")
            disk = DiskTier(namespace_dir(config.disk_cache_dir, salt, meta), config.disk_cache_bytes)
            self.stores.append(DiskFiles(disk, meta, lambda: engine))
        if remote is not None:
            self.stores.append(RemoteStore(RemoteTier(remote, meta, timeout_s=config.remote_timeout_s)))

    def staging(self, num_pages: int) -> torch.Tensor:
        """A ``[num_pages, page_bytes]`` uint8 buffer on a 4096-byte boundary (rows of a page size
        that is a multiple of 4096 stay aligned: the disk tier moves them with O_DIRECT)."""
        return aligned_empty(num_pages * self.page_bytes).view(num_pages, self.page_bytes)

    def _count(self, tier: str, **deltas: int) -> None:
        """Add ``deltas`` to tier ``tier``'s counters (SGLang's prefetch and backup threads both
        count)."""
        c = self.counters[tier]
        with self._count_lock:
            for k, v in deltas.items():
                setattr(c, k, getattr(c, k) + v)

    # ---- lookups ---------------------------------------------------------------------------
    def contains(self, hashes: Sequence[bytes]) -> list[bool]:
        """Whether some tier holds each page now (a store that does not answer: not held)."""
        found = [False] * len(hashes)
        todo = list(range(len(hashes)))
        for store in self.stores:
            if not todo:
                break
            if store is self.host:
                with self._host_lock:
                    held = store.contains([hashes[i] for i in todo])
            else:
                held = store.contains([hashes[i] for i in todo])
            for i, on in zip(todo, held):
                found[i] = on
            todo = [i for i in todo if not found[i]]
        return found

    # ---- reads -----------------------------------------------------------------------------
    def read(self, hashes: Sequence[bytes], out: torch.Tensor) -> list[bool]:
        """Read pages ``hashes`` into the rows of ``out``.

        Args:
            hashes: 16-byte page hashes.
            out: ``[len(hashes), page_bytes]`` uint8 CPU tensor (rows may be views of SGLang's
                host pool); row ``i`` is written only when page ``i`` was found intact.

        Returns:
            one bool per page: read and checked (True) or a miss (False).
        """
        ok = [False] * len(hashes)
        todo = list(range(len(hashes)))
        for store in self.stores:
            if not todo:
                break
            hs = [hashes[i] for i in todo]
            got = self._read_host(hs) if store is self.host else self._read_lower(store, hs)
            promote = []
            for i, row in zip(todo, got):
                if row is None:
                    continue
                out[i].copy_(row)
                ok[i] = True
                self._count(store.name, hits=1, bytes_read=self.page_bytes)
                if store is not self.host:
                    promote.append(i)
            if promote and self.host is not None:
                self._host_put([hashes[i] for i in promote], out[promote])
            todo = [i for i in todo if not ok[i]]
        return ok

    def _read_host(self, hashes: list[bytes]) -> list[torch.Tensor | None]:
        rows: list[torch.Tensor | None] = []
        with self._host_lock:
            for h in hashes:
                match = self._index.match([h], [Tier.HOST])
                if len(match) == 0:
                    self._count("host", misses=1)
                    rows.append(None)
                    continue
                buf, _ = self.host.read([h], [int(match[0, int(Tier.HOST)])])
                rows.append(buf.clone())  # the slot may be reused once the lock is let go
                self.host.touch([h])
        return rows

    def _read_lower(self, store: TierStore, hashes: list[bytes]) -> list[torch.Tensor | None]:
        parts = [(lo, *store.read(hashes[lo:hi], [-1] * (hi - lo))) for lo, hi in self._chunks(store, len(hashes))]
        rows = []
        for lo, buf, job in parts:  # every chunk started before any is waited for
            flat = buf.reshape(-1)
            for i, status in enumerate(job.result()):
                if status == 0:
                    rows.append(flat[i * self.page_bytes:(i + 1) * self.page_bytes])
                    continue
                rows.append(None)
                if status == _MISS[store.name]:
                    self._count(store.name, misses=1)
                else:
                    # corrupt (the disk tier deleted it), short, error, timeout, store down
                    self._count(store.name, failures=1)
        return rows

    @staticmethod
    def _chunks(store: TierStore, n: int) -> list[tuple[int, int]]:
        """``[lo, hi)`` runs of ``n`` pages, one copy job each: disk jobs split over
        :data:`DISK_JOBS` so the copy engine's I/O workers run them side by side; one call for
        the remote store (its batch is one round trip)."""
        if store.name != "disk" or n <= 1:
            return [(0, n)]
        step = -(-n // DISK_JOBS)
        return [(lo, min(n, lo + step)) for lo in range(0, n, step)]

    # ---- writes ----------------------------------------------------------------------------
    def write(self, hashes: Sequence[bytes], blocks: torch.Tensor) -> list[bool]:
        """Store pages ``hashes`` (rows of ``blocks``, a contiguous ``[len(hashes), page_bytes]``
        uint8 CPU tensor; from :meth:`staging`, the disk tier writes it without a bounce copy) in
        every tier; returns, per page, whether some tier holds it now."""
        hashes = list(hashes)
        stored = [False] * len(hashes)
        for store in self.stores:
            if store is self.host:
                done = self._host_put(hashes, blocks)
            else:
                done = self._write_lower(store, hashes, blocks)
            stored = [a or b for a, b in zip(stored, done)]
        return stored

    def _host_put(self, hashes: list[bytes], blocks: torch.Tensor) -> list[bool]:
        with self._host_lock:
            held = self.host.held(hashes)
            todo = [i for i, on in enumerate(held) if not on]
            slots = self.host.allocate(len(todo)) if todo else []
            if len(slots) < len(todo):
                self._count("host", write_failures=len(todo) - len(slots))
            todo = todo[:len(slots)]
            if todo:
                self.host.fill(slots, blocks if len(todo) == len(hashes) else blocks[todo])
                inserted = self.host.index_copies([hashes[i] for i in todo], slots)
                self.host.release([s for s, new in zip(slots, inserted) if not new])
                self._count("host", writes=sum(inserted), bytes_written=sum(inserted) * self.page_bytes)
            return self.host.held(hashes)

    def _write_lower(self, store: TierStore, hashes: list[bytes], blocks: torch.Tensor) -> list[bool]:
        held = store.contains(hashes) if store.local else [False] * len(hashes)
        todo = [i for i, on in enumerate(held) if not on]
        if not todo:
            return held
        rows = blocks if len(todo) == len(hashes) else blocks[todo]  # the caller's (aligned) rows when all go
        hs = [hashes[i] for i in todo]
        jobs = [store.write(hs[lo:hi], rows[lo:hi]) for lo, hi in self._chunks(store, len(hs))]
        statuses = [st for job in jobs for st in job.result()]
        for i, status in zip(todo, statuses):
            held[i] = status == 0
        ok = sum(st == 0 for st in statuses)
        self._count(store.name, writes=ok, bytes_written=ok * self.page_bytes, write_failures=len(statuses) - ok)
        return held

    def clear(self) -> None:
        """Drop every page of this pool from the host slots and the disk tier (the shared
        remote store is left alone: other workers may read it)."""
        for store in self.stores:
            if store is self.host:
                with self._host_lock:
                    store.evict([h for h, _ in self._index.eviction_candidates(Tier.HOST, 1 << 30)])
            elif isinstance(store, DiskFiles):
                for h, _ in store.disk.blocks():
                    store.disk.remove(h)

    def close(self) -> None:
        """Stop the remote tier's worker threads and close its connection."""
        for store in self.stores:
            if isinstance(store, RemoteStore):
                store.remote.close()
