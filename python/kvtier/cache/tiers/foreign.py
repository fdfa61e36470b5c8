"""kvtier's tiers under another engine's KV pages (vLLM's KV connector), split as such engines split.

An engine like vLLM keeps its own device KV cache and prefix cache and runs a connector twice:
where it decides (its scheduler) and where it holds the KV tensors (each worker). The tiers below
its pages are the pool's own tiers (:mod:`kvtier.cache.tiers`), in two halves:

* :class:`ForeignIndex` (the deciding side): the prefix index of the blocks in the host, disk and
  remote tiers; host slot allocation and its LRU eviction (the staging layer,
  :class:`~kvtier.cache.tiers.host.HostStore`, over slot bookkeeping without bytes); the disk
  budget and its start-up recovery (:class:`~kvtier.cache.tiers.disk_budget.DiskBudget`); the
  remote store's lookups; and the cost model, whose tier rates are probed at start-up
  (:func:`probe_host_copy`, :func:`~kvtier.cache.tiers.probe_disk`).
* :class:`ForeignPages` (the holding side): the host slots' bytes, the disk files and the remote
  store as :class:`~kvtier.cache.tiers.protocol.TierStore` s, and batched copies between them and
  the engine's per-layer caches: on the native copy engine (:class:`kvtier.transfer.CopyEngine`,
  memcpy on its own threads, no Python per block) when the caches are CPU tensors with block ids
  on dim 0 and contiguous pages, as vLLM's CPU caches are; else one torch gather or scatter per
  layer per call (:func:`kvtier.cache.block_layout.gather_blocks`).

The deciding side chooses every slot and file, so the holding side needs no index: a
:class:`LoadJob` names each block's tier and slot, a :class:`SaveJob` each block's slot and
whether it also goes down. A disk file the deciding side evicts is removed by the holding side
(:meth:`ForeignIndex.take_pending`), which owns the files' bytes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.cache.block_layout import BlockLayout, gather_blocks, scatter_blocks
from kvtier.cache.config import PoolConfig
from kvtier.cache.cost_model import REMOTE_TIER, CostModel, TierCost, probe
from kvtier.cache.disk_tier import BlockMeta, DiskTier
from kvtier.cache.eviction import make_policy
from kvtier.cache.host_tier import HostTier
from kvtier.cache.pool_stats import PoolStats
from kvtier.cache.prefix_index import PrefixIndex, Tier
from kvtier.cache.remote import RemoteTier
from kvtier.cache.tiers import PoolTiers, probe_disk
from kvtier.cache.tiers.disk import DiskFiles
from kvtier.cache.tiers.disk_budget import DiskBudget, namespace_dir
from kvtier.cache.tiers.host import HostStore
from kvtier.cache.tiers.protocol import TierStore
from kvtier.cache.tiers.remote import RemoteStore

MISSING = -1
"""The tier of a planned block no tier holds any more (:meth:`ForeignIndex.plan_load`)."""

TIER_NAMES = {int(Tier.HOST): "host", int(Tier.DISK): "disk", int(Tier.REMOTE): "remote"}


@dataclass
class LoadJob:
    """Fill the engine's blocks ``block_ids[i]`` with tier block ``hashes[i]`` from ``tiers[i]``
    (a :class:`Tier` value, or :data:`MISSING`; ``slots[i]`` its host slot, else -1). One
    request's run of blocks, in order."""

    req_id: str
    block_ids: list[int]
    hashes: list[bytes]
    tiers: list[int]
    slots: list[int]


@dataclass
class SaveJob:
    """Copy the engine's blocks ``block_ids[i]`` into host slots ``slots[i]`` as ``hashes[i]``;
    with ``to_disk[i]`` / ``to_remote``, write them down too (write-through)."""

    block_ids: list[int]
    hashes: list[bytes]
    slots: list[int]
    to_disk: list[bool]
    to_remote: bool


