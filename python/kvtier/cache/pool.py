"""The tiered KV pool: device pages, host slots and disk blocks behind one prefix index.

Scheduler-facing contract:

* ``begin_prefix(seq, partial=)``: give a page-less sequence its cached prefix. Blocks already in
  device pages are reused at once; blocks in host memory or on disk are loaded into fresh device
  pages by the copy engine (a disk block through a staging buffer) when the cost model says
  loading the prefix beats recomputing it. Returns a :class:`PrefixStart`: ``LOADING`` when the
  sequence must wait for loads (poll ``finish_prefix``); ``NO_ROOM`` when the loads need more
  free pages than there are and ``partial`` is False (nothing was taken: admit it later, when
  pages were freed).
* ``finish_prefix(seq)``: None while loads run; else the tokens ready. A failed, corrupt or
  missing block shrinks the hit to the contiguous prefix that loaded; the rest is recomputed.
* ``allocate``, ``register_computed``, ``free``: page accounting. Full computed blocks are
  indexed as device copies; with write-through they are copied device -> host -> disk in the
  background (with write-back, only when evicted). A page, host copy or disk block stays
  referenced (locked) while a copy reads it, and a block is served only after its copy finished
  successfully.
* ``poll()``: once per step: finish ended writes and prefetches, start due tool-aware prefetches.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.cache.block_hash import BLOCK_HASH_BYTES, block_hashes
from kvtier.cache.cost_model import REMOTE_TIER, CostModel, TierCost, probe
from kvtier.cache.disk_budget import DiskBudget, check_budgets, namespace_dir
from kvtier.cache.disk_tier import BlockMeta, DiskStatus, DiskTier, aligned_empty
from kvtier.cache.host_tier import HostTier
from kvtier.cache.kv_state import KVState
from kvtier.cache.policy import PoolConfig, make_policy
from kvtier.cache.pool_stats import PoolStats
from kvtier.cache.prefix_index import PrefixIndex, RemoveResult, Tier
from kvtier.cache.remote import RemoteStatus, RemoteTier, open_remote
from kvtier.options import check_hashable, check_real, checked_block_hashes, checked_token_ids
from kvtier.transfer import CopyEngine, CopyError, CopyHandle

_PROBE_HASH = b"\xff" * 16  # never produced by a real chain in practice (2^-128)
_REMOTE_LOOKUP_BLOCKS = 256  # blocks past the local match asked of the remote store at most


class PrefixStart(enum.Enum):
    """What :meth:`KVPool.begin_prefix` did with a sequence."""

    READY = "ready"
    """Its reusable prefix is in its pages (maybe none): allocate and run it."""
    LOADING = "loading"
    """Blocks are loading into its pages: poll :meth:`KVPool.finish_prefix`."""
    NO_ROOM = "no-room"
    """The loads need more free device pages than there are; nothing was taken."""


@dataclass
class _BlockLoad:
    hash: bytes
    page: int                  # destination device page
    source: Tier               # DEVICE = already resident
    handle: CopyHandle | None = None
    stage: Tier | None = None  # tier the running copy reads from (its copy there is locked)
    staging: torch.Tensor | None = None  # where a disk read lands before going to the device page
    ok: bool | None = None
    copy_s: float = 0.0  # seconds its copy jobs ran (worker time), for the cost model


@dataclass
class _Write:
    hash: bytes
    target: Tier               # HOST (from a device page), DISK or REMOTE (from a host slot)
    handle: CopyHandle
    page: int = -1
    slot: int = -1


class KVPool:
    """Device pages + host slots + disk blocks of the paged MLA cache, indexed by block hash.

    Args:
        config: sizes and policies.
        kv_caches: the model's per-layer page pools ``[num_device_pages, page_size, row]``.
        cost_model: load-vs-recompute decisions; None probes the tiers at start-up.
        copy_engine: moves blocks between tiers; None starts a native
            :class:`kvtier.transfer.CopyEngine` with ``config.copy_threads`` workers. Anything with
            its ``gather``/``scatter``/``disk_read``/``disk_write`` methods and handles
            (``done``, ``wait``, ``result``, ``run_s``) works, e.g. the simulator's virtual-time
            engine (:mod:`kvtier.bench.sim.copies`).
        disk: the disk tier; None opens the subdirectory of ``config.disk_cache_dir`` (when
            set) named after this pool's salt and block layout
            (:func:`kvtier.cache.disk_budget.namespace_dir`) as a
            :class:`kvtier.cache.disk_tier.DiskTier` with budget ``config.disk_cache_bytes``.
            Given, it is used whatever ``disk_cache_dir`` says (it needs the host tier all the
            same), and may hold blocks this pool cannot evict.
        clock: seconds, monotonic; what the eviction policy's TTLs and prefetch times are
            measured in. None = ``time.monotonic``.
        remote: the remote tier (:class:`kvtier.cache.remote.RemoteTier`); None opens
            ``config.remote_cache_url`` when set. Blocks are written to it from host slots in
            the background; a prefix that runs past the local tiers is looked up there
            (a lookup waits ``remote_timeout_s`` at most) and loaded like a disk hit. Its
            misses, corrupt values and timeouts are counted (``remote.stats``) and recomputed.

    Raises:
        ValueError: bad config: a host or disk budget that holds no block (``host_cache_bytes``
            below one slot, ``disk_cache_bytes`` below one block file), a disk tier without a
            host block, or a host/disk tier over GPU page pools (not supported yet);
        RuntimeError: the disk directory cannot be used, or the remote store does not
            answer at start-up (names ``remote_cache_url``).

    Warns:
        RuntimeWarning: the disk tier can store no block (its budget is taken by blocks this
        pool cannot evict, or its filesystem is full); see ``PoolStats.disk_capacity_blocks``.
    """

    def __init__(self, config: PoolConfig, kv_caches: list[torch.Tensor], cost_model: CostModel | None = None, *,
                 copy_engine=None, disk=None, clock: Callable[[], float] | None = None,
                 remote: RemoteTier | None = None):
        if not isinstance(config, PoolConfig):
            raise ValueError(f"config must be a PoolConfig, got {type(config).__name__}")
        self.config = config
        self.page_size = config.page_size
        self.num_pages = config.num_device_pages
        self.kv_caches = kv_caches
        self.index = PrefixIndex()
        self.stats = PoolStats()
        self.ref_counts = [0] * self.num_pages
        self.page_hash: list[bytes | None] = [None] * self.num_pages
        # Unreferenced pages in reuse order (front first); those with a hash are cached copies.
        self.free_pages: OrderedDict[int, None] = OrderedDict((p, None) for p in range(self.num_pages))
        self.copy_engine = copy_engine if copy_engine is not None else CopyEngine(config.copy_threads, max_queued=256)
        self.meta = BlockMeta.of_pools(kv_caches)
        self.block_bytes = self.meta.payload_bytes
        if kv_caches[0].device.type != "cpu" and (config.host_cache_bytes or config.disk_cache_dir):
            raise ValueError("host_cache_bytes and disk_cache_dir need CPU page pools for now: the copy engine "
                             "moves device pages with memcpy, and its GPU gather/scatter path is not built yet")
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
        self.loads: dict[int, list[_BlockLoad]] = {}
        self.writes: list[_Write] = []
        self.prefetches: list[_BlockLoad] = []
        self.policy = make_policy(config.cache_policy)
        self.clock = clock if clock is not None else time.monotonic
        if remote is None and config.remote_cache_url is not None:
            remote = open_remote(config.remote_cache_url, self.meta, config.remote_timeout_s)
        self.remote = remote
        self.event_sink: Callable[[list], None] | None = None
        if remote is not None:
            self.stats.add_tier("remote")
        self.cost_model = cost_model if cost_model is not None else self._probe()

    # ---- start-up -----------------------------------------------------------------------------
    def _probe(self) -> CostModel:
        model = CostModel()
        if self.kv_caches[0].device.type != "cpu":
            return model
        if self.host is not None and self.host.num_slots:
            slot = self.host.slot(0)
            model.tiers[Tier.HOST] = probe(lambda: self._copy_ok(self.copy_engine.scatter(slot, self.kv_caches, [0])))
        if self.remote is not None:
            model.tiers[Tier.REMOTE] = TierCost(REMOTE_TIER.latency_s, REMOTE_TIER.bandwidth_Bps)
        if self.disk is not None and self.disk.capacity_bytes >= DiskTier.file_bytes(self.block_bytes):
            buf = aligned_empty(self.block_bytes).zero_()
            if self.disk.write(_PROBE_HASH, self.meta, buf) == DiskStatus.OK:
                model.tiers[Tier.DISK] = probe(lambda: self._disk_probe_read(buf))
                self.disk.remove(_PROBE_HASH)
        return model

    def _disk_probe_read(self, buf: torch.Tensor) -> int:
        self.disk.read(_PROBE_HASH, self.meta, buf)
        return self.block_bytes

    def _copy_ok(self, handle: CopyHandle) -> int:
        """Wait for a probe copy; returns the bytes it moved."""
        handle.result()
        return self.block_bytes

    # ---- device pages -------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    def pages_needed(self, seq: KVState, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - len(seq.page_ids))

    @property
    def keeps_evicted_blocks(self) -> bool:
        """Whether a device page's full block outlives its eviction in a lower tier (a host tier
        with prefix caching: copied at once under write-through, at eviction under write-back),
        so that a preempted sequence's computed blocks load back rather than being recomputed."""
        return self.config.enable_prefix_caching and self.host is not None

    def _take_page(self) -> int:
        page = self.policy.pick_page(self.free_pages, self.page_hash, self.clock())
        del self.free_pages[page]
        old = self.page_hash[page]
        if old is not None:
            if self.config.write_policy == "write-back":
                self._copy_page_to_host(old, page, wait=True)
            self.index.remove(old, Tier.DEVICE)
            self.page_hash[page] = None
            self.stats.evictions["device"] += 1
        self.ref_counts[page] = 1
        return page

    def _ref_page(self, page: int) -> None:
        if self.ref_counts[page] == 0:
            del self.free_pages[page]
        self.ref_counts[page] += 1

    def _unref_page(self, page: int, reuse_first: bool = False) -> None:
        self.ref_counts[page] -= 1
        if self.ref_counts[page] == 0:
            self.free_pages[page] = None
            if reuse_first:
                self.free_pages.move_to_end(page, last=False)

    def allocate(self, seq: KVState, num_tokens: int) -> bool:
        """Add pages so ``seq`` holds ``num_tokens`` tokens; False (nothing changed) if too few are free."""
        need = self.pages_needed(seq, num_tokens)
        if need > len(self.free_pages):
            return False
        seq.page_ids += [self._take_page() for _ in range(need)]
        return True

    def free(self, seq: KVState) -> None:
        """Drop ``seq``'s pages; its last pages become reusable first, its first pages last."""
        loads = self.loads.pop(seq.seq_id, None)
        if loads is not None:  # preempted while loading: let the copies into its pages end first
            while not all(self._advance(b, wait=True) for b in loads):
                pass
            self._keep_loaded(seq, loads, keep=0)
            return
        for page in reversed(seq.page_ids):
            self._unref_page(page)
        seq.page_ids = []
        seq.num_registered_blocks = 0

    def truncate(self, seq: KVState, num_tokens: int) -> None:
        """Keep only the pages of ``seq``'s first ``num_tokens // page_size`` full blocks (a
        placed prefix that must not be reused whole); the rest stay cached but unreferenced."""
        keep = min(num_tokens // self.page_size, len(seq.page_ids))
        for page in reversed(seq.page_ids[keep:]):
            self._unref_page(page)
        seq.page_ids = seq.page_ids[:keep]
        seq.num_computed_tokens = min(seq.num_computed_tokens, keep * self.page_size)
        seq.num_registered_blocks = min(seq.num_registered_blocks, keep)

    # ---- hashing ------------------------------------------------------------------------------
    def _hash_blocks(self, seq: KVState, num_blocks: int) -> None:
        have = len(seq.block_hashes)
        if have < num_blocks:
            ps = self.page_size
            parent = seq.block_hashes[-1] if have else None
            salt = self.config.salt + seq.salt  # a request's own salt isolates it further
            seq.block_hashes += block_hashes(seq.token_ids(have * ps, num_blocks * ps), ps, parent, salt)

    # ---- prefix reuse and loads ---------------------------------------------------------------
    def begin_prefix(self, seq: KVState, *, partial: bool = True) -> PrefixStart:
        """Reuse or start loading ``seq``'s cached prefix.

        Args:
            seq: a sequence holding no pages.
            partial: when the loads the cost model chose need more device pages than are free,
                True loads the longest prefix that fits (the rest is recomputed; for a pool with
                nothing else to free), False takes nothing and returns ``NO_ROOM`` (the caller
                admits it once running sequences freed pages, as vLLM's scheduler keeps a request
                waiting until its computed blocks fit, rather than recompute what it could load).

        Returns:
            ``READY`` (its reused tokens are in ``seq.num_computed_tokens``), ``LOADING`` or
            ``NO_ROOM`` (only with ``partial=False``); see :class:`PrefixStart`.
        """
        assert not seq.page_ids, "sequence already holds pages"
        if not self.config.enable_prefix_caching:
            return PrefixStart.READY
        hashes, rows, sources, take = self._match_prefix(seq)
        if not partial and self._load_pages(rows, sources, take) > len(self.free_pages):
            return PrefixStart.NO_ROOM
        for i in range(take):  # reference resident pages first: loads must not evict them
            if sources[i] == Tier.DEVICE:
                self._ref_page(int(rows[i][Tier.DEVICE]))
        take = self._fit_to_free_pages(rows, sources, take)
        take = self._lock_sources(hashes, rows, sources, take)
        loads = [self._start_load(hashes[i], rows[i], sources[i]) for i in range(take)]
        seq.page_ids = [b.page for b in loads]
        if any(b.ok is None for b in loads):
            self.loads[seq.seq_id] = loads
            return PrefixStart.LOADING
        self._complete(seq, loads)
        return PrefixStart.READY

    def _match_prefix(self, seq: KVState, remote: bool = True):
        """``(hashes, rows, sources, take)``: the prompt's block hashes, their index rows, the
        fastest tier of each matched block, and how many leading blocks the cost model takes.
        With ``remote`` the remote store is asked for the blocks past the local match (a round
        trip, at most ``remote_timeout_s``); without it only blocks already indexed count."""
        max_blocks = (seq.num_tokens - 1) // self.page_size
        self._hash_blocks(seq, max_blocks)
        hashes = seq.block_hashes[:max_blocks]
        rows = self.index.match(hashes, self._usable_tiers())
        if remote:
            rows = self._match_remote(hashes, rows)
        sources = [self._best_source(row) for row in rows]
        return hashes, rows, sources, self.cost_model.blocks_to_load(sources, self.block_bytes, self.page_size)

    def estimate_prefix(self, seq: KVState) -> tuple[int, float]:
        """What :meth:`begin_prefix` would reuse for page-less ``seq`` now, taking nothing.

        Returns:
            ``(reused_tokens, load_s)``: prompt tokens it would place from cached blocks (device
            hits and the loads the cost model chooses), and the cost model's estimate of those
            loads in seconds (0.0 when every block is a device hit). Whether the loads' pages are
            free is not checked, and the remote store is not asked (it is called every step for
            every waiting request): remote blocks count once a lookup has indexed them.
        """
        if not self.config.enable_prefix_caching:
            return 0, 0.0
        _, _, sources, take = self._match_prefix(seq, remote=False)
        load_s, paid = 0.0, set()
        for tier in sources[:take]:
            if tier != Tier.DEVICE:
                load_s += self.cost_model.load_s(tier, self.block_bytes) - (
                    self.cost_model.load_s(tier, 0) if tier in paid else 0.0)
                paid.add(tier)
        return take * self.page_size, load_s

    def _load_pages(self, rows, sources: list[Tier], take: int) -> int:
        """Free pages the first ``take`` blocks need: one per load, plus each resident page that
        is free now (referencing it takes it off the free list)."""
        resident = (int(rows[i][Tier.DEVICE]) for i in range(take) if sources[i] == Tier.DEVICE)
        return sum(s != Tier.DEVICE for s in sources[:take]) + sum(self.ref_counts[p] == 0 for p in resident)

    def _usable_tiers(self) -> list[Tier]:
        tiers = [Tier.DEVICE]
        if self.host is not None:
            tiers.append(Tier.HOST)
        if self.disk is not None:
            tiers.append(Tier.DISK)
        if self.remote is not None:
            tiers.append(Tier.REMOTE)
        return tiers

    @staticmethod
    def _best_source(row) -> Tier:
        return next(t for t in Tier if row[t] >= 0)

    def _match_remote(self, hashes: list[bytes], rows):
        """``rows`` extended by the blocks after them that the remote store holds (indexed as
        remote copies, slot 0); ``rows`` as given without a remote tier or when it has none."""
        n = len(rows)
        if self.remote is None or n >= len(hashes):
            return rows
        tail = hashes[n:n + _REMOTE_LOOKUP_BLOCKS]
        found = 0
        for present in self.remote.exists(tail):
            if not present:
                break
            found += 1
        for h in tail[:found]:
            self.index.insert(h, Tier.REMOTE, 0)
        return self.index.match(hashes, self._usable_tiers()) if found else rows

    def _fit_to_free_pages(self, rows, sources: list[Tier], take: int) -> int:
        """Shrink ``take`` until its loads fit in the free pages; unreference dropped resident pages."""
        needed = sum(1 for s in sources[:take] if s != Tier.DEVICE)
        while take and needed > len(self.free_pages):  # a dropped resident page is free again
            take -= 1
            if sources[take] == Tier.DEVICE:
                self._unref_page(int(rows[take][Tier.DEVICE]))
            else:
                needed -= 1
        return take

    def _lock_sources(self, hashes: list[bytes], rows, sources: list[Tier], take: int) -> int:
        """Lock the host or disk copy of each of the first ``take`` blocks that will be loaded,
        before any page is taken for them: taking a page can write its old block down the tiers
        (write-back), evicting least recently used copies there, and those must not be these.
        Returns how many blocks from the start could be locked; resident pages of the others
        are unreferenced."""
        for i in range(take):
            if sources[i] != Tier.DEVICE and not self.index.lock([hashes[i]], sources[i]):
                for j in range(i, take):
                    if sources[j] == Tier.DEVICE:
                        self._unref_page(int(rows[j][Tier.DEVICE]))
                return i
        return take

    def _start_load(self, h: bytes, row, source: Tier) -> _BlockLoad:
        """Start loading block ``h`` (its copy in ``source`` locked by :meth:`_lock_sources`)."""
        if source == Tier.DEVICE:  # referenced in begin_prefix
            return _BlockLoad(h, int(row[Tier.DEVICE]), source, ok=True)
        b = _BlockLoad(h, self._take_page(), source)
        if source == Tier.HOST:
            self._submit_host_to_device(b, int(row[Tier.HOST]))
        else:
            self._submit_staged_read(b, source)
        return b

    def _submit_host_to_device(self, b: _BlockLoad, slot: int) -> None:
        b.stage = Tier.HOST
        b.handle = self.copy_engine.scatter(self.host.slot(slot), self.kv_caches, [b.page])

    def _submit_staged_read(self, b: _BlockLoad, source: Tier) -> None:
        """Read a disk or remote block into a staging buffer (then :meth:`_end_stage` copies it
        into the device page)."""
        b.stage = source
        b.staging = aligned_empty(self.block_bytes, pin_memory=self.host is not None and self.host.storage.is_pinned())
        if source == Tier.DISK:
            b.handle = self.copy_engine.disk_read(self.disk, [b.hash], self.meta, b.staging)
        else:
            b.handle = self.remote.get([b.hash], b.staging)

    def _end_stage(self, b: _BlockLoad, status: list[int]) -> None:
        """Account for the copy that just ended and start the next one, if any."""
        stage, ok = b.stage, status == [0]
        if stage is not None:
            unlocked = self.index.unlock([b.hash], stage)
            assert unlocked, "a load's source copy was not locked while it was read"
        b.handle, b.stage = None, None
        if not ok:
            if stage == Tier.REMOTE:  # lossy by contract: a counted miss (remote.stats), not an error
                if status[:1] != [RemoteStatus.UNAVAILABLE]:
                    self.index.remove(b.hash, Tier.REMOTE)
            else:
                self.stats.copy_errors += 1
            if stage == Tier.DISK and status and status[0] in (DiskStatus.CORRUPT, DiskStatus.MISSING):
                self.index.remove(b.hash, Tier.DISK)  # the disk tier already dropped the file
            b.ok, b.staging = False, None
        elif stage in (Tier.DISK, Tier.REMOTE):  # in the staging buffer: copy it into the device page
            self.stats.bytes_loaded[stage.name.lower()] += self.block_bytes
            b.handle = self.copy_engine.scatter(b.staging, self.kv_caches, [b.page])
        else:
            if stage == Tier.HOST:
                self.stats.bytes_loaded["host"] += self.block_bytes
            self.cost_model.observe_copy(b.source, self.block_bytes, b.copy_s)
            b.ok, b.staging = True, None

    def _advance(self, b: _BlockLoad, wait: bool) -> bool:
        """Move one block load on; True once it ended."""
        while b.ok is None:
            if not wait and not b.handle.done():
                return False
            try:
                status = b.handle.result()
            except CopyError:
                status = [-1]
            b.copy_s += b.handle.run_s
            self._end_stage(b, status)
        return True

    def wait_for_loads(self, timeout_s: float) -> None:
        """Block (GIL released) until one pending load stage ends or ``timeout_s`` passes."""
        for loads in self.loads.values():
            for b in loads:
                if b.ok is None:
                    b.handle.wait(timeout_s)
                    return

    def finish_prefix(self, seq: KVState) -> int | None:
        """None while ``seq``'s loads run; else the number of tokens now in its pages."""
        loads = self.loads.get(seq.seq_id)
        if loads is None:
            return seq.num_computed_tokens
        if not all([self._advance(b, wait=False) for b in loads if b.ok is None]):  # advance every pending one
            return None
        del self.loads[seq.seq_id]
        self._complete(seq, loads)
        return seq.num_computed_tokens

    def _complete(self, seq: KVState, loads: list[_BlockLoad]) -> None:
        keep = 0
        while keep < len(loads) and loads[keep].ok:
            keep += 1
        self._keep_loaded(seq, loads, keep)
        seq.prefix_tokens_by_tier = dict.fromkeys(self.stats.hit_tokens, 0)
        for b in loads[:keep]:
            # A block this sequence loaded from a lower tier in an earlier lookup (it was sent
            # back to wait after its loads ended) is now a device copy: keep crediting the tier
            # it came from, and count its hit once. A block loaded from a lower tier now (e.g.
            # again after a preemption) is a hit of that tier, whatever an earlier lookup found.
            tier = seq.hit_tiers.get(b.hash)
            if tier is None or b.source != Tier.DEVICE:
                tier = seq.hit_tiers[b.hash] = b.source.name.lower()
                self.stats.hit_tokens[tier] += self.page_size
            seq.prefix_tokens_by_tier[tier] += self.page_size
            if b.source != Tier.DEVICE:
                self._register_page(b.page, b.hash)
        self.index.touch([b.hash for b in loads[:keep]])
        seq.num_computed_tokens = keep * self.page_size
        seq.num_registered_blocks = keep

    def _keep_loaded(self, seq: KVState, loads: list[_BlockLoad], keep: int) -> None:
        """Keep the first ``keep`` blocks' pages on ``seq``; give back the others."""
        for b in loads[keep:]:
            self._unref_page(b.page, reuse_first=b.source != Tier.DEVICE)
        seq.page_ids = [b.page for b in loads[:keep]]

    # ---- registration and writes down the tiers -----------------------------------------------
    def _register_page(self, page: int, h: bytes) -> None:
        if self.index.insert(h, Tier.DEVICE, page):
            self.page_hash[page] = h

    def register_computed(self, seq: KVState) -> None:
        """Index the pages of ``seq`` that became full and start their write-through copies."""
        if not self.config.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.page_size
        if full <= seq.num_registered_blocks:
            return
        self._hash_blocks(seq, full)
        for b in range(seq.num_registered_blocks, full):
            h, page = seq.block_hashes[b], seq.page_ids[b]
            self._register_page(page, h)
            if self.config.write_policy == "write-through":
                self._copy_page_to_host(h, page, wait=False)
        seq.num_registered_blocks = full

    def _in_tier(self, h: bytes, tier: Tier) -> bool:
        return self.index.match([h], [tier]).shape[0] == 1

    def _host_slot(self) -> int:
        """A free host slot, evicting the least recently used unreferenced copy if needed; -1 if none.

        When every slot is held by copies still in flight, those are finished first (back-pressure).
        """
        slot = self.host.allocate()
        if slot is not None:
            return slot
        if not self.index.eviction_candidates(Tier.HOST, 1) and self.writes:
            self._finish_writes(wait=True)
            slot = self.host.allocate()
            if slot is not None:
                return slot
        for h, victim in self.index.eviction_candidates(Tier.HOST, 1):
            if self.config.write_policy == "write-back" and self.disk is not None and not self._in_tier(h, Tier.DISK):
                self._copy_slot_to_disk(h, victim, wait=True)
            res, slot = self.index.remove(h, Tier.HOST)
            if res == RemoveResult.REMOVED:
                self.stats.evictions["host"] += 1
                return slot
        return -1

    def _copy_page_to_host(self, h: bytes, page: int, wait: bool) -> None:
        if self.host is None or self._in_tier(h, Tier.HOST):
            return
        slot = self._host_slot()
        if slot < 0:
            self.stats.stores_refused["host"] += 1
            return
        handle = self.copy_engine.gather(self.kv_caches, [page], self.host.slot(slot))
        if wait:  # write-back during eviction: the page is being taken, nothing else can touch it
            self._finish_write(_Write(h, Tier.HOST, handle, slot=slot))
        else:  # the page stays referenced until the copy ended
            self._ref_page(page)
            self.writes.append(_Write(h, Tier.HOST, handle, page=page, slot=slot))

    def _copy_slot_to_disk(self, h: bytes, slot: int, wait: bool) -> None:
        if self.disk is None or self._in_tier(h, Tier.DISK):
            return
        if not self.disk_budget.room(w.hash for w in self.writes if w.target == Tier.DISK):
            self.stats.stores_refused["disk"] += 1
            return
        if not self.index.lock([h], Tier.HOST):
            return
        w = _Write(h, Tier.DISK, self.copy_engine.disk_write(self.disk, [h], self.meta, self.host.slot(slot)), slot=slot)
        self._finish_write(w) if wait else self.writes.append(w)

    def _copy_slot_to_remote(self, h: bytes, slot: int) -> None:
        """Start writing a host copy to the remote tier (the bytes are taken before this returns)."""
        if self.remote is not None and not self._in_tier(h, Tier.REMOTE) and self.remote.available():
            self.writes.append(_Write(h, Tier.REMOTE, self.remote.put([h], self.host.slot(slot))))

    def close(self) -> None:
        """Release the remote tier's connections (the pool's other resources are memory)."""
        if self.remote is not None:
            self.remote.close()

    def _finish_write(self, w: _Write) -> None:
        try:
            status = w.handle.result()
        except CopyError:
            status = [-1]
        ok = status == [0]
        if w.target == Tier.HOST:
            if w.page >= 0:
                self._unref_page(w.page)
            if ok and self.index.insert(w.hash, Tier.HOST, w.slot):
                self.stats.bytes_written["host"] += self.block_bytes
                if self.config.write_policy == "write-through":
                    self._copy_slot_to_disk(w.hash, w.slot, wait=False)
                self._copy_slot_to_remote(w.hash, w.slot)
            else:
                self.host.release(w.slot)
        elif w.target == Tier.REMOTE:
            if ok and self.index.insert(w.hash, Tier.REMOTE, 0):
                self.stats.bytes_written["remote"] += self.block_bytes
            return  # a failed remote write is counted in remote.stats, not as a copy error
        else:
            self.index.unlock([w.hash], Tier.HOST)
            if ok and self.disk_budget.add(w.hash):
                self.stats.bytes_written["disk"] += self.block_bytes
            elif not ok and status[:1] == [DiskStatus.FULL]:
                self.stats.stores_refused["disk"] += 1
                self.disk_budget.refused(DiskStatus.FULL)
        self.stats.copy_errors += not ok

    def index_disk_block(self, block_hash: bytes) -> bool:
        """Index a block another pool stored in this pool's disk tier (a tier several workers
        share, e.g. a remote store); True if it was not indexed yet.

        The caller vouches that the block was written under this pool's salt and layout (a
        pool with the same :class:`PoolConfig` salt): an indexed block is served by hash.

        Raises:
            ValueError: this pool has no disk tier, or ``block_hash`` is not 16 bytes.
        """
        if self.disk is None:
            raise ValueError("index_disk_block needs a disk tier")
        if not isinstance(block_hash, bytes) or len(block_hash) != BLOCK_HASH_BYTES:
            raise ValueError(f"block_hash must be {BLOCK_HASH_BYTES} bytes, got {block_hash!r}")
        return self.disk_budget.add(block_hash)

    # ---- tool-aware retention and prefetch ------------------------------------------------------
    def tool_wait(self, session_id, token_ids, expected_wait_s: float) -> None:
        """A session starts waiting on a tool expected to take ``expected_wait_s`` seconds.

        Args:
            session_id: any hashable id of the session.
            token_ids: [num_tokens] the session's token ids so far (a list of ints or a 1-D
                integer array, each in [0, 2**32); bools are not ids); its full blocks are hashed
                with this pool's salt.
            expected_wait_s: seconds, a finite number >= 0.

        What happens to those blocks is the eviction policy's business (nothing under ``lru``);
        the arguments are checked under every policy.

        Raises:
            ValueError: an argument of the wrong type or out of range, naming it.
        """
        ids = checked_token_ids("token_ids", token_ids)
        self.tool_wait_blocks(session_id, block_hashes(ids, self.page_size, None, self.config.salt),
                              expected_wait_s)

    def tool_wait_blocks(self, session_id, hashes: list[bytes], expected_wait_s: float) -> None:
        """:meth:`tool_wait` given the session's block hashes (16-byte chain hashes with this
        pool's salt, as ``KVState.block_hashes`` holds them) instead of its tokens.

        Raises:
            ValueError: an unhashable ``session_id``, ``hashes`` that are not a list of 16-byte
                ``bytes``, or a bad ``expected_wait_s``.
        """
        check_hashable("session_id", session_id)
        hashes = checked_block_hashes("hashes", hashes)
        check_real("expected_wait_s", expected_wait_s, min_value=0.0)
        self.policy.tool_wait(session_id, hashes, expected_wait_s, self.clock())

    def tool_return(self, session_id) -> None:
        """The session's tool returned; its blocks lose any special treatment."""
        self.policy.tool_return(session_id)

    def _start_prefetches(self) -> None:
        for hashes in self.policy.due_prefetches(self.clock()):
            rows = self.index.match(hashes, self._usable_tiers())
            for h, row in zip(hashes, rows):
                source = self._best_source(row)
                if source == Tier.DEVICE or len(self.free_pages) <= self.num_pages // 4:
                    continue  # prefetch never eats the last quarter of the pool
                if self.index.lock([h], source):  # before taking a page, as for a prefix's loads
                    self.prefetches.append(self._start_load(h, row, source))

    def _finish_prefetches(self, wait: bool) -> None:
        pending = []
        for b in self.prefetches:
            if not self._advance(b, wait):
                pending.append(b)
                continue
            if b.ok and not self._in_tier(b.hash, Tier.DEVICE):
                self._register_page(b.page, b.hash)
                self.stats.prefetched_blocks += 1
                self._unref_page(b.page)  # a cached, unreferenced device copy
            else:
                self._unref_page(b.page, reuse_first=True)
        self.prefetches = pending

    def poll(self, wait: bool = False) -> None:
        """Advance background work: finish ended writes and prefetches, start due prefetches.

        With ``wait``, block until every write (and its follow-up copies) and prefetch ended.
        """
        self._start_prefetches()
        self._finish_prefetches(wait)
        self._finish_writes(wait)
        if self.event_sink is not None:
            events = self.index.drain_events()
            if events:
                self.event_sink(events)

    def publish_events_to(self, sink: Callable[[list], None] | None) -> None:
        """From now on, hand the index's events (:class:`kvtier.cache.prefix_index.Event`) to
        ``sink`` in one batch per :meth:`poll` (e.g. a :class:`kvtier.cache.kv_events.KVEventPublisher`);
        None stops. Events from before the call are dropped: call it before serving."""
        self.index.drain_events()
        self.event_sink = sink

    def _finish_writes(self, wait: bool) -> None:
        while self.writes:
            ready, pending = [], []
            for w in self.writes:
                (ready if wait or w.handle.done() else pending).append(w)
            if not ready:
                return
            self.writes = pending
            for w in ready:
                self._finish_write(w)
            if not wait:
                return
