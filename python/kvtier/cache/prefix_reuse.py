"""Prefix reuse: match a request's block hashes in the index, place the cached prefix in its pages
(resident pages shared at once, lower tiers loaded) and index its blocks as they are computed.

The pool reports what it placed (:meth:`PrefixReuse.finish` returns the tokens now in the
request's pages); it never advances the request's progress (``KVState.num_computed_tokens``).
"""

from __future__ import annotations

import enum

from kvtier.cache.block_hash import block_hashes
from kvtier.cache.checkpoints.reuse import EveryBlock
from kvtier.cache.device_pages import DevicePages
from kvtier.cache.kv_state import KVState
from kvtier.cache.loads import BlockLoad, Loads
from kvtier.cache.prefix_index import Tier
from kvtier.cache.tiers import PoolTiers
from kvtier.cache.writes import Writes

_TIER_NAMES = {tier: tier.name.lower() for tier in Tier}  # as PoolStats.hit_tokens names them
COMPUTED = "computed"  # KVState.hit_tiers: a block the request computed itself (never its hit)
_REMOTE_LOOKUP_BLOCKS = 256  # blocks past the local match asked of the remote store at most


class PrefixStart(enum.Enum):
    """What :meth:`kvtier.cache.pool.KVPool.begin_prefix` did with a request."""

    READY = "ready"
    """Its reusable prefix is in its pages (maybe none): allocate and run it."""
    LOADING = "loading"
    """Blocks are loading into its pages: poll :meth:`kvtier.cache.pool.KVPool.finish_prefix`."""
    NO_ROOM = "no-room"
    """The loads need more free device pages than there are; nothing was taken."""


