"""The two halves of the connector's tiers, free of vLLM: what the scheduler knows, what the worker does.

vLLM runs a connector twice: in the scheduler (which decides) and in each worker (which holds the
KV cache tensors). kvtier splits its tiers the same way:

* :class:`SchedulerIndex` holds kvtier's prefix index of the blocks in the host, disk and remote
  tiers, the host slots' owners and the cost model. It answers "how many tokens of this prompt
  should be loaded" (:meth:`SchedulerIndex.blocks_to_load`: the cost model's choice, 0 when
  recomputing is faster) and turns each step's loads and saves into a :class:`StepPlan`: which
  vLLM blocks to fill from which host slots, disk files or remote keys, and which vLLM blocks to
  copy into which host slots (evicting least recently used ones, as the eviction policy allows).
* :class:`WorkerTiers` holds the bytes: the host tier's slots, the disk tier and the remote tier,
  and runs a plan against vLLM's per-layer KV caches: loads before the forward pass
  (:meth:`WorkerTiers.load`), saves after it (:meth:`WorkerTiers.save`). A block that fails to load
  (a disk file that fails its checksum, a remote miss) is reported, never served: vLLM recomputes
  it.

A worker runs one plan after another, loads before saves, so a host slot the scheduler reuses in
step N is read by step N's loads before step N's saves overwrite it. The scheduler indexes a save
when it plans it; a write that then fails (disk full, store down) shows as a failed load later,
which vLLM recomputes.

Blocks are kvtier tier blocks (:mod:`kvtier.cache.block_layout`), keyed by kvtier's block hashes of
the token ids (:func:`kvtier.cache.block_hash.block_hashes`) salted with the model, the layout and
the configured salt, so disk blocks outlive the process and are never served to another model.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvtier.cache.block_layout import BlockLayout, gather_blocks, scatter_blocks
from kvtier.cache.config import PoolConfig
from kvtier.cache.cost_model import REMOTE_TIER, CostModel, TierCost, probe
from kvtier.cache.tiers.disk_budget import namespace_dir
from kvtier.cache.disk_tier import DiskStatus, DiskTier, aligned_empty
from kvtier.cache.host_tier import HostTier
from kvtier.cache.eviction import make_policy
from kvtier.cache.prefix_index import PrefixIndex, Tier
from kvtier.cache.remote import RemoteStatus
from kvtier.integrations.vllm.config import open_remote_checked

BLOCK_FILE_SUFFIX = ".kvb"
MISSING = -1
"""The tier of a planned block no tier holds any more (:meth:`SchedulerIndex.plan_load`)."""


@dataclass
class LoadJob:
    """Fill vLLM blocks ``block_ids[i]`` with tier block ``hashes[i]`` from ``tiers[i]`` (a
    :class:`Tier` value; the host slot ``slots[i]`` when it is HOST). One request's run, in order."""

    req_id: str
    block_ids: list[int]
    hashes: list[bytes]
    tiers: list[int]
    slots: list[int]


@dataclass
class SaveJob:
    """Copy vLLM blocks ``block_ids[i]`` into host slots ``slots[i]`` as ``hashes[i]``; with
    ``to_disk``/``to_remote``, write them down too (write-through)."""

    block_ids: list[int]
    hashes: list[bytes]
    slots: list[int]
    to_disk: list[bool]
    to_remote: bool


