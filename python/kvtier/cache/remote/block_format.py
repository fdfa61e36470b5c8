"""Value format of a block in the remote tier: a 64-byte header, then the payload (one page of
every layer, :mod:`kvtier.cache.block_layout`).

The header has the layout of the disk tier's header (``hip/runtime/disk_tier.h``, its first 64
bytes) with its own magic, integers little-endian:

    offset size  field
         0    4  magic          "KVTR"
         4    4  version        1
         8   16  hash           the block hash (must match the key)
        24    4  num_layers     BlockMeta.num_layers
        28    4  page_size      BlockMeta.page_size (tokens per block)
        32    4  row_bytes      BlockMeta.row_bytes (bytes per token per layer)
        36    4  dtype          BlockMeta.dtype: dtype code (:data:`kvtier.cache.disk_tier.DTYPE_CODES`)
                                in bits 0-7, layout code in bits 8-31 (:mod:`kvtier.cache.block_layout`)
        40    8  payload_bytes  BlockMeta.payload_bytes
        48    4  payload_crc    CRC-32C of the payload (the disk tier's checksum)
        52    8  reserved       zero
        60    4  header_crc     CRC-32C of bytes [0, 60)
        64    -  payload        payload_bytes bytes

The store is not page-aligned storage, so there is no header page: a value is exactly
``HEADER_BYTES + payload_bytes`` long. A value that fails any check is never served.
"""

from __future__ import annotations

import struct

import google_crc32c

from kvtier.cache.block_layout import layout_name
from kvtier.cache.disk_tier import BlockMeta

HEADER_BYTES = 64
MAGIC = b"KVTR"
VERSION = 1
_HEAD = struct.Struct("<4sI16sIIIIQI8s")  # bytes [0, 60)


def crc32c(data) -> int:
    """CRC-32C (Castagnoli) of a bytes-like object; the same values as the native disk tier's."""
    return google_crc32c.value(data if isinstance(data, bytes) else bytes(data))


def header(block_hash: bytes, meta: BlockMeta, payload) -> bytes:
    """The 64-byte header of ``payload`` (bytes-like, ``meta.payload_bytes`` long)."""
    head = _HEAD.pack(MAGIC, VERSION, block_hash, meta.num_layers, meta.page_size, meta.row_bytes, meta.dtype,
                      meta.payload_bytes, crc32c(payload), bytes(8))
    return head + struct.pack("<I", crc32c(head))


def check(value, block_hash: bytes, meta: BlockMeta) -> bool:
    """True if ``value`` (bytes-like) is an intact block ``block_hash`` of layout ``meta``."""
    mv = memoryview(value if isinstance(value, bytes) else bytes(value)).cast("B")
    if len(mv) != HEADER_BYTES + meta.payload_bytes:
        return False
    head = mv[:60]
    if struct.unpack_from("<I", mv, 60)[0] != crc32c(head):
        return False
    magic, version, h, layers, page, row, dtype, nbytes, pcrc, reserved = _HEAD.unpack(head)
    if (magic, version, h, reserved) != (MAGIC, VERSION, block_hash, bytes(8)):
        return False
    if (layers, page, row, dtype, nbytes) != (meta.num_layers, meta.page_size, meta.row_bytes, meta.dtype,
                                              meta.payload_bytes):
        return False
    return pcrc == crc32c(mv[HEADER_BYTES:])  # a copy: google_crc32c takes bytes only


def key_prefix(meta: BlockMeta) -> str:
    """Key namespace of one block layout: ``kvtier/<layout_name(meta)>/``, e.g.
    ``kvtier/kv-<layers>l-<page>p-<row>r-<dtype>d/`` (:func:`kvtier.cache.block_layout.layout_name`).

    The block hash already carries the salt (model and tenant), so the layout is all a key
    adds; a value of another layout under the same key would fail :func:`check` anyway.
    """
    return f"kvtier/{layout_name(meta)}/"
