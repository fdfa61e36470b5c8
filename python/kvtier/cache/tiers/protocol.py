"""The one interface of the pool's lower tiers (host memory, disk, remote store): :class:`TierStore`.

The pool's loads and writes (:mod:`kvtier.cache.loads`, :mod:`kvtier.cache.writes`) are written
against this protocol only: they ask a tier for a block's bytes or give it some, and learn from
the tier what a failed read means for the index. The copy engine moves bytes between device
pages and host buffers and knows no tier.

Blocks are page-first (:mod:`kvtier.cache.block_layout`): ``block_bytes`` uint8 bytes each,
keyed by their 16-byte block hash. Every call returns at once with a
:class:`kvtier.cache.seams.CopyJob` (``done``/``wait``/``result``/``run_s``) whose ``result()``
gives one status per block, 0 = OK: a tier that is synchronous (host memory) returns a job that
is already done. A read is OK only when the bytes are the block's (the disk and remote tiers
check a header and a CRC-32C): a failed read (missing, corrupt, short, a store error or timeout)
is a non-zero status, never a wrong block, and :meth:`TierStore.failed_read` says what it means.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from kvtier.cache.prefix_index import Tier
from kvtier.cache.seams import CopyJob


class ReadFailure(NamedTuple):
    """What a failed read of one block means (see :meth:`TierStore.failed_read`).

    Attributes:
        drop: the tier no longer holds the block (missing, or corrupt and deleted): its index
            entry is removed, so no later lookup finds it there.
        error: count it as a copy error (``PoolStats.copy_errors``); a lossy tier's misses are
            counted in the tier's own stats instead.
    """

    drop: bool
    error: bool


class Admit(enum.IntEnum):
    """Whether a tier takes one more block now (see :meth:`TierStore.admit`)."""

    YES = 0
    FULL = 1   # no room (counted in ``PoolStats.stores_refused``)
    SKIP = 2   # not now (a store left alone after a failure): not written, not counted


class Stored(NamedTuple):
    """How a write of one block ended (see :meth:`TierStore.stored`).

    Attributes:
        indexed: the block is now recorded in the index as held by the tier (its bytes count
            in ``PoolStats.bytes_written``).
        refused: the tier had no room (``PoolStats.stores_refused``).
        error: count it as a copy error (``PoolStats.copy_errors``).
    """

    indexed: bool
    refused: bool
    error: bool


class DoneJob:
    """A :class:`kvtier.cache.seams.CopyJob` that already ended with ``statuses``."""

    __slots__ = ("run_s", "statuses")

    def __init__(self, statuses: list[int], run_s: float = 0.0):
        self.statuses, self.run_s = statuses, run_s

    def done(self) -> bool:
        return True

    def wait(self, timeout_s: float | None = None) -> bool:
        return True

    def result(self) -> list[int]:
        return self.statuses


@runtime_checkable
class TierStore(Protocol):
    """A tier below the device pages, holding page-first blocks by block hash.

    Attributes:
        tier: which :class:`Tier` this is (the index column its copies are recorded in).
        name: its name in ``PoolStats`` counters (``"host"``, ``"disk"``, ``"remote"``).
        batch_reads: the blocks of one prefix in this tier are read in one call and copied to
            the device in one copy job (cheap random access: host memory); otherwise one block
            per call, so each can end (or fail) on its own.
        spills: under write-back, a block is written to this tier when its host copy is
            evicted (the disk); otherwise (and always under write-through) when its host copy
            is made (a shared remote store, which other workers read at once).
        copies_input: :meth:`write` copies its input before it returns (the host slot written
            from need not stay locked until the write ended).
        local: the tier is this worker's own (host memory, a local disk), not a shared store.
    """

    tier: Tier
    name: str
    batch_reads: bool
    spills: bool
    copies_input: bool
    local: bool

    def capacity_blocks(self) -> int:
        """How many blocks the tier can hold in all (0: none; a remote store: unknown, -1)."""
        ...

    def contains(self, hashes: Sequence[bytes]) -> list[bool]:
        """Whether the tier holds each block now (a store that does not answer: all False)."""
        ...

    def read(self, hashes: Sequence[bytes], slots: Sequence[int]) -> tuple[torch.Tensor, CopyJob]:
        """Start reading blocks ``hashes`` (``slots``: their slots in this tier as the index
        records them; tiers keyed by hash ignore them).

        Returns:
            ``(buf, job)``: ``buf`` a contiguous CPU ``[len(hashes) * block_bytes]`` (or
            ``[len(hashes), block_bytes]``) uint8 tensor that holds block ``i``'s bytes once
            ``job.result()[i] == 0``; the bytes of a block whose status is not 0 are undefined.
            The caller keeps the blocks' copies locked in the index until it is done with
            ``buf`` (a host read may return a view of the slots themselves).
        """
        ...

    def write(self, hashes: Sequence[bytes], blocks: torch.Tensor) -> CopyJob:
        """Start storing ``blocks`` (contiguous CPU uint8, ``len(hashes) * block_bytes`` bytes)
        under ``hashes``. ``blocks`` must stay unchanged until the job ended (the remote tier
        copies it before returning). Status 0: stored (a lossy tier may still drop it later)."""
        ...

    def evict(self, hashes: Sequence[bytes]) -> int:
        """Drop blocks ``hashes`` from the tier (what is not there is skipped); returns how many
        were dropped. The caller removes their index entries."""
        ...

    def failed_read(self, status: int) -> ReadFailure:
        """What read status ``status`` (non-zero) means for the block's index entry."""
        ...

    def admit(self, pending: Collection[bytes]) -> Admit:
        """Whether one more block can be written now, beside the ``pending`` writes (hashes of
        this tier's writes not collected yet); may evict the tier's least recently used
        unreferenced blocks to make room."""
        ...

    def stored(self, block_hash: bytes, status: list[int]) -> Stored:
        """A pool write of ``block_hash`` ended with ``status`` (its job's result): index the
        block when it was stored and say how it ended."""
        ...
