"""The wire format of KV blocks between a prefill and a decode worker (the pool exports and
imports them: :meth:`kvtier.cache.pool.KVPool.export_blocks` / ``import_blocks``).

Wire format: a transfer body is values back to back, each the remote tier's value of one block
(:mod:`kvtier.cache.remote.block_format`: the 64-byte ``KVTR`` header naming the block hash,
layout and CRC-32C of the payload, then the page-first payload of ``BlockMeta.payload_bytes``).
Every value of one layout has the same length, so a receiver cuts a stream into values without
framing and checks each one as soon as its last byte arrived; a cut stream leaves a partial value
that is never used.
"""

from __future__ import annotations

import torch

from kvtier.cache.disk_tier import BlockMeta
from kvtier.cache.remote import block_format


def value_bytes(meta: BlockMeta) -> int:
    """Bytes of one block on the wire: the 64-byte header and the payload."""
    return block_format.HEADER_BYTES + meta.payload_bytes


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
