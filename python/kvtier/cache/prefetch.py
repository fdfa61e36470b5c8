"""Tool-aware retention and prefetch: sessions waiting on a tool tell the eviction policy, and the
blocks it says are due come back onto the device before the session returns.
"""

from __future__ import annotations

from kvtier.cache.block_hash import block_hashes
from kvtier.cache.device_pages import DevicePages
from kvtier.cache.loads import BlockLoad, Loads
from kvtier.cache.prefix_index import Tier
from kvtier.cache.tiers import PoolTiers
from kvtier.options import check_hashable, check_real, checked_block_hashes, checked_token_ids


class Prefetcher:
    """Tool waits in, prefetch loads out (see :class:`kvtier.cache.policy.ToolAwarePolicy`)."""

    def __init__(self, tiers: PoolTiers, pages: DevicePages, loads: Loads):
        self.tiers, self.pages, self.loads = tiers, pages, loads
        self.pending: list[BlockLoad] = []

    def tool_wait(self, session_id, token_ids, expected_wait_s: float) -> None:
        """See :meth:`kvtier.cache.pool.KVPool.tool_wait`."""
        ids = checked_token_ids("token_ids", token_ids)
        config = self.tiers.config
        self.tool_wait_blocks(session_id, block_hashes(ids, config.page_size, None, config.salt), expected_wait_s)

    def tool_wait_blocks(self, session_id, hashes: list[bytes], expected_wait_s: float) -> None:
        """See :meth:`kvtier.cache.pool.KVPool.tool_wait_blocks`."""
        check_hashable("session_id", session_id)
        hashes = checked_block_hashes("hashes", hashes)
        check_real("expected_wait_s", expected_wait_s, min_value=0.0)
        self.tiers.policy.tool_wait(session_id, hashes, expected_wait_s, self.tiers.clock())

    def tool_return(self, session_id) -> None:
        self.tiers.policy.tool_return(session_id)

    def start_due(self) -> None:
        """Start loading the blocks the policy says are due and no longer on the device."""
        t = self.tiers
        for hashes in t.policy.due_prefetches(t.clock()):
            rows = t.index.match(hashes, t.usable_tiers())
            for h, row, source in zip(hashes, rows, t.best_sources(rows)):
                if source == Tier.DEVICE or self.pages.num_free <= self.pages.num_pages // 4:
                    continue  # prefetch never eats the last quarter of the pool
                if t.index.lock([h], source):  # before taking a page, as for a prefix's loads
                    self.pending.append(self.loads.start(h, row, source))

    def finish(self, wait: bool) -> None:
        """Collect ended prefetches: a loaded block stays as a cached, unreferenced device copy."""
        pending = []
        for b in self.pending:
            if not self.loads.advance(b, wait):
                pending.append(b)
                continue
            if b.ok and not self.tiers.in_tier(b.hash, Tier.DEVICE):
                self.pages.register(b.page, b.hash)
                self.tiers.stats.prefetched_blocks += 1
                self.pages.unref(b.page)
            else:
                self.pages.unref(b.page, reuse_first=True)
        self.pending = pending