@dataclass
class StepPlan:
    """What a worker does in one step: ``spills`` (write-back: host slot -> disk, before the slot is
    reused), ``loads``, ``saves``, ``disk_removes`` (evicted disk blocks)."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    spills: list[tuple[bytes, int]] = field(default_factory=list)
    disk_removes: list[bytes] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.loads or self.saves or self.spills or self.disk_removes)


class SchedulerIndex:
    """kvtier's view of the tiers, in vLLM's scheduler.

    Args:
        config: the tiers' settings (``page_size`` = vLLM's block size).
        layout: the layout of one tier block (the same the workers compute from their caches).
        prefill_tok_s: prefill rate the cost model starts from.
        remote: a :class:`kvtier.cache.remote.RemoteTier` to ask which blocks it holds, or None.

    Start-up: intact-looking block files already in the disk tier's directory (from an earlier
    server) are indexed; one that fails its checksum when loaded is dropped and recomputed.
    """

    def __init__(self, config: PoolConfig, layout: BlockLayout, prefill_tok_s: float, remote=None):
        self.config, self.layout, self.remote = config, layout, remote
        self.block_bytes = layout.block_bytes
        self.index = PrefixIndex()
        self.policy = make_policy(config.cache_policy)
        self.num_host_slots = config.host_cache_bytes // HostTier.row_bytes(self.block_bytes)
        self._free_slots = list(range(self.num_host_slots - 1, -1, -1))
        self._slot_hash: dict[int, bytes] = {}
        self.disk_dir = namespace_dir(config.disk_cache_dir, config.salt, layout.meta()) if config.disk_cache_dir else None
        self.disk_capacity_blocks = (config.disk_cache_bytes // DiskTier.file_bytes(self.block_bytes)
                                     if self.disk_dir else 0)
        self._next_disk_slot = 0
        self.cost_model = CostModel(prefill_tok_s=prefill_tok_s)
        self.cost_model.tiers[Tier.HOST] = _probe_memcpy(self.block_bytes)
        if remote is not None:
            self.cost_model.tiers[Tier.REMOTE] = TierCost(REMOTE_TIER.latency_s, REMOTE_TIER.bandwidth_Bps)
        self._pending_disk_removes: list[bytes] = []
        self._pending_spills: list[tuple[bytes, int]] = []
        if self.disk_dir is not None:
            self._recover_disk()

    # ---- lookups ------------------------------------------------------------------------------
    def sources(self, hashes: Sequence[bytes]) -> list[int]:
        """The fastest tier (a :class:`Tier` value) holding each block of the longest run of
        ``hashes`` found in the host or disk tier, then the remote tier (asked for the blocks
        after that run)."""
        rows = self.index.match(hashes, [Tier.HOST, Tier.DISK]) if hashes else np.zeros((0, 4), np.int64)
        found = [int(Tier.HOST) if r[Tier.HOST] >= 0 else int(Tier.DISK) for r in rows.tolist()]
        rest = list(hashes[len(found):])
        if rest and self.remote is not None:
            for held in self.remote.exists(rest):
                if not held:
                    break
                found.append(int(Tier.REMOTE))
        return found

    def blocks_to_load(self, hashes: Sequence[bytes]) -> tuple[int, list[int]]:
        """How many leading blocks of ``hashes`` to load rather than recompute, and their tiers:
        :meth:`kvtier.cache.cost_model.CostModel.blocks_to_load` over :meth:`sources` (0 when
        recomputing them is faster)."""
        src = self.sources(hashes)
        k = self.cost_model.blocks_to_load(np.asarray(src, dtype=np.int64), self.block_bytes, self.config.page_size)
        return k, src[:k]

    def plan_load(self, req_id: str, block_ids: Sequence[int], hashes: Sequence[bytes]) -> LoadJob:
        """The load of ``hashes`` into vLLM blocks ``block_ids``, from the tiers holding them now
        (a block that left the tiers since :meth:`blocks_to_load` gets tier :data:`MISSING`: the
        worker reports it as a load error and vLLM recomputes it)."""
        src = self.sources(hashes)[:len(hashes)]
        src += [MISSING] * (len(hashes) - len(src))
        slots = [int(self.index.match([h], [Tier.HOST])[0, Tier.HOST]) if t == Tier.HOST else -1
                 for h, t in zip(hashes, src)]
        self.index.touch(list(hashes))
        return LoadJob(req_id, list(block_ids), list(hashes), src, slots)

    # ---- saves --------------------------------------------------------------------------------
    def plan_save(self, block_ids: Sequence[int], hashes: Sequence[bytes]) -> SaveJob | None:
        """Host slots for the blocks of ``hashes`` not in the host tier yet (evicting as the
        policy allows, never a block of this same save: a prefix keeps its first blocks); None if
        none needs saving or no slot can be had."""
        held = self.index.held(list(hashes), Tier.HOST) if hashes else []
        ids, hs, slots, to_disk = [], [], [], []
        for b, h, already in zip(block_ids, hashes, held):
            if already:
                self.index.touch([h], [Tier.HOST])
                continue
            slot = self._take_slot()
            if slot is None:
                break
            self.index.insert(h, Tier.HOST, slot)
            self.index.lock([h], Tier.HOST)  # until the plan is made: not a victim of its own blocks
            self._slot_hash[slot] = h
            ids.append(int(b))
            hs.append(h)
            slots.append(slot)
            to_disk.append(self.config.write_policy == "write-through" and self._disk_add(h))
        if hs:
            self.index.unlock(hs, Tier.HOST)
        if not ids:
            return None
        return SaveJob(ids, hs, slots, to_disk, self.remote is not None)

    def take_pending(self, plan: StepPlan) -> None:
        """Move the disk removals and write-back spills decided so far into ``plan``."""
        plan.spills, self._pending_spills = self._pending_spills, []
        plan.disk_removes, self._pending_disk_removes = self._pending_disk_removes, []

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        victims = self.index.eviction_candidates(Tier.HOST, 64)
        if not victims:
            return None
        slot_of = {s: h for h, s in victims}
        slot = self.policy.pick_page(list(slot_of), self._slot_hash, time.monotonic())
        h = slot_of[slot]
        self.index.remove(h, Tier.HOST)
        del self._slot_hash[slot]
        if self.config.write_policy == "write-back" and self._disk_add(h):
            self._pending_spills.append((h, slot))  # written from the slot before it is reused
        return slot

    def _disk_add(self, h: bytes) -> bool:
        """Index a disk copy of ``h`` (evicting the least recently used if full); False when there
        is no disk tier, it holds ``h`` already, or nothing can be evicted."""
        if self.disk_dir is None or self.disk_capacity_blocks == 0 or self.index.held([h], Tier.DISK)[0]:
            return False
        if self.index.num_copies(Tier.DISK) >= self.disk_capacity_blocks:
            victims = self.index.eviction_candidates(Tier.DISK, 1)
            if not victims:
                return False
            self.index.remove(victims[0][0], Tier.DISK)
            self._pending_disk_removes.append(victims[0][0])
        self.index.insert(h, Tier.DISK, self._next_disk_slot)
        self._next_disk_slot += 1
        return True

    def drop(self, hashes: Sequence[bytes]) -> None:
        """Forget every copy of ``hashes`` (their load failed: they are not in the tiers)."""
        for h in hashes:
            for tier in (Tier.HOST, Tier.DISK):
                res, slot = self.index.remove(h, tier)
                if tier == Tier.HOST and slot >= 0:
                    self._slot_hash.pop(slot, None)
                    self._free_slots.append(slot)

    def _recover_disk(self) -> None:
        if not self.disk_dir.is_dir():
            return
        for path in sorted(self.disk_dir.glob("*" + BLOCK_FILE_SUFFIX), key=lambda p: p.stat().st_mtime):
            try:
                h = bytes.fromhex(path.stem)
            except ValueError:
                continue
            if len(h) == 16 and self.index.num_copies(Tier.DISK) < self.disk_capacity_blocks:
                self.index.insert(h, Tier.DISK, self._next_disk_slot)
                self._next_disk_slot += 1


@dataclass
class WorkerStats:
    """What a worker did (blocks): loaded from each tier, load failures (recomputed), saved to host,
    written to disk and remote, write-back spills."""

    loaded: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0, "remote": 0})
    load_failures: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0, "remote": 0})
    saved_host: int = 0
    written_disk: int = 0
    written_remote: int = 0
    spilled: int = 0


_TIER_NAMES = {int(Tier.HOST): "host", int(Tier.DISK): "disk", int(Tier.REMOTE): "remote"}


class WorkerTiers:
    """kvtier's tiers in one vLLM worker, over its per-layer KV caches.

    Args:
        config: the tiers' settings.
        caches: vLLM's KV cache tensors, one per layer in model order.
        block_dim: the dim of each cache that block ids index (1 for vLLM's ``[2, num_blocks, ...]``
            K/V caches, 0 for MLA's ``[num_blocks, block_size, 576]``).
        token_dim: the dim of one page that counts tokens.
        stats_path: a JSON file the counters (:class:`WorkerStats`) are written to after each
            step that changed them, or None.

    Raises:
        ValueError: caches of different shapes or dtypes, or the remote store does not answer
            (names ``remote_cache_url``); RuntimeError: the disk directory cannot be opened.
    """

    def __init__(self, config: PoolConfig, caches: Sequence[torch.Tensor], block_dim: int, token_dim: int,
                 stats_path: str | None = None):
        self.config, self.caches, self.block_dim = config, list(caches), block_dim
        self.layout = BlockLayout.of_caches(self.caches, block_dim, token_dim)
        self.meta = self.layout.meta()
        self.host = HostTier(config.host_cache_bytes, self.layout.block_bytes, pin=False)
        self.disk = None
        if config.disk_cache_dir:
            self.disk = DiskTier(namespace_dir(config.disk_cache_dir, config.salt, self.meta), config.disk_cache_bytes)
        self.remote = open_remote_checked(config.remote_cache_url, self.meta, config.remote_timeout_s) \
            if config.remote_cache_url else None
        self.stats = WorkerStats()
        self.stats_path = stats_path

    def load(self, jobs: Sequence[LoadJob]) -> set[int]:
        """Run the loads of one step; returns the vLLM block ids that failed (each from its
        first failed block on: a prefix is only usable up to there)."""
        failed: set[int] = set()
        for job in jobs:
            staging = torch.empty(len(job.hashes), self.layout.block_bytes, dtype=torch.uint8)
            ok = [t != MISSING for t in job.tiers]
            host = [i for i, t in enumerate(job.tiers) if t == Tier.HOST]
            if host:
                staging[host] = self.host.read([job.slots[i] for i in host])
            for i, t in enumerate(job.tiers):
                if t == Tier.DISK:
                    ok[i] = self._disk_read(job.hashes[i], staging[i])
            remote = [i for i, t in enumerate(job.tiers) if t == Tier.REMOTE]
            if remote:
                ok_remote = self._remote_read([job.hashes[i] for i in remote], staging, remote)
                for i, good in zip(remote, ok_remote):
                    ok[i] = good
            n = ok.index(False) if False in ok else len(ok)
            for i in range(n, len(ok)):
                if not ok[i] and job.tiers[i] != MISSING:
                    self.stats.load_failures[_TIER_NAMES[job.tiers[i]]] += 1
            failed.update(job.block_ids[n:])
            if n:
                scatter_blocks(staging[:n], self.caches, self.block_dim, job.block_ids[:n])
                for t in job.tiers[:n]:
                    self.stats.loaded[_TIER_NAMES[t]] += 1
        return failed

    def save(self, plan: StepPlan) -> None:
        """Run the spills, saves and disk removals of one step (after the forward pass)."""
        for h, slot in plan.spills:
            if self.disk is not None and self._disk_write(h, self.host.slot(slot)):
                self.stats.spilled += 1
        for job in plan.saves:
            blocks = torch.empty(len(job.block_ids), self.layout.block_bytes, dtype=torch.uint8)
            gather_blocks(self.caches, self.block_dim, job.block_ids, blocks)
            self.host.write(job.slots, blocks)
            self.stats.saved_host += len(job.slots)
            if self.disk is not None:
                for i, down in enumerate(job.to_disk):
                    if down and self._disk_write(job.hashes[i], blocks[i]):
                        self.stats.written_disk += 1
            if job.to_remote and self.remote is not None:
                statuses = self.remote.put(job.hashes, blocks).result()
                self.stats.written_remote += sum(s == RemoteStatus.OK for s in statuses)
        if self.disk is not None:
            for h in plan.disk_removes:
                self.disk.remove(h)
        if not plan.empty():
            self.write_stats()

    def write_stats(self) -> None:
        """Write the counters to ``stats_path`` (atomically), if set."""
        if self.stats_path is None:
            return
        tmp = f"{self.stats_path}.{os.getpid()}.tmp"
        Path(tmp).write_text(json.dumps(asdict(self.stats)))
        os.replace(tmp, self.stats_path)

    def _disk_read(self, h: bytes, out: torch.Tensor) -> bool:
        buf = aligned_empty(self.layout.block_bytes)
        if self.disk is None or self.disk.read(h, self.meta, buf) != DiskStatus.OK:
            return False
        out.copy_(buf)
        return True

    def _disk_write(self, h: bytes, block: torch.Tensor) -> bool:
        buf = aligned_empty(self.layout.block_bytes)
        buf.copy_(block)
        return self.disk.write(h, self.meta, buf) == DiskStatus.OK

    def _remote_read(self, hashes: list[bytes], staging: torch.Tensor, rows: list[int]) -> list[bool]:
        out = torch.empty(len(hashes) * self.layout.block_bytes, dtype=torch.uint8)
        statuses = self.remote.get(hashes, out).result()
        blocks = out.view(len(hashes), self.layout.block_bytes)
        for j, row in enumerate(rows):
            if statuses[j] == RemoteStatus.OK:
                staging[row] = blocks[j]
        return [s == RemoteStatus.OK for s in statuses]

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()


def _probe_memcpy(block_bytes: int) -> TierCost:
    """Host tier cost: a measured copy of blocks of ``block_bytes`` (what a host load does on CPU)."""
    src = torch.empty(4 * block_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)

    def copy(k: int) -> int:
        dst[:k * block_bytes].copy_(src[:k * block_bytes])
        return k * block_bytes
    return probe(copy, 4)
