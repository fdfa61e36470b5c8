"""Device pages: who references each page, which block it caches, and which free page is reused next.

A page is free when no request and no running copy references it; a free page that still holds
a full block stays indexed as that block's device copy (a cached copy) until it is reused.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvtier.cache.kv_state import KVState
from kvtier.cache.prefix_index import Tier
from kvtier.cache.tiers import PoolTiers


class DevicePages:
    """Reference counts, cached-block hashes and the reuse order of ``num_device_pages`` pages.

    Args:
        tiers: the pool's shared parts (index, policy, stats, clock).
        on_evict: called as ``on_evict([(block_hash, page), ...])`` before cached pages are
            reused (the write-back copies them down then).

    Attributes:
        num_pages: pages in each layer's pool.
        ref_counts: [num_pages] references per page (requests and running copies).
        page_hash: [num_pages] the block each page caches (None: none).
        free_pages: unreferenced pages in reuse order (front first).
    """

    def __init__(self, tiers: PoolTiers, on_evict: Callable[[bytes, int], None]):
        self.tiers = tiers
        self.on_evict = on_evict
        self.num_pages = tiers.config.num_device_pages
        self.page_size = tiers.config.page_size
        self.ref_counts = [0] * self.num_pages
        self.page_hash: list[bytes | None] = [None] * self.num_pages
        self.free_pages: OrderedDict[int, None] = OrderedDict((p, None) for p in range(self.num_pages))

    @property
    def num_free(self) -> int:
        return len(self.free_pages)

    def pages_needed(self, kv: KVState, num_tokens: int) -> int:
        """Pages ``kv`` must add to hold ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.page_size) - len(kv.page_ids))

    def take(self) -> int:
        """A free page, referenced once; a cached block it held is evicted (after ``on_evict``)."""
        return self.take_many(1)[0]

    def take_many(self, n: int) -> list[int]:
        """``n`` free pages, each referenced once; the cached blocks they held are evicted, after
        one ``on_evict`` call for all of them (under write-back: one copy job, one wait)."""
        t = self.tiers
        pages, evicted = [], []
        for _ in range(n):
            page = t.policy.pick_page(self.free_pages, self.page_hash, t.clock())
            del self.free_pages[page]
            self.ref_counts[page] = 1
            pages.append(page)
            if self.page_hash[page] is not None:
                evicted.append((self.page_hash[page], page))
        if evicted:
            self.on_evict(evicted)
            t.index.remove_many([old for old, _ in evicted], Tier.DEVICE)
            for _, page in evicted:
                self.page_hash[page] = None
            t.stats.evictions["device"] += len(evicted)
        return pages

    def ref(self, page: int) -> None:
        if self.ref_counts[page] == 0:
            del self.free_pages[page]
        self.ref_counts[page] += 1

    def unref(self, page: int, reuse_first: bool = False) -> None:
        """Drop one reference; an unreferenced page goes to the back of the reuse order (the
        front with ``reuse_first``: it holds nothing worth keeping)."""
        self.ref_counts[page] -= 1
        if self.ref_counts[page] == 0:
            self.free_pages[page] = None
            if reuse_first:
                self.free_pages.move_to_end(page, last=False)

    def register(self, page: int, h: bytes) -> None:
        """Index ``page`` as the device copy of block ``h`` (unless the block has one already)."""
        self.register_many([page], [h])

    def register_many(self, pages: list[int], hashes: list[bytes]) -> None:
        """:meth:`register` each of ``pages`` as the copy of its block of ``hashes``, in one index call."""
        if not pages:
            return
        for page, h, inserted in zip(pages, hashes, self.tiers.index.insert_many(hashes, Tier.DEVICE, pages).tolist()):
            if inserted:
                self.page_hash[page] = h

    def allocate(self, kv: KVState, num_tokens: int) -> bool:
        """Add pages so ``kv`` holds ``num_tokens`` tokens; False (nothing changed) if too few are free."""
        need = self.pages_needed(kv, num_tokens)
        if need > len(self.free_pages):
            return False
        kv.page_ids += self.take_many(need)
        return True

    def release(self, kv: KVState) -> None:
        """Drop ``kv``'s pages; its last pages become reusable first, its first pages last."""
        for page in reversed(kv.page_ids):
            self.unref(page)
        kv.page_ids = []
        kv.num_registered_blocks = 0

    def truncate(self, kv: KVState, num_tokens: int) -> int:
        """Keep only the pages of ``kv``'s first ``num_tokens // page_size`` full blocks; the rest
        stay cached but unreferenced. Returns the tokens its pages still hold at most."""
        keep = min(num_tokens // self.page_size, len(kv.page_ids))
        for page in reversed(kv.page_ids[keep:]):
            self.unref(page)
        kv.page_ids = kv.page_ids[:keep]
        kv.num_registered_blocks = min(kv.num_registered_blocks, keep)
        return keep * self.page_size