@dataclass
class StepPlan:
    """What the holding side does in one engine step: ``spills`` (write-back: host slot -> disk,
    before the slot is reused), ``loads``, ``saves``, ``disk_removes`` (evicted disk blocks)."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    spills: list[tuple[bytes, int]] = field(default_factory=list)
    disk_removes: list[bytes] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.loads or self.saves or self.spills or self.disk_removes)


def probe_host_copy(block_bytes: int, max_blocks: int = 8) -> TierCost:
    """The host tier's cost where the engine's KV cache is host memory: one copy job of up to
    ``max_blocks`` blocks of ``block_bytes`` (:func:`kvtier.cache.cost_model.probe`)."""
    src = torch.empty(max_blocks * block_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)

    def copy(k: int) -> int:
        dst[:k * block_bytes].copy_(src[:k * block_bytes])
        return k * block_bytes
    return probe(copy, max_blocks)


class _DeferredRemovals:
    """A :class:`DiskTier` seen from the deciding side: lookups go to it, removals are queued for
    the holding side (which owns the files and their byte count)."""

    def __init__(self, disk: DiskTier):
        self.disk, self.removed = disk, []

    def remove(self, block_hash: bytes) -> bool:
        self.removed.append(block_hash)
        return True

    def __getattr__(self, name):
        return getattr(self.disk, name)


class ForeignIndex:
    """kvtier's tiers where the engine decides (see the module docstring).

    Args:
        config: the tiers' settings (``page_size`` is the engine's block size; ``host_cache_bytes``
            > 0).
        meta: the layout of one tier block (the holding side computes the same from its caches).
        remote: the remote store to ask which blocks it holds, or None.

    Start-up: the intact blocks of this layout and salt already in the disk tier's directory (an
    earlier server's) are indexed; one that then fails its checksum is dropped and recomputed.
    """

    def __init__(self, config: PoolConfig, meta: BlockMeta, remote: RemoteTier | None = None):
        self.config, self.meta, self.remote = config, meta, remote
        self.block_bytes = meta.payload_bytes
        self.index = PrefixIndex()
        self.stats = PoolStats()
        self.policy = make_policy(config.cache_policy)
        slots = HostTier(config.host_cache_bytes, self.block_bytes, pin=False, storage=False)
        self.host = HostStore(slots, lambda: self.index, self._evicted_host)
        self.cost_model = CostModel()
        self.cost_model.tiers[Tier.HOST] = probe_host_copy(self.block_bytes)
        self.disk_dir = namespace_dir(config.disk_cache_dir, config.salt, meta) if config.disk_cache_dir else None
        self.budget: DiskBudget | None = None
        self._disk: _DeferredRemovals | None = None
        if self.disk_dir is not None:
            disk = DiskTier(self.disk_dir, config.disk_cache_bytes)
            if (cost := probe_disk(disk, meta)) is not None:
                self.cost_model.tiers[Tier.DISK] = cost
            self._disk = _DeferredRemovals(disk)
            self.budget = DiskBudget(self._disk, self.index, meta, self.stats, private=True)
            self.budget.recover()
        if remote is not None:
            self.cost_model.tiers[Tier.REMOTE] = TierCost(REMOTE_TIER.latency_s, REMOTE_TIER.bandwidth_Bps)
        self._local = [self.host.tier] + ([Tier.DISK] if self.budget is not None else [])
        self._spills: list[tuple[bytes, int]] = []

    @property
    def num_host_slots(self) -> int:
        return self.host.capacity_blocks()

    def _evicted_host(self, n: int) -> None:
        self.stats.evictions["host"] += n

    # ---- lookups ------------------------------------------------------------------------------
    def sources(self, hashes: Sequence[bytes]) -> list[int]:
        """The fastest tier (a :class:`Tier` value) holding each block of the longest run of
        ``hashes`` found in a local tier (host, disk), then in the remote store (asked for the
        blocks after that run)."""
        return self._sources(hashes)[1]

    def _sources(self, hashes: Sequence[bytes]) -> tuple[np.ndarray, list[int]]:
        """``(rows, sources)``: the index rows of the local run (as ``PrefixIndex.match``
        returns) and :meth:`sources`."""
        rows = self.index.match(list(hashes), self._local) if len(hashes) else np.zeros((0, 4), np.int64)
        found = PoolTiers.fastest_tiers(rows).tolist()
        rest = list(hashes[len(found):])
        if rest and self.remote is not None:
            for held in self.remote.exists(rest):
                if not held:
                    break
                found.append(int(Tier.REMOTE))
        return rows, found

    def blocks_to_load(self, hashes: Sequence[bytes]) -> tuple[int, list[int]]:
        """How many leading blocks of ``hashes`` to load rather than recompute, and their tiers
        (:meth:`kvtier.cache.cost_model.CostModel.blocks_to_load` over :meth:`sources`, at the
        cost model's current ``prefill_tok_s``; 0 when recomputing them is faster)."""
        src = self.sources(hashes)
        k = self.cost_model.blocks_to_load(np.asarray(src, dtype=np.int64), self.block_bytes, self.config.page_size)
        return k, src[:k]

    # ---- loads --------------------------------------------------------------------------------
    def plan_load(self, req_id: str, block_ids: Sequence[int], hashes: Sequence[bytes]) -> LoadJob:
        """The load of ``hashes`` into the engine's blocks ``block_ids``, from the tiers holding
        them now (a block that left the tiers since :meth:`blocks_to_load` gets :data:`MISSING`:
        the holding side reports it as a load error). The host copies it reads stay locked (not
        evicted, their slots not reused) until :meth:`loaded`."""
        hashes = list(hashes)
        rows, src = self._sources(hashes)
        src = src[:len(hashes)] + [MISSING] * (len(hashes) - len(src))
        slots = [int(rows[i][self.host.tier]) if t == self.host.tier else -1 for i, t in enumerate(src)]
        on_host = [h for h, s in zip(hashes, slots) if s >= 0]
        if on_host:
            self.host.lock(on_host)
        self.index.touch(hashes)
        return LoadJob(req_id, list(block_ids), hashes, src, slots)

    def loaded(self, job: LoadJob) -> None:
        """The holding side ended ``job``: its host copies may be evicted again."""
        on_host = [h for h, s in zip(job.hashes, job.slots) if s >= 0]
        if on_host:
            self.host.unlock(on_host)

    # ---- saves --------------------------------------------------------------------------------
    def plan_save(self, block_ids: Sequence[int], hashes: Sequence[bytes]) -> SaveJob | None:
        """Host slots for the blocks of ``hashes`` not in the host tier yet (evicting least
        recently used copies as the eviction policy allows, never a block of this same save: a
        prefix keeps its first blocks); None if none needs saving or no slot can be had."""
        held = self.host.held(hashes)
        self.host.touch([h for h, on in zip(hashes, held) if on])
        todo = [(int(b), h) for b, h, on in zip(block_ids, hashes, held) if not on]
        if not todo:
            return None
        spill = self._spill if self.config.write_policy == "write-back" else None
        slots = self.host.allocate(len(todo), spill, choose=self._choose)
        todo = todo[:len(slots)]
        if not todo:
            return None
        hs = [h for _, h in todo]
        self.host.index_copies(hs, slots)
        to_disk = [self.config.write_policy == "write-through" and self._disk_add(h) for h in hs]
        return SaveJob([b for b, _ in todo], hs, slots, to_disk, self.remote is not None)

    def _choose(self, candidates: list[tuple[bytes, int]], n: int) -> list[tuple[bytes, int]]:
        """``n`` of the LRU-ordered eviction ``candidates`` as the eviction policy picks them."""
        slot_hash = {slot: h for h, slot in candidates}
        now, out = time.monotonic(), []
        while len(out) < n and slot_hash:
            slot = self.policy.pick_page(list(slot_hash), slot_hash, now)
            out.append((slot_hash.pop(slot), slot))
        return out

    def _spill(self, victims: list[tuple[bytes, int]]) -> None:
        """Write-back: host copies about to be evicted are written to disk from their slots first."""
        self._spills += [(h, slot) for h, slot in victims if self._disk_add(h)]

    def _disk_add(self, h: bytes) -> bool:
        """Index a disk copy of ``h`` (evicting least recently used ones to make room); False when
        there is no disk tier, it holds ``h`` already, or nothing can be evicted."""
        if self.budget is None or self.index.held([h], Tier.DISK)[0] or not self.budget.room(()):
            return False
        return self.budget.add(h)

    def take_pending(self, plan: StepPlan) -> None:
        """Move the write-back spills and disk removals decided so far into ``plan``."""
        plan.spills, self._spills = self._spills, []
        if self._disk is not None:
            plan.disk_removes, self._disk.removed = self._disk.removed, []

    def drop(self, hashes: Sequence[bytes]) -> None:
        """Forget every local copy of ``hashes`` (their load failed: they are not in the tiers)."""
        hashes = list(hashes)
        self.host.evict(hashes)
        if self.budget is not None:
            self.index.remove_many(hashes, Tier.DISK)

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()


@dataclass
class ForeignStats:
    """What the holding side did (blocks): loaded from each tier, load failures (recomputed),
    saved to host, written to disk and remote, write-back spills; ``load_jobs`` loads run and
    ``load_s`` the wall seconds they took (reads, copies and bookkeeping, as the caller times them)."""

    loaded: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIER_NAMES.values(), 0))
    load_failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIER_NAMES.values(), 0))
    saved_host: int = 0
    written_disk: int = 0
    written_remote: int = 0
    spilled: int = 0
    load_jobs: int = 0
    load_s: float = 0.0


