"""Whole blocks in and out of a pool's device pages, for another worker: which leading blocks
a pool holds locally, export of device copies into one page-first buffer, import of checked
payloads as cached device copies.

The wire format the payloads travel in belongs to the caller (prefill/decode transfer:
:mod:`kvtier.cluster.disagg.blocks`). Every function here runs on the thread that owns the pool.
"""

from __future__ import annotations

import torch

from kvtier.cache.device_pages import DevicePages
from kvtier.cache.prefix_index import Tier
from kvtier.cache.tiers import PoolTiers


class BlockIO:
    """The pool's block export/import job (see :meth:`kvtier.cache.pool.KVPool.export_blocks`)."""

    def __init__(self, tiers: PoolTiers, pages: DevicePages):
        self.tiers, self.pages = tiers, pages

    def held_prefix(self, hashes: list[bytes]) -> int:
        """How many leading blocks of ``hashes`` are held in a local tier (device, host, disk)."""
        t = self.tiers
        return int(t.index.match(hashes, t.local_tiers()).shape[0]) if hashes else 0

    def export_blocks(self, hashes: list[bytes]) -> tuple[list[bytes], torch.Tensor] | None:
        """Copy the device pages of blocks ``hashes`` into one page-first buffer.

        Returns:
            ``(hashes, payload)`` with ``payload`` a ``[len(hashes) * block_bytes]`` uint8 CPU
            tensor, block ``i`` at ``i * block_bytes``; None if a block has no device copy (it was
            evicted) or the copy failed (the receiver recomputes).
        """
        t = self.tiers
        if not hashes:
            return [], torch.empty(0, dtype=torch.uint8)
        rows = t.index.match(hashes, [Tier.DEVICE])
        if rows.shape[0] < len(hashes):
            return None
        pages = [int(r[Tier.DEVICE]) for r in rows]
        out = torch.empty(len(pages) * t.block_bytes, dtype=torch.uint8)
        try:
            status = t.copy_engine.gather(t.kv_caches, pages, out).result()
        except Exception:  # noqa: BLE001 - a failed copy is a lost transfer, never a failed request
            return None
        if any(s != 0 for s in status):
            return None
        return list(hashes), out

    def import_blocks(self, blocks: list[tuple[bytes, bytes]]) -> dict[str, int]:
        """Place checked blocks ``(hash, payload bytes)`` into free device pages as cached,
        unreferenced copies (as a prefetch does), indexed by hash so that a prefix match finds
        them.

        A block already held on the device is a ``duplicate``; one that finds no free page is
        ``refused`` (the request recomputes it). Blocks are indexed only after their copy into the
        page ended, so none is used before it is complete; a failed copy counts in
        ``stats.copy_errors`` and as ``refused``.

        Returns:
            counts ``{"stored", "duplicate", "refused"}``.
        """
        t, pages = self.tiers, self.pages
        counts = {"stored": 0, "duplicate": 0, "refused": 0}
        todo = []
        for h, payload in blocks:
            if t.index.match([h], [Tier.DEVICE]).shape[0] == 1 or any(h == x[0] for x in todo):
                counts["duplicate"] += 1
            elif pages.num_free == 0:
                counts["refused"] += 1
            else:
                todo.append((h, payload, pages.take()))  # referenced until registered
        if not todo:
            return counts
        staging = torch.frombuffer(bytearray(b"".join(p for _, p, _ in todo)), dtype=torch.uint8)
        try:
            status = t.copy_engine.scatter(staging, t.kv_caches, [pg for _, _, pg in todo]).result()
        except Exception:  # noqa: BLE001 - counted, the blocks are recomputed
            status = [-1] * len(todo)
        for (h, _, page), s in zip(todo, status):
            if s == 0:
                pages.register(page, h)
                counts["stored"] += 1
            else:
                t.stats.copy_errors += 1
                counts["refused"] += 1
            pages.unref(page, reuse_first=s != 0)
        return counts
