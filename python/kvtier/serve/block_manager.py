"""Paged KV block allocator with hash-chained prefix reuse (torch-free).

Pages are ``page_size``-token slots of the per-layer page pools. A full page whose tokens are
known is registered under its chained block hash (:mod:`kvtier.cache.block_hash`); a later
sequence whose prefix hashes match reuses those pages instead of recomputing them. Freed
pages keep their hash and stay reusable until the allocator hands them out again, least
recently freed first. The tiered pool (``kvtier.cache``) replaces this allocator later.
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier.cache.block_hash import block_hashes
from kvtier.serve.request import Sequence


class BlockManager:
    """Page allocation and prefix matching for sequences.

    Args:
        num_pages: pages in each layer's pool.
        page_size: tokens per page.
        enable_prefix_caching: register and reuse full pages by hash.
        salt: tenant salt of the block hashes.
    """

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True, salt: bytes = b""):
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.salt = salt
        self.ref_counts = [0] * num_pages
        self.page_hash: list[bytes | None] = [None] * num_pages
        self.hash_to_page: dict[bytes, int] = {}
        # Unreferenced pages in eviction order (front = next to be reused).
        self.free_pages: OrderedDict[int, None] = OrderedDict((p, None) for p in range(num_pages))

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Pages to add so ``seq`` holds ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.page_size) - len(seq.page_ids))

    def _hash_blocks(self, seq: Sequence, num_blocks: int) -> None:
        """Extend ``seq.block_hashes`` to cover its first ``num_blocks`` full blocks."""
        have = len(seq.block_hashes)
        if have >= num_blocks:
            return
        ps = self.page_size
        parent = seq.block_hashes[-1] if have else None
        seq.block_hashes += block_hashes(seq.token_ids(have * ps, num_blocks * ps), ps, parent, self.salt)

    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """Give a page-less ``seq`` the longest run of cached pages matching its tokens.

        At least one token is always left to compute (its logits are needed). Returns the
        number of tokens reused, also stored as ``seq.num_computed_tokens``.
        """
        assert not seq.page_ids, "sequence already holds pages"
        if not self.enable_prefix_caching:
            return 0
        max_blocks = (seq.num_tokens - 1) // self.page_size
        self._hash_blocks(seq, max_blocks)
        pages = []
        for h in seq.block_hashes[:max_blocks]:
            page = self.hash_to_page.get(h)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            if self.ref_counts[page] == 0:
                del self.free_pages[page]
            self.ref_counts[page] += 1
        seq.page_ids = pages
        seq.num_registered_blocks = len(pages)
        seq.num_computed_tokens = len(pages) * self.page_size
        return seq.num_computed_tokens

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Add pages so ``seq`` can hold ``num_tokens`` tokens; False (nothing changed) if too few are free."""
        need = self.pages_needed(seq, num_tokens)
        if need > len(self.free_pages):
            return False
        for _ in range(need):
            page, _ = self.free_pages.popitem(last=False)
            old = self.page_hash[page]
            if old is not None and self.hash_to_page.get(old) == page:
                del self.hash_to_page[old]
            self.page_hash[page] = None
            self.ref_counts[page] = 1
            seq.page_ids.append(page)
        return True

    def register_computed(self, seq: Sequence) -> None:
        """Register the pages of ``seq`` that became full with computed tokens."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.page_size
        if full <= seq.num_registered_blocks:
            return
        self._hash_blocks(seq, full)
        for b in range(seq.num_registered_blocks, full):
            h, page = seq.block_hashes[b], seq.page_ids[b]
            if h not in self.hash_to_page:
                self.hash_to_page[h] = page
                self.page_hash[page] = h
        seq.num_registered_blocks = full

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; its last pages become reusable first, its first pages last."""
        for page in reversed(seq.page_ids):
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                self.free_pages[page] = None
        seq.page_ids = []
        seq.num_registered_blocks = 0