class ForeignPages:
    """kvtier's tiers where the engine holds its KV caches (see the module docstring).

    Args:
        config: the tiers' settings.
        caches: the engine's KV cache tensors, one per layer in model order (any device).
        block_dim: the dim of each cache that block ids index.
        token_dim: the dim of one page that counts tokens.
        remote: the remote store, or None.

    The calls are not thread-safe: the caller runs one at a time (the connector runs loads on one
    thread and saves on another, and orders them so that no two touch the same slot).
    """

    def __init__(self, config: PoolConfig, caches: Sequence[torch.Tensor], block_dim: int, token_dim: int,
                 remote: RemoteTier | None = None):
        from kvtier.transfer import CopyEngine  # native copies and the disk files' I/O workers

        self.config, self.caches, self.block_dim = config, list(caches), block_dim
        self.layout = BlockLayout.of_caches(self.caches, block_dim, token_dim)
        self.meta = self.layout.meta()
        self.block_bytes = self.layout.block_bytes
        no_index = PrefixIndex()  # the deciding side chose every slot: nothing is looked up here
        self.host = HostStore(HostTier(config.host_cache_bytes, self.block_bytes, pin=False), lambda: no_index)
        self.disk: DiskTier | None = None
        self.stores: dict[int, TierStore] = {int(Tier.HOST): self.host}
        self._io = CopyEngine(num_threads=config.copy_threads, max_queued=256)
        self._pools = _native_pools(self.caches, block_dim)
        storage = self.host.host.storage.unsqueeze(1)  # [num_slots, 1, block_bytes]: slots as one page pool
        page = self.layout.page_bytes
        self._slot_pool = [storage]
        # one list per layer, made once: the copy engine checks a pool list once per list object
        self._slot_layers = [[storage[:, :, i * page:(i + 1) * page]] for i in range(len(self.caches))]
        self._layer_pools = [[p] for p in self._pools] if self._pools is not None else None
        if config.disk_cache_dir:
            self.disk = DiskTier(namespace_dir(config.disk_cache_dir, config.salt, self.meta), config.disk_cache_bytes)
            self.stores[int(Tier.DISK)] = DiskFiles(self.disk, self.meta, lambda: self._io)
        self.remote = remote
        self.stats = ForeignStats()

    @property
    def remote(self) -> RemoteTier | None:
        return self._remote

    @remote.setter
    def remote(self, remote: RemoteTier | None) -> None:
        self._remote = remote
        if remote is not None:
            self.stores[int(Tier.REMOTE)] = RemoteStore(remote)
        else:
            self.stores.pop(int(Tier.REMOTE), None)

    def load(self, job: LoadJob) -> list[int]:
        """Run one load: :meth:`read`, then one scatter per layer into the engine's blocks.
        Returns the block ids that failed (from the first failed block on: a prefix is only
        usable up to there)."""
        t0 = time.perf_counter()
        staging, good = self.read(job)
        self.scatter(staging, job.block_ids[:good])
        self.stats.load_jobs += 1
        self.stats.load_s += time.perf_counter() - t0
        return job.block_ids[good:]

    def read(self, job: LoadJob) -> tuple[torch.Tensor, int]:
        """Read the blocks of ``job`` from their tiers (each tier's blocks in one call) into one
        ``[len(job.hashes), block_bytes]`` uint8 buffer; returns it and how many leading blocks
        were read intact (the rest are counted as load failures)."""
        n = len(job.hashes)
        staging = torch.empty(n, self.block_bytes, dtype=torch.uint8)
        ok = [t != MISSING for t in job.tiers]
        for tier in sorted(set(job.tiers) - {MISSING}):
            rows = [i for i, t in enumerate(job.tiers) if t == tier]
            store = self.stores.get(tier)
            if store is None:
                for i in rows:
                    ok[i] = False
                continue
            buf, copy = store.read([job.hashes[i] for i in rows], [job.slots[i] for i in rows])
            try:
                statuses = copy.result()
            except RuntimeError:
                statuses = [-1] * len(rows)
            staging[rows] = buf.reshape(-1).view(torch.uint8)[:len(rows) * self.block_bytes].view(len(rows), -1)
            for i, status in zip(rows, statuses):
                ok[i] = status == 0
        good = ok.index(False) if False in ok else n
        for i in range(good, n):
            if not ok[i] and job.tiers[i] != MISSING:
                self.stats.load_failures[TIER_NAMES[job.tiers[i]]] += 1
        for t in job.tiers[:good]:
            self.stats.loaded[TIER_NAMES[t]] += 1
        return staging, good

    def native_host_load(self, job: LoadJob) -> bool:
        """Whether :meth:`load_layer` can copy ``job`` (every block in a host slot, native caches)."""
        return self._pools is not None and bool(job.hashes) and all(t == Tier.HOST for t in job.tiers)

    def load_layer(self, job: LoadJob, layer: int, tmp: torch.Tensor) -> None:
        """Copy layer ``layer`` of ``job``'s blocks from their host slots into the engine's
        blocks: two native copy jobs (slots -> ``tmp``, a uint8 buffer of at least
        ``len(job.hashes) * page_bytes``, -> the layer's blocks). :meth:`native_host_load` must hold."""
        self._io.gather(self._slot_layers[layer], job.slots, tmp).result()
        self._io.scatter(tmp, self._layer_pools[layer], job.block_ids).result()

    def scatter(self, staging: torch.Tensor, block_ids: Sequence[int], layers: Sequence[int] | None = None) -> None:
        """Copy the first ``len(block_ids)`` blocks of ``staging`` into the engine's blocks
        ``block_ids`` (distinct), one copy per layer of ``layers`` (default: all)."""
        if not len(block_ids):
            return
        if layers is None:
            scatter_blocks(staging[:len(block_ids)], self.caches, self.block_dim, block_ids)
            return
        for layer in layers:
            scatter_blocks(staging[:len(block_ids)], self.caches, self.block_dim, block_ids, layers=[layer])

    def spill(self, spills: Sequence[tuple[bytes, int]]) -> list:
        """Start writing host slots to disk (write-back), from a private copy of the slots (they
        are about to be reused); returns the copy jobs to wait for."""
        disk = self.stores.get(int(Tier.DISK))
        if not spills or disk is None:
            return []
        return [(disk.write([h for h, _ in spills], self.host.copy_out([s for _, s in spills])), "spilled")]

    def gather(self, saves: Sequence[SaveJob]) -> torch.Tensor:
        """Copy the blocks of all of a step's ``saves`` out of the engine's caches (one gather per
        layer) into their host slots; returns the ``[n, block_bytes]`` uint8 copy the writes below
        the host read (the slots may be reused meanwhile)."""
        ids = [b for job in saves for b in job.block_ids]
        slots = [s for job in saves for s in job.slots]
        blocks = torch.empty(len(ids), self.block_bytes, dtype=torch.uint8)
        if self._pools is not None and ids:
            self._io.gather(self._pools, ids, blocks).result()
            self._io.scatter(blocks, self._slot_pool, slots).result()
        else:
            gather_blocks(self.caches, self.block_dim, ids, blocks)
            self.host.fill(slots, blocks)
        self.stats.saved_host += len(ids)
        return blocks

    def write_down(self, saves: Sequence[SaveJob], blocks: torch.Tensor) -> list:
        """Start the write-through copies of ``saves`` (whose blocks :meth:`gather` returned) to
        disk and the remote store; returns the copy jobs to wait for."""
        jobs, disk, remote = [], self.stores.get(int(Tier.DISK)), self.stores.get(int(Tier.REMOTE))
        rows = [i for i, d in enumerate(d for job in saves for d in job.to_disk) if d]
        hashes = [h for job in saves for h in job.hashes]
        if rows and disk is not None:
            jobs.append((disk.write([hashes[i] for i in rows], blocks[rows]), "written_disk"))
        rows = [i for i, r in enumerate(r for job in saves for r in [job.to_remote] * len(job.hashes)) if r]
        if rows and remote is not None:
            jobs.append((remote.write([hashes[i] for i in rows], blocks[rows].contiguous()), "written_remote"))
        return jobs

    def ended(self, jobs: Sequence) -> None:
        """Wait for the copy jobs :meth:`spill` and :meth:`write_down` started and count them."""
        for copy, counter in jobs:
            try:
                statuses = copy.result()
            except RuntimeError:
                continue
            setattr(self.stats, counter, getattr(self.stats, counter) + sum(s == 0 for s in statuses))

    def remove(self, hashes: Sequence[bytes]) -> None:
        """Remove evicted disk blocks."""
        if self.disk is not None:
            for h in hashes:
                self.disk.remove(h)

    def close(self) -> None:
        if self._remote is not None:
            self._remote.close()


def _native_pools(caches: Sequence[torch.Tensor], block_dim: int) -> list[torch.Tensor] | None:
    """``caches`` as the native copy engine's page pools (``[num_blocks, rows, last dim]`` views,
    one page per block id), or None when it cannot copy them (a GPU tensor, block ids not on dim
    0, pages that are not contiguous)."""
    from kvtier.transfer import PagePoolView

    if block_dim != 0 or any(c.device.type != "cpu" for c in caches):
        return None
    try:
        pools = [c.view(c.shape[0], -1, c.shape[-1]) for c in caches]
        PagePoolView.of(pools)
    except (RuntimeError, ValueError):
        return None
    return pools
