"""The tiered KV pool: device pages, host slots and disk blocks behind one prefix index.

Scheduler-facing contract (what the first allocator offered, plus asynchronous loads):

* ``begin_prefix(seq)``: give a page-less sequence its cached prefix. Blocks already in device
  pages are reused at once; blocks in host or disk are loaded into fresh device pages by the
  copy engine when the cost model says loading beats recomputing. Returns True when the
  sequence must wait for loads (poll ``finish_prefix``).
* ``finish_prefix(seq)``: None while loads run; else the tokens ready. A failed or corrupt
  load shrinks the hit to the contiguous prefix that loaded; the rest is recomputed.
* ``allocate``, ``register_computed``, ``free``: as before. Full computed blocks are indexed as
  device copies and, with write-through, copied to host (and from host to disk) in the
  background; pages and host copies stay referenced while a copy reads them.
* ``poll()``: advance background copies (call once per step).

Invariant: a block is computed on, or served, only after its copy finished successfully.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from kvtier.cache.block_hash import block_hashes
from kvtier.cache.cost_model import CostModel, probe
from kvtier.cache.host_tier import HostTier
from kvtier.cache.policy import PoolConfig
from kvtier.cache.prefix_index import PrefixIndex, RemoveResult, Tier
from kvtier.serve.request import Sequence
from kvtier.transfer import CopyEngine, CopyError, PagePoolView


@dataclass
class _BlockLoad:
    index: int            # block number in the sequence
    hash: bytes
    page: int             # destination device page
    source: Tier          # tier it is loaded from (DEVICE = already resident)
    handle: object = None
    ok: bool | None = None
    started: float = 0.0


@dataclass
class _PrefixLoad:
    blocks: list[_BlockLoad] = field(default_factory=list)

    def done(self) -> bool:
        return all(b.ok is not None for b in self.blocks)


@dataclass
class _Write:
    hash: bytes
    page: int
    slot: int
    handle: object


@dataclass
class PoolStats:
    """Counters of one pool (tokens, bytes, errors)."""

    hit_tokens: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0})
    bytes_loaded: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    bytes_written: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    copy_errors: int = 0
    evictions: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0})


class KVPool:
    """Device pages + host slots (+ disk) of the paged MLA cache, indexed by block hash.

    Args:
        config: sizes and policies.
        kv_caches: the model's per-layer page pools ``[num_device_pages, page_size, row]``.
        cost_model: load-vs-recompute decisions; None probes the tiers at start-up.
    """

    def __init__(self, config: PoolConfig, kv_caches: list[torch.Tensor], cost_model: CostModel | None = None):
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
        self.copy_engine = CopyEngine(config.copy_threads, max_queued=256)
        self.view = PagePoolView.of(kv_caches) if kv_caches[0].device.type == "cpu" else None
        self.block_bytes = len(kv_caches) * kv_caches[0][0].numel() * kv_caches[0].element_size()
        self.host = HostTier(config.host_cache_bytes, self.block_bytes) if config.host_cache_bytes else None
        self.loads: dict[int, _PrefixLoad] = {}
        self.writes: list[_Write] = []
        self.cost_model = cost_model if cost_model is not None else self._probe()

    # ---- cost model ---------------------------------------------------------------------
    def _probe(self) -> CostModel:
        model = CostModel()
        if self.host is not None and self.host.num_slots and self.view is not None:
            slot = self.host.slot(0)

            def host_to_device() -> int:
                self.copy_engine.scatter(slot, self.kv_caches, [0]).result()
                return self.block_bytes
            model.tiers[Tier.HOST] = probe(host_to_device)
        return model

    # ---- device pages ---------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - len(seq.page_ids))

    def _take_page(self) -> int | None:
        if not self.free_pages:
            return None
        page, _ = self.free_pages.popitem(last=False)
        old = self.page_hash[page]
        if old is not None:
            if self.config.write_policy == "write-back":
                self._write_back_to_host(old, page)
            self.index.remove(old, Tier.DEVICE)
            self.page_hash[page] = None
            self.stats.evictions["device"] += 1
        self.ref_counts[page] = 1
        return page

    def _ref_page(self, page: int) -> None:
        if self.ref_counts[page] == 0:
            del self.free_pages[page]
        self.ref_counts[page] += 1

    def _unref_page(self, page: int) -> None:
        self.ref_counts[page] -= 1
        if self.ref_counts[page] == 0:
            self.free_pages[page] = None

    def _drop_page(self, page: int) -> None:
        """Unreference a page whose content must not be reused (a failed load)."""
        assert self.page_hash[page] is None
        self.ref_counts[page] -= 1
        if self.ref_counts[page] == 0:
            self.free_pages[page] = None
            self.free_pages.move_to_end(page, last=False)

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Add pages so ``seq`` holds ``num_tokens`` tokens; False (nothing changed) if too few are free."""
        need = self.pages_needed(seq, num_tokens)
        if need > len(self.free_pages):
            return False
        seq.page_ids += [self._take_page() for _ in range(need)]
        return True

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s pages; its last pages become reusable first, its first pages last."""
        load = self.loads.pop(seq.seq_id, None)
        if load is not None:  # preempted while loading: wait for the copies that write its pages
            for b in load.blocks:
                self._finish_block(b, wait=True)
            self._release_load(seq, load, keep=0)
            return
        for page in reversed(seq.page_ids):
            self._unref_page(page)
        seq.page_ids = []
        seq.num_registered_blocks = 0

    # ---- hashing ---------------------------------------------------------------------------
    def _hash_blocks(self, seq: Sequence, num_blocks: int) -> None:
        have = len(seq.block_hashes)
        if have < num_blocks:
            ps = self.page_size
            parent = seq.block_hashes[-1] if have else None
            seq.block_hashes += block_hashes(seq.token_ids(have * ps, num_blocks * ps), ps, parent, self.config.salt)

    # ---- prefix reuse and loads ------------------------------------------------------------
    def begin_prefix(self, seq: Sequence) -> bool:
        """Reuse or start loading ``seq``'s cached prefix; True when it must wait for loads."""
        assert not seq.page_ids, "sequence already holds pages"
        if not self.config.enable_prefix_caching:
            return False
        max_blocks = (seq.num_tokens - 1) // self.page_size
        self._hash_blocks(seq, max_blocks)
        hashes = seq.block_hashes[:max_blocks]
        rows = self.index.match(hashes)
        sources = [self._best_source(row) for row in rows]
        take = self.cost_model.blocks_to_load(sources, self.block_bytes, self.page_size)
        # Reference resident pages first, so that taking pages for loads cannot evict them.
        for i in range(take):
            if sources[i] == Tier.DEVICE:
                self._ref_page(int(rows[i][Tier.DEVICE]))
        take = self._fit_to_free_pages(rows, sources, take)
        load = _PrefixLoad()
        for i in range(take):
            load.blocks.append(self._start_block(i, hashes[i], rows[i], sources[i]))
        seq.page_ids = [b.page for b in load.blocks]
        if any(b.ok is None for b in load.blocks):
            self.loads[seq.seq_id] = load
            return True
        self._complete(seq, load)
        return False

    def _best_source(self, row) -> Tier:
        for tier in (Tier.DEVICE, Tier.HOST, Tier.DISK):
            if row[tier] >= 0 and (tier != Tier.HOST or self.host is not None):
                return tier
        return Tier.REMOTE

    def _fit_to_free_pages(self, rows, sources: list[Tier], take: int) -> int:
        """Shrink ``take`` until its loads fit in the free pages; unreference dropped resident pages."""
        needed = sum(1 for s in sources[:take] if s != Tier.DEVICE)
        while take and needed > len(self.free_pages):
            take -= 1
            if sources[take] == Tier.DEVICE:
                self._unref_page(int(rows[take][Tier.DEVICE]))
            else:
                needed -= 1
        return take

    def _start_block(self, i: int, h: bytes, row, source: Tier) -> _BlockLoad:
        if source == Tier.DEVICE:  # referenced in begin_prefix
            return _BlockLoad(i, h, int(row[Tier.DEVICE]), source, ok=True)
        page = self._take_page()
        block = _BlockLoad(i, h, page, source, started=time.perf_counter())
        if source == Tier.HOST and self.index.lock([h], Tier.HOST):
            try:
                block.handle = self.copy_engine.scatter(self.host.slot(int(row[Tier.HOST])), self.kv_caches, [page])
            except (CopyError, ValueError):
                self.index.unlock([h], Tier.HOST)
                block.ok = False
        else:
            block.ok = False
        return block

    def _finish_block(self, b: _BlockLoad, wait: bool) -> None:
        if b.ok is not None:
            return
        if not wait and not b.handle.done():
            return
        try:
            b.ok = b.handle.result() == [0]
        except CopyError:
            b.ok = False
        self.index.unlock([b.hash], b.source)
        if b.ok:
            name = b.source.name.lower()
            self.stats.bytes_loaded[name] += self.block_bytes
            self.cost_model.observe_copy(b.source, self.block_bytes, time.perf_counter() - b.started)
        else:
            self.stats.copy_errors += 1

    def wait_for_loads(self, timeout_s: float) -> None:
        """Block (GIL released) until one pending load ends or ``timeout_s`` passes."""
        for load in self.loads.values():
            for b in load.blocks:
                if b.ok is None:
                    b.handle.wait(timeout_s)
                    return

    def finish_prefix(self, seq: Sequence) -> int | None:
        """None while ``seq``'s loads run; else the number of tokens now in its pages."""
        load = self.loads.get(seq.seq_id)
        if load is None:
            return seq.num_computed_tokens
        for b in load.blocks:
            self._finish_block(b, wait=False)
        if not load.done():
            return None
        del self.loads[seq.seq_id]
        self._complete(seq, load)
        return seq.num_computed_tokens

    def _complete(self, seq: Sequence, load: _PrefixLoad) -> None:
        keep = 0
        while keep < len(load.blocks) and load.blocks[keep].ok:
            keep += 1
        self._release_load(seq, load, keep)
        for b in load.blocks[:keep]:
            self.stats.hit_tokens[b.source.name.lower()] += self.page_size
            if b.source != Tier.DEVICE:
                self._register_page(b.page, b.hash)
            seq.cached_tokens_by_tier[b.source.name.lower()] += self.page_size
        self.index.touch([b.hash for b in load.blocks[:keep]])
        seq.num_computed_tokens = keep * self.page_size
        seq.num_registered_blocks = keep

    def _release_load(self, seq: Sequence, load: _PrefixLoad, keep: int) -> None:
        """Keep the first ``keep`` blocks' pages on ``seq``; give back the others."""
        for b in load.blocks[keep:]:
            if b.source == Tier.DEVICE:
                self._unref_page(b.page)
            else:
                self._drop_page(b.page)
        seq.page_ids = [b.page for b in load.blocks[:keep]]

    # ---- registration and write-through ----------------------------------------------------
    def _register_page(self, page: int, h: bytes) -> None:
        if self.index.insert(h, Tier.DEVICE, page):
            self.page_hash[page] = h

    def register_computed(self, seq: Sequence) -> None:
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
                self._write_to_host(h, page)
        seq.num_registered_blocks = full

    def _host_slot(self) -> int | None:
        slot = self.host.allocate()
        if slot is not None:
            return slot
        for h, victim in self.index.eviction_candidates(Tier.HOST, 1):
            res, slot = self.index.remove(h, Tier.HOST)
            if res == RemoveResult.REMOVED:
                self.stats.evictions["host"] += 1
                return slot
        return None

    def _write_to_host(self, h: bytes, page: int) -> None:
        if self.host is None or self.view is None or self.index.match([h], [Tier.HOST]).shape[0]:
            return
        slot = self._host_slot()
        if slot is None:
            return
        self._ref_page(page)
        handle = self.copy_engine.gather(self.kv_caches, [page], self.host.slot(slot))
        self.writes.append(_Write(h, page, slot, handle))

    def _write_back_to_host(self, h: bytes, page: int) -> None:
        """Copy an evicted page down before its page is reused (write-back), synchronously."""
        if self.host is None or self.view is None or self.index.match([h], [Tier.HOST]).shape[0]:
            return
        slot = self._host_slot()
        if slot is None:
            return
        try:
            ok = self.copy_engine.gather(self.kv_caches, [page], self.host.slot(slot)).result() == [0]
        except CopyError:
            ok = False
        if ok and self.index.insert(h, Tier.HOST, slot):
            self.stats.bytes_written["host"] += self.block_bytes
        else:
            self.stats.copy_errors += not ok
            self.host.release(slot)

    def poll(self, wait: bool = False) -> None:
        """Finish background writes whose copies ended (all of them when ``wait``)."""
        pending = []
        for w in self.writes:
            if not wait and not w.handle.done():
                pending.append(w)
                continue
            try:
                ok = w.handle.result() == [0]
            except CopyError:
                ok = False
            self._unref_page(w.page)
            if ok and self.index.insert(w.hash, Tier.HOST, w.slot):
                self.stats.bytes_written["host"] += self.block_bytes
            else:
                self.stats.copy_errors += not ok
                self.host.release(w.slot)
        self.writes = pending
