"""What the pool takes from outside: the copy engine, the disk tier and the clock (docs/architecture.md, Seams).

:class:`kvtier.cache.pool.KVPool` is written against these :class:`typing.Protocol` s only.
The native implementations are :class:`kvtier.transfer.CopyEngine` (its handles
:class:`kvtier.transfer.CopyHandle`), :class:`kvtier.cache.disk_tier.DiskTier` and
``time.monotonic``; the simulator passes virtual-time ones (:mod:`kvtier.sim.copies`:
``SimCopyEngine``, ``SimCopyHandle``, ``SimDisk``, ``VirtualClock``). Another copy engine (e.g.
one that moves device pages on a GPU stream) plugs in by providing :class:`CopyEngine`.

The copy engine moves bytes and knows no tier: it copies between device pages and host buffers,
and runs the :class:`IOJob` s a tier builds (the disk tier's reads and writes,
:class:`kvtier.cache.tiers.disk.DiskJob`) on its I/O workers without knowing what they read
or write.

Blocks are "page first": block ``i`` of a staging buffer holds page ``pages[i]`` of every layer,
back to back (``BlockMeta.payload_bytes`` bytes per block).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from kvtier.cache.disk_tier import BlockMeta, DiskStatus


@runtime_checkable
class CopyJob(Protocol):
    """A submitted copy (what :class:`CopyEngine` methods return).

    Attributes:
        run_s: after :meth:`result`, seconds the job spent copying (without queueing); the
            cost model learns tier bandwidths from it.
    """

    run_s: float

    def done(self) -> bool:
        """True once the job ended (successfully or not); never blocks."""
        ...

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the job ends or ``timeout_s`` seconds pass (None: no limit); True if it ended."""
        ...

    def result(self) -> list[int]:
        """Per-block status after waiting for the job: 0 = ok, else an error code (for a disk
        tier's I/O jobs a :class:`kvtier.cache.disk_tier.DiskStatus`).

        Raises:
            kvtier.transfer.CopyError: the job failed as a whole.
        """
        ...


@runtime_checkable
class DiskStore(Protocol):
    """The disk tier: page-first blocks stored by 16-byte block hash, within a byte budget.

    Attributes:
        capacity_bytes: the tier's budget in file bytes (``DiskTier.file_bytes(payload)`` each).
        used_bytes: file bytes its blocks take now (of every pool sharing it).
    """

    @property
    def capacity_bytes(self) -> int: ...

    @property
    def used_bytes(self) -> int: ...

    def write(self, block_hash: bytes, meta: BlockMeta, payload: torch.Tensor) -> DiskStatus:
        """Store ``payload`` ([>= meta.payload_bytes] bytes) under ``block_hash``, synchronously."""
        ...

    def read(self, block_hash: bytes, meta: BlockMeta, out: torch.Tensor) -> DiskStatus:
        """Read block ``block_hash`` stored with layout ``meta`` into ``out``, synchronously."""
        ...

    def remove(self, block_hash: bytes) -> bool:
        """Drop a block; True if it was there."""
        ...

    def contains(self, block_hash: bytes) -> bool: ...

    def blocks(self) -> list[tuple[bytes, BlockMeta]]:
        """Every stored block with its layout (read at start-up to recover the pool's own)."""
        ...


@runtime_checkable
class IOJob(Protocol):
    """Blocking I/O over ``num_blocks`` page-first blocks, built by a tier and run by a copy
    engine (:meth:`CopyEngine.run_io`), which learns only its size. The job holds every buffer
    it reads or writes until it is dropped.

    Attributes:
        num_blocks: blocks it reads or writes (what a timed engine charges it for).
    """

    num_blocks: int

    def run(self) -> list[int]:
        """Do the I/O now on the calling thread; one status per block, 0 = OK."""
        ...

    def submit_native(self, workers) -> int:
        """Queue the same I/O on native worker threads (a ``kvtier._C.CopyEngine``, which runs
        it without the GIL); returns the native job handle."""
        ...


@runtime_checkable
class CopyEngine(Protocol):
    """Moves page-first blocks between device pages and host memory, asynchronously, and runs
    tiers' blocking I/O on its own workers.

    ``pools`` are the model's per-layer page pools ``[num_pages, page_size, row]`` (one per
    layer, same shape, dtype and strides); ``pages`` are page ids; ``staging`` is a contiguous
    host buffer of at least ``len(pages)`` blocks. Each method returns at once; the bytes are in
    place when the returned job's :meth:`CopyJob.result` says 0 for them.
    """

    def gather(self, pools: Sequence[torch.Tensor], pages: Sequence[int], staging: torch.Tensor) -> CopyJob:
        """Copy ``pages`` of every layer pool into ``staging`` (device -> host)."""
        ...

    def scatter(self, staging: torch.Tensor, pools: Sequence[torch.Tensor], pages: Sequence[int]) -> CopyJob:
        """Copy blocks from ``staging`` into ``pages`` of every layer pool (host -> device)."""
        ...

    def run_io(self, job: IOJob) -> CopyJob:
        """Run ``job`` on the engine's I/O workers (a queue of their own: a copy the serving loop
        waits for never queues behind I/O that syncs to storage); the returned job's
        ``result()`` is ``job``'s statuses."""
        ...


class JobPart:
    """Block ``i`` of a copy job shared by ``n`` blocks, as a :class:`CopyJob` of its own: its
    status (-1 when the job failed as a whole without per-block statuses) and its share of the
    job's worker time (what the cost model learns a block's bandwidth from)."""

    __slots__ = ("job", "i", "n")

    def __init__(self, job: CopyJob, i: int, n: int):
        self.job, self.i, self.n = job, i, n

    def done(self) -> bool:
        return self.job.done()

    def wait(self, timeout_s: float | None = None) -> bool:
        return self.job.wait(timeout_s)

    def result(self) -> list[int]:
        statuses = self.job.result()
        return [statuses[self.i]] if self.i < len(statuses) else [-1]

    @property
    def run_s(self) -> float:
        return self.job.run_s / self.n


class Clock(Protocol):
    """Seconds, monotonic (``time.monotonic`` is one): what eviction TTLs and prefetch times use."""

    def __call__(self) -> float: ...
