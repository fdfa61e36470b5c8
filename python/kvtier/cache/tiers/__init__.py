"""The parts of one pool that its jobs share: the prefix index, the tiers, the copy engine, the
cost model, the eviction policy, the clock and the counters.

The tiers below the device pages (host memory, disk, remote store) are
:class:`~kvtier.cache.tiers.protocol.TierStore` s, one backend per file
(:mod:`~kvtier.cache.tiers.host`, :mod:`~kvtier.cache.tiers.disk`,
:mod:`~kvtier.cache.tiers.remote`), in ``PoolTiers.stores`` by :class:`Tier`; loads and writes go
through that interface only. The host store is also the staging layer (``PoolTiers.staging``):
the slots every block passes through on its way down, with their allocation, LRU eviction and
write-back spills.

:func:`open_stores` opens the stores of one layout: :class:`PoolTiers` the blocks', the checkpoint
store (:mod:`kvtier.cache.checkpoints.store`) a hybrid model's recurrent-state checkpoints'.
:class:`PoolTiers` opens the tiers a :class:`kvtier.cache.config.PoolConfig` asks for (or takes
the ones passed in), checks their budgets and probes their speed; the pool's jobs
(:mod:`~kvtier.cache.device_pages`, :mod:`~kvtier.cache.loads`, :mod:`~kvtier.cache.writes`,
:mod:`~kvtier.cache.prefetch`, :mod:`~kvtier.cache.prefix_reuse`) each hold the same instance.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from kvtier.cache.config import PoolConfig
from kvtier.cache.cost_model import PROBE_BULK_BYTES, REMOTE_TIER, CostModel, TierCost, probe
from kvtier.cache.device_copy import check_device_tiers, copy_engine_for
from kvtier.cache.disk_tier import BlockMeta, DiskStatus, DiskTier, aligned_empty
from kvtier.cache.eviction import make_policy
from kvtier.cache.host_tier import HostTier
from kvtier.cache.pool_stats import PoolStats
from kvtier.cache.prefix_index import PrefixIndex, Tier
from kvtier.cache.remote import RemoteTier, open_remote
from kvtier.cache.seams import Clock, CopyEngine, CopyJob, DiskStore
from kvtier.cache.tiers.disk import DiskFiles, DiskJob
from kvtier.cache.tiers.disk_budget import DiskBudget, check_budgets, namespace_dir
from kvtier.cache.tiers.host import HostStore
from kvtier.cache.tiers.protocol import Admit, DoneJob, ReadFailure, Stored, TierStore
from kvtier.cache.tiers.remote import RemoteStore

__all__ = ["Admit", "DiskFiles", "DiskJob", "DoneJob", "HostStore", "PoolTiers", "ReadFailure", "RemoteStore", "Stored",
           "Tier", "TierStore", "open_stores"]

_PROBE_HASH = b"\xff" * 16  # never produced by a real chain in practice (2^-128)


_TIERS = list(Tier)  # by value


class PoolTiers:
    """Shared state of one pool (see :class:`kvtier.cache.pool.KVPool` for the arguments).

    Attributes:
        config, kv_caches, index, stats, copy_engine, host, disk, disk_budget, remote, policy,
        clock, cost_model: as their names say; ``cost_model``, ``clock`` and ``index`` may be
            replaced (tests, the simulator) and every job sees the new one.
        meta: the layout of one page-first block; ``block_bytes`` its payload bytes.
        stores: the tiers below the device pages this pool has, as :class:`TierStore` s by
            :class:`Tier` (fastest first).
        staging: the host store (the staging layer every write down passes through), or None
            without a host tier.
    """

    def __init__(self, config: PoolConfig, kv_caches: list[torch.Tensor], cost_model: CostModel | None,
                 copy_engine: CopyEngine | None, disk: DiskStore | None, clock: Clock | None,
                 remote: RemoteTier | None):
        if not isinstance(config, PoolConfig):
            raise ValueError(f"config must be a PoolConfig, got {type(config).__name__}")
        self.config = config
        self.page_size = config.page_size
        self.kv_caches = kv_caches
        self.index = PrefixIndex()
        self.stats = PoolStats()
        check_device_tiers(config.host_cache_bytes, config.disk_cache_dir, kv_caches)
        self.copy_engine = copy_engine if copy_engine is not None else copy_engine_for(kv_caches, config.copy_threads)
        self.meta = BlockMeta.of_pools(kv_caches)
        self.block_bytes = self.meta.payload_bytes
        check_budgets(config, self.block_bytes, disk)
        self.host = HostTier(config.host_cache_bytes, self.block_bytes) if config.host_cache_bytes else None
        private = disk is None and config.disk_cache_dir is not None
        if private:
            disk = DiskTier(namespace_dir(config.disk_cache_dir, config.salt, self.meta), config.disk_cache_bytes)
        self.disk = disk
        self.disk_budget = None
        if self.disk is not None:
            self.disk_budget = DiskBudget(self.disk, self.index, self.meta, self.stats, private=private)
            self.disk_budget.recover()
        self.policy = make_policy(config.cache_policy)
        self.clock = clock if clock is not None else time.monotonic
        if remote is None and config.remote_cache_url is not None:
            remote = open_remote(config.remote_cache_url, self.meta, config.remote_timeout_s)
        self.remote = remote
        if remote is not None:
            self.stats.add_tier("remote")
        self.stores = open_stores(self.meta, self.host, self.disk, self.remote, lambda: self.copy_engine,
                                  lambda: self.index, self.disk_budget, self._evicted_host)
        self.staging: HostStore | None = self.stores.get(Tier.HOST)
        self.cost_model = cost_model if cost_model is not None else self._probe()

    # ---- lookups every job uses ---------------------------------------------------------------
    def usable_tiers(self) -> list[Tier]:
        """The tiers this pool has, fastest first."""
        return [Tier.DEVICE, *self.stores]

    @staticmethod
    def fastest_tiers(rows: np.ndarray) -> np.ndarray:
        """[n] int64: the fastest tier (a :class:`Tier` value) holding a copy, for each row of
        ``rows`` ([n, num_tiers] int64 slots, -1 = no copy, as ``PrefixIndex.match`` returns;
        every row holds a copy somewhere), in one array pass."""
        return np.argmax(rows >= 0, axis=1) if len(rows) else np.zeros(0, dtype=np.int64)

    @staticmethod
    def best_sources(rows: np.ndarray) -> list[Tier]:
        """:meth:`fastest_tiers` as a list of n :class:`Tier`."""
        return [_TIERS[i] for i in PoolTiers.fastest_tiers(rows).tolist()]

    def in_tier(self, h: bytes, tier: Tier) -> bool:
        return self.index.match([h], [tier]).shape[0] == 1

    def lower_stores(self) -> list[TierStore]:
        """The tiers below the staging layer (disk, remote), fastest first."""
        return [s for s in self.stores.values() if s is not self.staging]

    def local_tiers(self) -> list[Tier]:
        """The tiers this worker holds itself (device, host, disk), fastest first."""
        return [Tier.DEVICE, *(s.tier for s in self.stores.values() if s.local)]

    def nearest_local_store(self) -> TierStore | None:
        """The fastest local tier below the device pages (where demoted blocks are), or None."""
        return next((s for s in self.stores.values() if s.local), None)

    def cached_blocks(self) -> dict[str, int]:
        """Blocks with a copy in each local tier, by name (``device``, ``host``, ``disk``; a tier
        the pool lacks counts 0)."""
        return {k.name.lower(): self.index.num_copies(k) for k in (Tier.DEVICE, Tier.HOST, Tier.DISK)}

    def _evicted_host(self, n: int) -> None:
        self.stats.evictions["host"] += n

    def copy_job_costs(self, jobs: int = 512) -> tuple[float, float]:
        """Wall seconds per one-block job of host -> device and disk -> host copies, ``jobs``
        (and ``jobs // 4`` disk) jobs submitted back to back and all waited for: the copy engine's
        per-job cost with its queue and threads. 0 for a tier the pool lacks or a disk tier
        holding no block. Copies into device page 0 (call it on an idle pool)."""
        host_s = disk_s = 0.0
        if self.host is not None and self.host.num_slots:
            slot = self.host.slot(0)
            host_s = _seconds_per_job(lambda: self.copy_engine.scatter(slot, self.kv_caches, [0]), jobs)
        blocks = self.disk.blocks() if self.disk is not None else []
        if blocks:
            staging, disk, h = aligned_empty(self.block_bytes), self.stores[Tier.DISK], blocks[0][0]
            disk_s = _seconds_per_job(lambda: disk.read_into([h], staging), jobs // 4)
        return host_s, disk_s

    # ---- start-up -----------------------------------------------------------------------------
    def _probe(self) -> CostModel:
        model = CostModel()
        if self.host is not None and self.host.num_slots:
            n = max(1, min(self.host.num_slots, self.kv_caches[0].shape[0], PROBE_BULK_BYTES // self.block_bytes))
            staging = self.host.read(list(range(n)))  # host blocks as one load job reads them
            model.tiers[Tier.HOST] = probe(
                lambda k: self._copy_ok(self.copy_engine.scatter(staging[:k], self.kv_caches, list(range(k))), k), n)
        if self.remote is not None:
            model.tiers[Tier.REMOTE] = TierCost(REMOTE_TIER.latency_s, REMOTE_TIER.bandwidth_Bps)
        if self.disk is not None and (cost := probe_disk(self.disk, self.meta)) is not None:
            model.tiers[Tier.DISK] = cost
        return model

    def _copy_ok(self, handle: CopyJob, num_blocks: int = 1) -> int:
        """Wait for a probe copy of ``num_blocks`` blocks; returns the bytes it moved."""
        handle.result()
        return num_blocks * self.block_bytes


def open_stores(meta: BlockMeta, host: HostTier | None, disk: DiskStore | None, remote: RemoteTier | None,
                copy_engine: Callable[[], CopyEngine], index: Callable[[], PrefixIndex] | None = None,
                disk_budget: DiskBudget | None = None,
                evictions: Callable[[int], None] = lambda n: None) -> dict[Tier, TierStore]:
    """The :class:`TierStore` s of one kind of cached object of layout ``meta`` (a pool's blocks,
    or a hybrid model's recurrent-state checkpoints), by :class:`Tier`, fastest first: one for
    each of ``host``, ``disk`` and ``remote`` that is not None. The disk's reads and writes run on
    ``copy_engine()``'s I/O workers (looked up at each call); the lower tiers' buffers are pinned
    when the host slots are.

    Args:
        meta: the layout of one object (``meta.payload_bytes`` bytes).
        index: returns the prefix index that records the host slots' and the remote's copies
            (None: the caller records them itself and uses the host store's staging verbs only).
        disk_budget: the disk's room and eviction (None: the caller budgets it).
        evictions: called with the number of host copies the host store evicted.
    """
    stores: dict[Tier, TierStore] = {}
    pinned = lambda: host is not None and stores[Tier.HOST].pinned()
    if host is not None:
        stores[Tier.HOST] = HostStore(host, index, evictions)
    if disk is not None:
        stores[Tier.DISK] = DiskFiles(disk, meta, copy_engine, pinned, disk_budget)
    if remote is not None:
        stores[Tier.REMOTE] = RemoteStore(remote, index, pinned)
    return stores


def _seconds_per_job(submit, jobs: int) -> float:
    t0 = time.perf_counter()
    handles = [submit() for _ in range(jobs)]
    for h in handles:
        h.result()
    return (time.perf_counter() - t0) / jobs


def probe_disk(disk: DiskStore, meta: BlockMeta) -> TierCost | None:
    """The disk tier's cost: one probe block written, read back (one block per load job, as the
    pool's disk loads are) and removed; None when the tier has no room for it or refuses it."""
    if disk.capacity_bytes < DiskTier.file_bytes(meta.payload_bytes):
        return None
    buf = aligned_empty(meta.payload_bytes).zero_()
    if disk.write(_PROBE_HASH, meta, buf) != DiskStatus.OK:
        return None

    def read(_: int) -> int:
        disk.read(_PROBE_HASH, meta, buf)
        return meta.payload_bytes
    try:
        return probe(read)
    finally:
        disk.remove(_PROBE_HASH)
