"""kvtier's tiers as an SGLang HiCache storage backend (L3 under SGLang's host pools).

SGLang loads it with ``--hicache-storage-backend dynamic`` and an extra config naming
``"module_path": "kvtier.integrations.sglang"`` and ``"class_name": "KvtierStorage"`` (the
launch line is in docs/sglang.md). Its calls:

* legacy generic: ``get`` / ``batch_get`` / ``set`` / ``batch_set`` / ``exists`` /
  ``batch_exists`` on flat data pages (``host_pool.get_data_page(i, flat=True)``);
* v1 zero copy (``"interface_v1": 1``): ``batch_get_v1`` / ``batch_set_v1`` copy between the tiers
  and SGLang's host pool memory directly (the pool's ``get_page_buffer_meta`` segments) for
  page-first layouts; a layer-first page is gathered as the generic path does, so the two paths
  store the same bytes for a page and read each other's pages;
* v2 multi-pool: ``register_mem_host_pool_v2`` / ``batch_exists_v2`` / ``batch_get_v2`` /
  ``batch_set_v2`` for the KV pool and side pools (a recurrent state under ``TRAILING_PAGES``),
  with kvtier's exact-hit rule (:mod:`kvtier.integrations.sglang.hit_rules`).

Keys follow ``HiCacheStorageConfig``: SGLang's page key (a hash chain over the tokens) plus the
model and the shard. An MLA model's KV is the same on every TP rank: its pages are shared by the
ranks and written by one writer per shard (``is_storage_writer``); a non-writer's writes of them
return True without writing. The ranks share them through the remote store: the host slots and
the disk directory are each process's own (a disk directory has one owner, which indexes its files
at start-up). Non-MLA KV and every side pool are per TP rank. Each (pool, layout) has its own
keys, so pages of two layouts are never read as each other.

A page is served only when it passed its tier's checks; anything else (a missing or corrupt disk
file, a remote store that drops or times out, a full disk) is a miss, so SGLang loads a shorter
prefix and recomputes the rest. ``get_stats`` counts hits, bytes and failures per tier.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Any

import torch

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvtier.cache.block_layout import BlockLayout
from kvtier.cache.disk_tier import DTYPE_CODES
from kvtier.cache.remote import open_backend
from kvtier.integrations.sglang.config import StorageConfig
from kvtier.integrations.sglang.hit_rules import SidePool, kv_prefix, restorable_prefixes
from kvtier.integrations.sglang.host_pages import HostPages
from kvtier.integrations.sglang.page_store import TIER_NAMES, PageTiers, TierCounters
from kvtier.transfer import CopyEngine

logger = logging.getLogger(__name__)

try:  # SGLang's metrics record (what its collector asserts get_stats returns)
    from sglang.srt.observability.metrics_collector import StorageMetrics
except ImportError:  # pragma: no cover - older layouts of the package
    StorageMetrics = None

_KV = PoolName.KV.value


class KvtierStorage(HiCacheStorage):
    """A ``HiCacheStorage`` over kvtier's host, disk and remote tiers.

    Args:
        storage_config: SGLang's ``HiCacheStorageConfig``; its ``extra_config`` holds the tiers'
            settings (:class:`kvtier.integrations.sglang.config.StorageConfig`).
        kwargs: what SGLang's factory passes a dynamic backend beside the config (unused).

    Raises:
        ValueError: an unknown extra-config key or a value of the wrong type (naming it).
        kvtier.cache.remote.StoreUnreachableError: ``remote_cache_url`` does not answer.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None):
        self.config = StorageConfig.from_extra_config(storage_config.extra_config)
        self.storage_config = storage_config
        self.is_writer = storage_config.is_storage_writer
        c = storage_config
        model = (c.model_name or "").replace("/", "-")
        shard = f"pp{c.pp_rank}of{c.pp_size}" if c.pp_size > 1 else ""
        if c.attn_cp_size > 1:
            shard += f"cp{c.attn_cp_rank}of{c.attn_cp_size}"
        if c.dcp_size > 1:
            shard += f"dcp{c.dcp_rank}of{c.dcp_size}p{c.logical_page_size}"
        self._rank_key = f"{self.config.namespace}|{model}|tp{c.tp_rank}of{c.tp_size}dp{c.dp_rank}|{shard}"
        self._shared_key = f"{self.config.namespace}|{model}|{shard}" if c.is_mla_model else self._rank_key
        self._engine = CopyEngine(num_threads=2, max_queued=64)
        self._remote = open_backend(self.config.remote_cache_url, self.config.remote_timeout_s) \
            if self.config.remote_cache_url else None
        if c.is_mla_model and c.tp_size > 1 and self._remote is None:
            logger.warning("kvtier storage: an MLA model at tp_size=%d without remote_cache_url: the disk tier is "
                           "each rank's own, so the ranks that do not write (is_storage_writer) find no page; "
                           "set remote_cache_url to share them", c.tp_size)
        self._pools: dict[str, HostPages] = {}
        self._tiers: dict[str, PageTiers] = {}
        self._lock = threading.Lock()
        self._metrics: dict[str, list] = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                                          "backup_bandwidth": []}
        self.mem_pool_host = None

    # ---- pools ---------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        """SGLang's KV host pool (the anchor pool of the v1 and generic paths)."""
        self.mem_pool_host = mem_pool_host
        self._register(mem_pool_host, _KV)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """A host pool of the v2 interface (``PoolName.KV`` or a side pool such as ``MAMBA``)."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._register(host_pool, str(PoolName(host_pool_name).value))

    def _register(self, host_pool, name: str) -> None:
        pages = HostPages(host_pool)
        with self._lock:
            if name in self._pools and self._pools[name].pool is host_pool:
                return
            # the tiers see a page as one row of opaque elements; what the bytes mean is in the key
            dtype = pages.dtype if pages.dtype in DTYPE_CODES else torch.float16
            if pages.page_bytes % dtype.itemsize:
                raise ValueError(f"host pool {name!r}: a page of {pages.page_bytes} bytes is not a whole number of "
                                 f"{dtype} elements")
            layout = BlockLayout(1, (1, pages.page_bytes // dtype.itemsize), 0, dtype)
            # the disk tier is this process's own directory (per rank); page hashes (the remote
            # store's keys) are shared by an MLA model's ranks
            salt = f"sglang|{self._rank_key}|{name}|{pages.layout}".encode()
            self._pools[name] = pages
            self._tiers[name] = PageTiers(self.config, layout.meta(), salt, self._engine, self._remote)

    def _owner_key(self, pool: str) -> str:
        return self._shared_key if pool == _KV else self._rank_key

    def _hashes(self, pool: str, keys: list[str]) -> list[bytes]:
        """16-byte tier hashes of SGLang's page keys in ``pool``: SHA-256 of the key with the
        model, shard, pool and layout (so no two of those share a page)."""
        prefix = f"{self._owner_key(pool)}|{pool}|{self._pools[pool].layout}|".encode()
        return [hashlib.sha256(prefix + k.encode()).digest()[:16] for k in keys]

    def _pool(self, name: str) -> tuple[HostPages, PageTiers]:
        if name not in self._pools:
            raise ValueError(f"no host pool registered as {name!r} (registered: {sorted(self._pools)}); "
                             "SGLang registers pools with register_mem_pool_host / register_mem_host_pool_v2")
        return self._pools[name], self._tiers[name]

    def _writes(self, pool: str) -> bool:
        """Whether this rank writes ``pool``'s pages (an MLA KV page has one writer per shard)."""
        return self.is_writer or pool != _KV

    # ---- legacy generic path ---------------------------------------------------------------------
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """Read page ``key`` into ``target_location`` (a flat data page; None: a new one);
        returns it, or None on a miss."""
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
                  ) -> list[torch.Tensor | None]:
        pages, tiers = self._pool(_KV)
        targets = list(target_locations) if target_locations is not None else [pages.dummy_page() for _ in keys]
        staging = torch.empty(len(keys), tiers.page_bytes, dtype=torch.uint8)
        t0 = time.perf_counter()
        ok = tiers.read(self._hashes(_KV, keys), staging)
        out = []
        for i, target in enumerate(targets):
            if not ok[i]:
                out.append(None)
                continue
            pages.check_flat(target, "target_locations")
            target.reshape(-1).view(torch.uint8).copy_(staging[i])
            out.append(target)
        self._record("prefetch", sum(ok), time.perf_counter() - t0, tiers.page_bytes)
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store flat data page ``value`` under ``key``."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store flat data pages ``values`` under ``keys``; True when every page is stored.

        Raises:
            ValueError: a value that is not a page of the registered KV host pool.
        """
        pages, tiers = self._pool(_KV)
        values = list(values)
        if len(values) != len(keys):
            raise ValueError(f"values must hold one page per key: {len(values)} values for {len(keys)} keys")
        for v in values:
            pages.check_flat(v, "values")
        if not keys or not self._writes(_KV):
            return True
        blocks = tiers.staging(len(keys))
        for i, v in enumerate(values):
            blocks[i].copy_(v.contiguous().reshape(-1).view(torch.uint8))
        t0 = time.perf_counter()
        stored = tiers.write(self._hashes(_KV, keys), blocks)
        self._record("backup", sum(stored), time.perf_counter() - t0, tiers.page_bytes)
        return all(stored)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many of ``keys``, from the first, are held."""
        _, tiers = self._pool(_KV)
        return kv_prefix(tiers.contains(self._hashes(_KV, keys)))

    # ---- v1 zero copy ----------------------------------------------------------------------------
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Read pages ``keys`` straight into the KV host pool at ``host_indices``
        (``[len(keys) * page_size]`` int64 token slots, page-aligned); one bool per page."""
        return self._get_pages(_KV, keys, host_indices)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store the KV host pool's pages at ``host_indices`` under ``keys``; one bool per page."""
        return self._set_pages(_KV, keys, host_indices)

    def _get_pages(self, pool: str, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        pages, tiers = self._pool(pool)
        starts = pages.page_starts(host_indices, len(keys))
        staging = torch.empty(len(keys), tiers.page_bytes, dtype=torch.uint8)
        t0 = time.perf_counter()
        ok = tiers.read(self._hashes(pool, keys), staging)
        for i, start in enumerate(starts):
            if ok[i]:
                pages.store_page(start, staging[i])
        self._record("prefetch", sum(ok), time.perf_counter() - t0, tiers.page_bytes)
        return ok

    def _set_pages(self, pool: str, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        pages, tiers = self._pool(pool)
        starts = pages.page_starts(host_indices, len(keys))
        if not keys or not self._writes(pool):
            return [True] * len(keys)
        blocks = tiers.staging(len(keys))
        for i, start in enumerate(starts):
            pages.load_page(start, blocks[i])
        t0 = time.perf_counter()
        stored = tiers.write(self._hashes(pool, keys), blocks)
        self._record("backup", sum(stored), time.perf_counter() - t0, tiers.page_bytes)
        return stored

    # ---- v2 multi-pool ---------------------------------------------------------------------------
    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """The restorable prefixes of ``keys`` (KV page keys) given the side pools' hit policies
        (:func:`kvtier.integrations.sglang.hit_rules.restorable_prefixes`); a side pool's page
        of KV page ``i`` is stored under ``keys[i]``.

        Raises:
            ValueError: a hit policy other than ``ALL_PAGES`` / ``TRAILING_PAGES`` (naming it).
        """
        _, kv_tiers = self._pool(_KV)
        kv_present = kv_tiers.contains(self._hashes(_KV, keys))
        n = kv_prefix(kv_present)
        side = []
        for transfer in pool_transfers or []:
            name = str(PoolName(transfer.name).value)
            policy = PoolHitPolicy(transfer.hit_policy).value
            _, tiers = self._pool(name)
            present = tiers.contains(self._hashes(name, keys[:n])) + [False] * (len(keys) - n)
            side.append(SidePool(name, policy, max(1, len(transfer.keys or [])), present))
        hit = restorable_prefixes(kv_present, side, kv_name=_KV)
        return PoolTransferResult(hit.pages, hit.per_pool, hit.restorable)

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Read each transfer's pages into its host pool; one bool per page, per pool."""
        return self._v2(transfers, self._get_pages)

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Store each transfer's pages from its host pool; one bool per page, per pool."""
        return self._v2(transfers, self._set_pages)

    def _v2(self, transfers: list[PoolTransfer], op) -> dict[str, list[bool]]:
        results: dict[str, list[bool]] = {}
        for t in transfers:
            keys = list(t.keys or [])
            try:
                results[t.name] = op(str(PoolName(t.name).value), keys, t.host_indices)
            except ValueError as e:  # a malformed transfer fails its own pages, not the call
                logger.error("kvtier storage: %s of pool %s: %s", op.__name__.strip("_"), t.name, e)
                results[t.name] = [False] * len(keys)
        return results

    # ---- the rest --------------------------------------------------------------------------------
    def _record(self, kind: str, pages: int, seconds: float, page_bytes: int) -> None:
        if not self.storage_config.enable_storage_metrics or pages == 0:
            return
        with self._lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(pages * page_bytes / 1e9 / max(seconds, 1e-9))

    def tier_stats(self) -> dict[str, dict[str, int]]:
        """Counters per tier (``host``, ``disk``, ``remote``), summed over the pools:
        :class:`kvtier.integrations.sglang.page_store.TierCounters` as dicts, and
        ``"pools"``: the same per pool name."""
        total = {name: TierCounters() for name in TIER_NAMES}
        per_pool = {}
        for pool, tiers in self._tiers.items():
            per_pool[pool] = {name: vars(c).copy() for name, c in tiers.counters.items()}
            for name, c in tiers.counters.items():
                total[name].add(c)
        return {**{name: vars(c).copy() for name, c in total.items()}, "pools": per_pool}

    def get_stats(self):
        """SGLang's ``StorageMetrics`` (pages and GB/s per prefetch and backup batch since the
        last call) with ``tiers``: :meth:`tier_stats`."""
        with self._lock:
            taken = {k: v[:] for k, v in self._metrics.items()}
            for v in self._metrics.values():
                v.clear()
        metrics = StorageMetrics(**taken) if StorageMetrics is not None else type("Stats", (), taken)()
        metrics.tiers = self.tier_stats()
        return metrics

    def clear(self) -> None:
        """Drop every page from the host slots and the disk tier (not from the shared remote store)."""
        for tiers in self._tiers.values():
            tiers.clear()

    def close(self) -> None:
        for tiers in self._tiers.values():
            tiers.close()