class PrefixReuse:
    """Matching, placement and registration of requests' blocks (see :class:`kvtier.cache.pool.KVPool`)."""

    def __init__(self, tiers: PoolTiers, pages: DevicePages, loads: Loads, writes: Writes, rule: EveryBlock):
        self.tiers, self.pages, self.loads, self.writes = tiers, pages, loads, writes
        self.rule = rule  # where a prefix may resume (:mod:`kvtier.cache.checkpoints.reuse`)
        self.page_size = tiers.config.page_size
        self.loading: dict[int, KVState] = {}  # requests whose loads run, by id(), in start order

    # ---- hashing and matching -----------------------------------------------------------------
    def hash_blocks(self, kv: KVState, num_blocks: int) -> None:
        """Extend ``kv.block_hashes`` (in place) to ``num_blocks``, hashing only the blocks it lacks."""
        have = len(kv.block_hashes)
        if have < num_blocks:
            ps = self.page_size
            parent = kv.block_hashes[-1] if have else None
            salt = self.tiers.config.salt + kv.salt  # a request's own salt isolates it further
            kv.block_hashes.extend(block_hashes(kv.tokens.token_ids(have * ps, num_blocks * ps), ps, parent, salt))

    def match(self, kv: KVState, remote: bool = True):
        """``(hashes, rows, sources, take)``: the prompt's block hashes, their index rows, the
        fastest tier of each matched block, and how many leading blocks the cost model takes.
        With ``remote`` the remote store is asked for the blocks past the local match (a round
        trip, at most ``remote_timeout_s``); without it only blocks already indexed count."""
        t = self.tiers
        max_blocks = (kv.num_tokens - 1) // self.page_size
        self.hash_blocks(kv, max_blocks)
        hashes = kv.block_hashes[:max_blocks]
        rows = t.index.match(hashes, t.usable_tiers())
        if remote:
            rows = self._match_remote(hashes, rows)
        sources = t.fastest_tiers(rows)
        return hashes, rows, sources, t.cost_model.blocks_to_load(sources, t.block_bytes, self.page_size)

    def _match_remote(self, hashes: list[bytes], rows):
        """``rows`` extended by the blocks after them that the remote store holds (indexed as
        remote copies, slot 0); ``rows`` as given without a remote tier or when it has none."""
        t = self.tiers
        n = len(rows)
        if t.remote is None or n >= len(hashes):
            return rows
        tail = hashes[n:n + _REMOTE_LOOKUP_BLOCKS]
        found = 0
        for present in t.remote.exists(tail):
            if not present:
                break
            found += 1
        for h in tail[:found]:
            t.index.insert(h, Tier.REMOTE, 0)
        return t.index.match(hashes, t.usable_tiers()) if found else rows

    def estimate(self, kv: KVState) -> tuple[int, float]:
        """``(reused_tokens, load_s)`` :meth:`begin` would place now (see ``KVPool.estimate_prefix``)."""
        t = self.tiers
        if not t.config.enable_prefix_caching:
            return 0, 0.0
        hashes, rows, sources, take = self.match(kv, remote=False)
        take, _, _ = self.rule.choose(hashes, rows, take, remote=False)
        return take * self.page_size, t.cost_model.prefix_load_s(sources[:take], t.block_bytes)

    # ---- placement ----------------------------------------------------------------------------
    def begin(self, kv: KVState, partial: bool) -> PrefixStart:
        """See :meth:`kvtier.cache.pool.KVPool.begin_prefix`."""
        assert not kv.page_ids, "request already holds pages"
        kv.num_prefix_tokens = 0
        if not self.tiers.config.enable_prefix_caching:
            return PrefixStart.READY
        hashes, rows, _, take = self.match(kv)
        take, point, lost = self.rule.choose(hashes, rows, take, remote=True)
        chosen = take
        sources = self.tiers.best_sources(rows[:take])
        if not partial and self._load_pages(rows, sources, take) > self.pages.num_free:
            return PrefixStart.NO_ROOM
        for i in range(take):  # reference resident pages first: loads must not evict them
            if sources[i] == Tier.DEVICE:
                self.pages.ref(int(rows[i][Tier.DEVICE]))
        take = self._fit_to_free_pages(rows, sources, take)
        take = self._lock_sources(hashes, rows, sources, take)
        loads = self.loads.start_all(hashes, rows, sources, take)
        kv.page_ids = [b.page for b in loads]
        self.rule.start(kv, hashes, take, chosen, point, lost)
        if any(b.ok is None for b in loads) or not self.rule.done(kv):
            kv.loads = loads
            self.loading[id(kv)] = kv
            return PrefixStart.LOADING
        self._complete(kv, loads)
        return PrefixStart.READY

    def _load_pages(self, rows, sources: list[Tier], take: int) -> int:
        """Free pages the first ``take`` blocks need: one per load, plus each resident page that
        is free now (referencing it takes it off the free list)."""
        resident = (int(rows[i][Tier.DEVICE]) for i in range(take) if sources[i] == Tier.DEVICE)
        return sum(s != Tier.DEVICE for s in sources[:take]) + sum(self.pages.ref_counts[p] == 0 for p in resident)

    def _fit_to_free_pages(self, rows, sources: list[Tier], take: int) -> int:
        """Shrink ``take`` until its loads fit in the free pages; unreference dropped resident pages."""
        needed = sum(1 for s in sources[:take] if s != Tier.DEVICE)
        while take and needed > self.pages.num_free:  # a dropped resident page is free again
            take -= 1
            if sources[take] == Tier.DEVICE:
                self.pages.unref(int(rows[take][Tier.DEVICE]))
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
            if sources[i] != Tier.DEVICE and not self.tiers.index.lock([hashes[i]], sources[i]):
                for j in range(i, take):
                    if sources[j] == Tier.DEVICE:
                        self.pages.unref(int(rows[j][Tier.DEVICE]))
                return i
        return take

    def finish(self, kv: KVState, wait: bool = False, timeout_s: float | None = None) -> int | None:
        """None while ``kv``'s loads run; else the tokens of its prefix now in its pages. With
        ``wait``, block for them first (at most ``timeout_s`` seconds; None: no limit)."""
        if kv.loads is None:
            return kv.num_prefix_tokens
        if wait:
            self.loads.wait_all(kv.loads, timeout_s)
            self.rule.wait(kv, timeout_s)
        if not self.loads.advance_all(kv.loads) or not self.rule.done(kv):
            return None
        loads, kv.loads = kv.loads, None
        del self.loading[id(kv)]
        self._complete(kv, loads)
        return kv.num_prefix_tokens

    def wait_any(self, timeout_s: float) -> None:
        """Block (GIL released) until one pending load stage ends or ``timeout_s`` passes."""
        for kv in self.loading.values():
            for b in kv.loads:
                if b.ok is None:
                    b.handle.wait(timeout_s)
                    return
            if not self.rule.done(kv):
                self.rule.wait(kv, timeout_s)
                return

    def _complete(self, kv: KVState, loads: list[BlockLoad]) -> None:
        keep = 0
        while keep < len(loads) and loads[keep].ok:
            keep += 1
        keep = self.rule.settle(kv, keep)  # a hybrid pool: at most up to a checkpoint that read back
        self._keep_loaded(kv, loads, keep)
        stats = self.tiers.stats
        by_tier = kv.prefix_tokens_by_tier = dict.fromkeys(stats.hit_tokens, 0)
        hit_tiers, loaded = kv.hit_tiers, []
        for b in loads[:keep]:
            # Each block is a hit of the request once, at the tier that first served it (the
            # pool's counters); a block it computed itself (re-placed after a preemption) never
            # is. Its breakdown credits where each block came from this time: a block loaded in
            # an earlier lookup and now a device copy keeps the tier it was loaded from.
            first = hit_tiers.get(b.hash)
            if b.source != Tier.DEVICE:
                loaded.append(b)
                tier = _TIER_NAMES[b.source]
            else:
                tier = "device" if first in (None, COMPUTED) else first
            if first is None:
                hit_tiers[b.hash] = tier
                stats.hit_tokens[tier] += self.page_size
            if first != COMPUTED:
                by_tier[tier] += self.page_size
        self.pages.register_many([b.page for b in loaded], [b.hash for b in loaded])
        self.tiers.index.touch([b.hash for b in loads[:keep]])
        kv.num_prefix_tokens = keep * self.page_size
        kv.num_registered_blocks = keep

    def _keep_loaded(self, kv: KVState, loads: list[BlockLoad], keep: int) -> None:
        """Keep the first ``keep`` blocks' pages on ``kv``; give back the others."""
        for b in loads[keep:]:
            self.pages.unref(b.page, reuse_first=b.source != Tier.DEVICE)
        kv.page_ids = [b.page for b in loads[:keep]]

    def free(self, kv: KVState) -> None:
        """Drop ``kv``'s pages (see ``KVPool.free``)."""
        if kv.loads is not None:  # preempted while loading: let the copies into its pages end first
            loads, kv.loads = kv.loads, None
            del self.loading[id(kv)]
            self.loads.wait_all(loads)
            self._keep_loaded(kv, loads, keep=0)
            self.rule.free(kv)  # its checkpoint read ends unused
            return
        self.rule.free(kv)
        self.pages.release(kv)

    # ---- registration -------------------------------------------------------------------------
    def register_computed(self, kv: KVState) -> None:
        """Index the pages of ``kv`` that became full and start their write-through copies."""
        if not self.tiers.config.enable_prefix_caching:
            return
        full = kv.num_computed_tokens // self.page_size
        if full <= kv.num_registered_blocks:
            return
        self.hash_blocks(kv, full)
        new = range(kv.num_registered_blocks, full)
        self.pages.register_many([kv.page_ids[b] for b in new], [kv.block_hashes[b] for b in new])
        for b in new:
            self.writes.computed(kv.block_hashes[b], kv.page_ids[b])
            kv.hit_tiers.setdefault(kv.block_hashes[b], COMPUTED)
        kv.num_registered_blocks = full
