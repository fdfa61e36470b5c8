"""Disk tier (native ``kvtier._C.DiskTier``): one checksummed file per KV block (one page of every
layer; :mod:`kvtier.cache.block_layout` describes the page).

File ``<dir>/<32 hex digits of the block hash>.kvb`` (format version 2): a 4096-byte header
page (magic ``KVTB``, version, hash, num_layers, page_size, row_bytes, dtype code, payload
length, CRC-32C of the payload, CRC-32C of the header, then zeros) followed by the payload,
zero-padded to a multiple of 4096 bytes (``hip/runtime/disk_tier.h`` has the byte table and the
crash-safety argument). Writes go to a temp file renamed into place; a block that fails any
check on read or at start-up is deleted, never served. O_DIRECT is used where the filesystem
accepts it, buffered I/O elsewhere; buffers from :func:`aligned_empty` skip the bounce copy.

Bytes of one K2 block (61 layers x page_size tokens x 576 values x 2 bytes in bf16):
1,124,352 payload bytes (a 1,130,496-byte file) at page_size 16, 4,497,408 (a 4,501,504-byte
file) at page_size 64; fp8 halves the payload.
"""

from __future__ import annotations

import enum
from dataclasses import astuple, dataclass
from pathlib import Path

import torch

from kvtier import _C

DISK_ALIGN = 4096  # O_DIRECT alignment: buffers on this boundary skip the bounce copy

DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float8_e4m3fn: 4,
               torch.float8_e4m3fnuz: 5}


class DiskStatus(enum.IntEnum):
    OK = 0
    MISSING = 1
    CORRUPT = 2      # failed a check; the file was deleted
    FULL = 3         # over capacity, or the filesystem is full
    IO_ERROR = 4
    TOO_LARGE = 5    # larger than the whole capacity
    BAD_ARGUMENT = 6


@dataclass(frozen=True)
class BlockMeta:
    """What a block file records besides its payload (a read must expect the same).

    Attributes:
        num_layers: layers in the block.
        page_size: tokens per block.
        row_bytes: bytes per token per layer (576 * 2 for K2 in bf16).
        dtype: format code: the dtype's code from :data:`DTYPE_CODES` in bits 0-7 and the page's
            layout code in bits 8-31 (0 for the page-first ``[page_size, row]`` page; see
            :class:`kvtier.cache.block_layout.BlockLayout`, which builds metas of any page).
        payload_bytes: ``num_layers * page_size * row_bytes``.
    """

    num_layers: int
    page_size: int
    row_bytes: int
    dtype: int
    payload_bytes: int

    @staticmethod
    def of_pools(pools: list[torch.Tensor]) -> BlockMeta:
        """Meta of one page-first block of per-layer pools ``[num_pages, page_size, row]``."""
        p = pools[0]
        row_bytes = p.shape[2] * p.element_size()
        return BlockMeta(len(pools), p.shape[1], row_bytes, DTYPE_CODES[p.dtype], len(pools) * p.shape[1] * row_bytes)


class DiskTier:
    """Block files in ``directory`` within ``capacity_bytes`` (file sizes, padding included).

    Args:
        directory: created if missing; intact blocks already there are found at start-up.
        capacity_bytes: budget for the block files.
        try_direct_io: use O_DIRECT when the filesystem allows it.

    Raises:
        RuntimeError: the directory cannot be created or read.
    """

    def __init__(self, directory: str | Path, capacity_bytes: int, try_direct_io: bool = True):
        self.native = _C.DiskTier(str(directory), int(capacity_bytes), try_direct_io)
        self._directory = Path(directory)

    def write(self, block_hash: bytes, meta: BlockMeta, payload: torch.Tensor) -> DiskStatus:
        """Store ``payload`` (a contiguous CPU tensor of ``meta.payload_bytes`` bytes) synchronously."""
        _check_buffer(payload, meta.payload_bytes)
        return DiskStatus(self.native.write(block_hash, astuple(meta), payload.data_ptr()))

    def read(self, block_hash: bytes, meta: BlockMeta, out: torch.Tensor) -> DiskStatus:
        """Read a block into ``out`` synchronously; CORRUPT blocks are deleted."""
        _check_buffer(out, meta.payload_bytes)
        return DiskStatus(self.native.read(block_hash, astuple(meta), out.data_ptr(), meta.payload_bytes))

    def blocks(self) -> list[tuple[bytes, BlockMeta]]:
        """The intact blocks known to the tier (found at start-up or written since)."""
        return [(h, BlockMeta(*m)) for h, m in self.native.blocks()]

    def remove(self, block_hash: bytes) -> bool:
        return self.native.remove(block_hash)

    def contains(self, block_hash: bytes) -> bool:
        return self.native.contains(block_hash)

    def path(self, block_hash: bytes) -> Path:
        return Path(self.native.block_path(block_hash))

    @property
    def used_bytes(self) -> int:
        return self.native.used_bytes()

    @property
    def capacity_bytes(self) -> int:
        return self.native.capacity_bytes()

    @property
    def directory(self) -> Path:
        """The directory holding the block files."""
        return self._directory

    @property
    def direct_io(self) -> bool:
        return self.native.direct_io()

    @staticmethod
    def file_bytes(payload_bytes: int) -> int:
        """Bytes one block file takes: ``4096 + round_up(payload_bytes, 4096)``."""
        return _C.DiskTier.file_bytes_for(payload_bytes)


def aligned_empty(nbytes: int, pin_memory: bool = False) -> torch.Tensor:
    """An uninitialised ``[nbytes]`` uint8 CPU tensor whose first byte sits on a 4096-byte page.

    Disk reads and writes go straight between such a buffer and the block file with O_DIRECT;
    any other buffer costs a copy through the tier's bounce buffer (same result, slower). The
    tensor is a view into a slightly larger allocation, which it keeps alive.

    Args:
        nbytes: length in bytes (>= 0).
        pin_memory: allocate page-locked host memory (for device copies).

    Example:
        >>> buf = aligned_empty(3 * 4096 + 17)
        >>> buf.data_ptr() % DISK_ALIGN, buf.numel()
        (0, 12305)
    """
    raw = torch.empty(nbytes + DISK_ALIGN, dtype=torch.uint8, pin_memory=pin_memory)
    shift = -raw.data_ptr() % DISK_ALIGN
    return raw[shift:shift + nbytes]


def _check_buffer(t: torch.Tensor, nbytes: int) -> None:
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() * t.element_size() < nbytes:
        raise ValueError(f"buffer must be a contiguous CPU tensor of at least {nbytes} bytes")
