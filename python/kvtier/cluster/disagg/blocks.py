"""KV blocks between a prefill and a decode worker: export from device pages, the wire format,
and import into a pool as cached device copies.

Wire format: a transfer body is values back to back, each the remote tier's value of one block
(:mod:`kvtier.cache.remote.block_format`: the 64-byte ``KVTR`` header naming the block hash,
layout and CRC-32C of the payload, then the page-first payload of ``BlockMeta.payload_bytes``).
Every value of one layout has the same length, so a receiver cuts a stream into values without
framing and checks each one as soon as its last byte arrived; a cut stream leaves a partial value
that is never used.

All pool functions here run on the thread that owns the pool (the engine thread).
"""

from __future__ import annotations

import torch

from kvtier.cache.disk_tier import BlockMeta
from kvtier.cache.prefix_index import Tier
from kvtier.cache.remote import block_format

LOCAL_TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)


def value_bytes(meta: BlockMeta) -> int:
    """Bytes of one block on the wire: the 64-byte header and the payload."""
    return block_format.HEADER_BYTES + meta.payload_bytes


def held_prefix(pool, hashes: list[bytes]) -> int:
    """How many leading blocks of ``hashes`` ``pool`` holds in a local tier (device, host, disk)."""
    tiers = [t for t in LOCAL_TIERS if t == Tier.DEVICE or (t == Tier.HOST and pool.host is not None)
             or (t == Tier.DISK and pool.disk is not None)]
    return int(pool.index.match(hashes, tiers).shape[0]) if hashes else 0


def export_blocks(pool, hashes: list[bytes]) -> tuple[list[bytes], torch.Tensor] | None:
    """Copy the device pages of blocks ``hashes`` into one page-first buffer.

    Returns:
        ``(hashes, payload)`` with ``payload`` a ``[len(hashes) * payload_bytes]`` uint8 CPU
        tensor, block ``i`` at ``i * payload_bytes``; None if a block has no device copy (it was
        evicted) or the copy failed: the caller stops sending (the receiver recomputes).
    """
    if not hashes:
        return [], torch.empty(0, dtype=torch.uint8)
    rows = pool.index.match(hashes, [Tier.DEVICE])
    if rows.shape[0] < len(hashes):
        return None
    pages = [int(r[Tier.DEVICE]) for r in rows]
    out = torch.empty(len(pages) * pool.block_bytes, dtype=torch.uint8)
    try:
        status = pool.copy_engine.gather(pool.kv_caches, pages, out).result()
    except Exception:  # noqa: BLE001 - a failed copy is a lost transfer, never a failed request
        return None
    if any(s != 0 for s in status):
        return None
    return list(hashes), out


def encode_values(hashes: list[bytes], payload: torch.Tensor, meta: BlockMeta) -> bytes:
    """The wire values of blocks ``hashes`` whose payloads lie back to back in ``payload``."""
    n, raw = meta.payload_bytes, payload.numpy().tobytes()
    parts = []
    for i, h in enumerate(hashes):
        chunk = raw[i * n:(i + 1) * n]
        parts += [block_format.header(h, meta, chunk), chunk]
    return b"".join(parts)


class ValueReader:
    """Cuts a byte stream into checked block values as the bytes arrive.

    ``feed(data)`` returns the ``(hash, payload bytes)`` of every value completed by ``data``
    that passed the header and CRC-32C checks; the others are counted in :attr:`corrupt`.
    :meth:`close` counts a partial value left at the end (a cut stream) in :attr:`truncated`.
    """

    def __init__(self, meta: BlockMeta):
        self.meta, self.size = meta, value_bytes(meta)
        self.buf = bytearray()
        self.corrupt = self.truncated = 0

    def feed(self, data: bytes) -> list[tuple[bytes, bytes]]:
        self.buf += data
        good = []
        while len(self.buf) >= self.size:
            value = bytes(self.buf[:self.size])
            del self.buf[:self.size]
            h = value[8:24]
            if block_format.check(value, h, self.meta):
                good.append((h, value[block_format.HEADER_BYTES:]))
            else:
                self.corrupt += 1
        return good

    def close(self) -> None:
        if self.buf:
            self.truncated += 1
            self.buf.clear()


def import_blocks(pool, blocks: list[tuple[bytes, bytes]]) -> dict[str, int]:
    """Place checked blocks into free device pages of ``pool`` as cached, unreferenced copies
    (as a prefetch does), indexed by hash so that a request's prefix match finds them.

    A block already held on the device is a ``duplicate``; one that finds no free page is
    ``refused`` (the request recomputes it). Blocks are indexed only after their copy into the
    page ended, so none is used before it is complete.

    Returns:
        counts ``{"stored", "duplicate", "refused"}``.
    """
    counts = {"stored": 0, "duplicate": 0, "refused": 0}
    todo = []
    for h, payload in blocks:
        if pool.index.match([h], [Tier.DEVICE]).shape[0] == 1 or any(h == t[0] for t in todo):
            counts["duplicate"] += 1
        elif pool.num_free_pages == 0:
            counts["refused"] += 1
        else:
            todo.append((h, payload, pool.pages.take()))  # referenced until registered
    if not todo:
        return counts
    staging = torch.frombuffer(bytearray(b"".join(p for _, p, _ in todo)), dtype=torch.uint8)
    try:
        status = pool.copy_engine.scatter(staging, pool.kv_caches, [pg for _, _, pg in todo]).result()
    except Exception:  # noqa: BLE001 - counted, the blocks are recomputed
        status = [-1] * len(todo)
    for (h, _, page), s in zip(todo, status):
        if s == 0:
            pool.pages.register(page, h)
            counts["stored"] += 1
        else:
            pool.stats.copy_errors += 1
            counts["refused"] += 1
        pool.pages.unref(page, reuse_first=s != 0)
    return counts
