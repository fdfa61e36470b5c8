"""Tool-aware retention and prefetch: sessions waiting on a tool tell the eviction policy, and the
blocks it says are due come back onto the device before the session returns.

With a resume target (:meth:`Prefetcher.set_target`, ``kvtier serve --resume-ttft-s``) each wait
also carries the cost model's estimate of loading the session's blocks back from the tier they
are demoted to, so the policy starts the prefetch that long (plus a margin) before the expected
return (:func:`kvtier.cache.eviction.plan_resume`).
"""

from __future__ import annotations

from kvtier.cache.block_hash import block_hashes
from kvtier.cache.device_pages import DevicePages
from kvtier.cache.loads import BlockLoad, Loads
from kvtier.cache.prefix_index import Tier
from kvtier.cache.tiers import PoolTiers
from kvtier.options import check_hashable, check_real, checked_block_hashes, checked_token_ids


class Prefetcher:
    """Tool waits in, prefetch loads out (see :class:`kvtier.cache.eviction.ToolAwarePolicy`)."""

    def __init__(self, tiers: PoolTiers, pages: DevicePages, loads: Loads):
        self.tiers, self.pages, self.loads = tiers, pages, loads
        self.pending: list[BlockLoad] = []
        self.returns: dict[object, float] = {}  # waiting session -> its expected return (pool clock)

    def tool_wait(self, session_id, token_ids, expected_wait_s: float) -> None:
        """See :meth:`kvtier.cache.pool.KVPool.tool_wait`."""
        self.tool_wait_blocks(session_id, self.hash_tokens(token_ids), expected_wait_s)

    def hash_tokens(self, token_ids) -> list[bytes]:
        """The block hashes of ``token_ids``' full blocks with this pool's salt (ValueError for
        ids that are not a list or 1-D array of token ids)."""
        ids = checked_token_ids("token_ids", token_ids)
        config = self.tiers.config
        return block_hashes(ids, config.page_size, None, config.salt)

    def tool_wait_blocks(self, session_id, hashes: list[bytes], expected_wait_s: float) -> None:
        """See :meth:`kvtier.cache.pool.KVPool.tool_wait_blocks`."""
        check_hashable("session_id", session_id)
        hashes = checked_block_hashes("hashes", hashes)
        check_real("expected_wait_s", expected_wait_s, min_value=0.0)
        t = self.tiers
        self.returns[session_id] = t.clock() + expected_wait_s
        if t.policy.resume_ttft_s is None:
            t.policy.tool_wait(session_id, hashes, expected_wait_s, t.clock())
        else:
            t.policy.tool_wait(session_id, hashes, expected_wait_s, t.clock(), load_s=self.load_back_s(len(hashes)))

    def set_target(self, resume_ttft_s: float | None) -> None:
        """Plan tool waits for a next-turn TTFT of ``resume_ttft_s`` seconds (None: no target);
        see :meth:`kvtier.cache.pool.KVPool.set_resume_target`."""
        self.tiers.policy.set_resume_target(resume_ttft_s, self.pages.num_pages)

    def load_back_s(self, num_blocks: int) -> float:
        """Seconds the cost model expects for loading ``num_blocks`` demoted blocks back onto the
        device: from the host tier, else the disk tier (0.0 with neither: nothing to load from)."""
        t = self.tiers
        below = t.nearest_local_store()
        if below is None or num_blocks <= 0:
            return 0.0
        return t.cost_model.prefix_load_s([below.tier] * num_blocks, t.block_bytes)

    def tool_return(self, session_id) -> None:
        self.returns.pop(session_id, None)
        self.tiers.policy.tool_return(session_id)

    def returns_within(self, before_s: float, after_s: float) -> int:
        """See :meth:`kvtier.cache.pool.KVPool.returns_within`."""
        now = self.tiers.clock()
        overdue = [sid for sid, t in self.returns.items() if t < now - before_s]
        for sid in overdue:
            del self.returns[sid]
        return sum(t <= now + after_s for t in self.returns.values())

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
