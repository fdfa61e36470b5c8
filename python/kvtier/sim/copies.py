"""Virtual time for the real pool: a clock, a copy engine whose jobs end at modelled times, and
a disk tier that keeps no data.

:class:`kvtier.cache.pool.KVPool` takes a ``copy_engine``, a ``disk`` and a ``clock``; given these,
its code runs unchanged (the same locks, stages, error paths and cost-model updates) while no
byte is copied: a job's end time is computed from the bytes it stands for and the link it uses,
and its effect (an I/O job's reads or writes, e.g. a block stored on or read from the disk tier)
happens when the pool collects it.

A job on a :class:`Link` starts when the link is free (jobs on one link queue for its bandwidth
and per-job time; their latencies overlap) and ends ``Link.copy_s(bytes)`` later. A pool that waits
for a job (``handle.wait()`` / ``handle.result()`` before it ended: a write-back eviction, a
preempted load) *stalls*: its clock jumps to the job's end, as the real engine's thread would
block.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtier.sim.hardware import Link
from kvtier.cache.cost_model import CostModel, TierCost
from kvtier.cache.disk_tier import BlockMeta, DiskStatus, DiskTier
from kvtier.cache.prefix_index import Tier
from kvtier.cache.seams import CopyJob
from kvtier.cache.tiers import HostStore
from kvtier.options import check_int


@dataclass(eq=False)
class VirtualClock:
    """Virtual seconds, callable like ``time.monotonic`` (what ``KVPool(clock=...)`` takes).

    Attributes:
        now: the current time in seconds; only moves forward.
    """

    now: float = 0.0

    def __call__(self) -> float:
        return self.now

    def advance_to(self, t: float) -> None:
        """Move to ``t`` seconds if that is later than now."""
        self.now = max(self.now, t)


class SimDisk:
    """The disk tier's bookkeeping without files: which blocks it holds and the bytes they take.

    Sizes follow :class:`kvtier.cache.disk_tier.DiskTier` (``file_bytes(payload)`` per block), so
    the pool's budget arithmetic is unchanged. Several pools may share one instance (a store
    reachable from several workers): ``on_store`` callbacks ``(block_hash)`` hear of every block
    stored; a worker tells its own pool's writes by its copy engine's
    :attr:`SimCopyEngine.collecting`.

    Args:
        capacity_bytes: budget in file bytes.

    Attributes:
        capacity_bytes, used_bytes: the budget and the file bytes held now (the fields of
            :class:`kvtier.cache.seams.DiskStore`).
    """

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes, self.used_bytes = check_int("capacity_bytes", capacity_bytes, min_value=0), 0
        self._blocks: dict[bytes, BlockMeta] = {}
        self.on_store: list[Callable[[bytes], None]] = []

    def write(self, block_hash: bytes, meta: BlockMeta, payload=None) -> DiskStatus:
        """Record a block (as a finished write would; ``payload`` is ignored); FULL when it does not fit."""
        if block_hash in self._blocks:
            return DiskStatus.OK
        size = DiskTier.file_bytes(meta.payload_bytes)
        if self.used_bytes + size > self.capacity_bytes:
            return DiskStatus.FULL
        self._blocks[block_hash] = meta
        self.used_bytes += size
        for listener in self.on_store:
            listener(block_hash)
        return DiskStatus.OK

    def read(self, block_hash: bytes, meta: BlockMeta, out=None) -> DiskStatus:
        """OK when the block is held with this layout (``out`` is left alone); MISSING when absent;
        CORRUPT (and dropped) when its layout differs, as the real tier's header check would find."""
        have = self._blocks.get(block_hash)
        if have is None:
            return DiskStatus.MISSING
        if have != meta:
            self.remove(block_hash)
            return DiskStatus.CORRUPT
        return DiskStatus.OK

    def remove(self, block_hash: bytes) -> bool:
        meta = self._blocks.pop(block_hash, None)
        if meta is None:
            return False
        self.used_bytes -= DiskTier.file_bytes(meta.payload_bytes)
        return True

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def blocks(self) -> list[tuple[bytes, BlockMeta]]:
        return list(self._blocks.items())


class SimCopyHandle:
    """A copy job ending at ``end_s`` (the :class:`kvtier.transfer.CopyHandle` interface).

    Attributes:
        start_s, end_s: when the job starts moving bytes and when it ends (virtual seconds).
        run_s: after ``result()``: ``end_s - start_s`` (service time without queueing, as the
            native engine reports its worker time).
    """

    def __init__(self, engine: SimCopyEngine, start_s: float, end_s: float, num_blocks: int,
                 effect: Callable[[], list[int]] | None):
        self._engine, self.start_s, self.end_s, self.num_blocks = engine, start_s, end_s, num_blocks
        self._effect = effect
        self._result: list[int] | None = None
        self.run_s = 0.0

    def done(self) -> bool:
        return self._result is not None or self._engine.clock.now >= self.end_s

    def wait(self, timeout_s: float | None = None) -> bool:
        """Stall the clock until the job ends (or ``timeout_s`` passes); True if it ended."""
        clock = self._engine.clock
        clock.advance_to(self.end_s if timeout_s is None else min(self.end_s, clock.now + timeout_s))
        return self.done()

    def result(self) -> list[int]:
        """Per-block status (0 = ok); stalls until the job ended, then applies its effect once."""
        if self._result is None:
            self.wait()
            self._result = self._engine._apply(self._effect) if self._effect is not None else [0] * self.num_blocks
            self.run_s = self.end_s - self.start_s
        return self._result


@dataclass(frozen=True)
class TierLinks:
    """The links a worker's tiers copy over, and the modelled bytes of one block.

    Attributes:
        block_bytes: bytes one pool block stands for (KV of ``page_size`` tokens, all layers; the
            pool's own blocks are far smaller placeholders).
        host: one device's host link, each direction (the two directions queue separately).
        disk: the disk tier's link as seen from host memory (reads and writes share it).
    """

    block_bytes: float
    host: Link
    disk: Link

    def cost_model(self, pool_block_bytes: int, prefill_tok_s: float) -> CostModel:
        """The pool's starting cost model, in the pool's units.

        The pool measures blocks in its own (placeholder) bytes, so bandwidths are scaled by
        ``pool_block_bytes / block_bytes``; a disk load goes disk -> host -> device, so its rate is
        the two links in series. As on a real pool, observed copies and steps then update it.
        """
        scale, host, disk = pool_block_bytes / self.block_bytes, self.host, self.disk
        serial = 1.0 / (1.0 / disk.bandwidth_Bps + 1.0 / host.bandwidth_Bps)
        return CostModel(tiers={Tier.HOST: TierCost(host.latency_s, host.bandwidth_Bps * scale),
                                Tier.DISK: TierCost(disk.latency_s + host.latency_s, serial * scale)},
                         prefill_tok_s=prefill_tok_s)


class SimCopyEngine:
    """The copy engine's interface, timed on modelled links instead of copying.

    Args:
        clock: the pool's clock.
        links: the links and the bytes one block stands for; I/O jobs (:meth:`run_io`) go over
            the node's storage link (``links.disk``).

    Attributes:
        bytes_moved: modelled bytes per link name (``"device->host"``, ``"host->device"``,
            ``"disk"``: the I/O jobs' link).
        collecting: True while a job of this engine takes effect (the pool collects it): what
            a worker sharing a :class:`SimDisk` tells its own writes by.
    """

    def __init__(self, clock: VirtualClock, links: TierLinks):
        self.clock = clock
        self.block_bytes = float(links.block_bytes)
        self._links = {"device->host": links.host, "host->device": links.host, "disk": links.disk}
        self._free_at = dict.fromkeys(self._links, 0.0)
        self._ends: list[tuple[float, int, SimCopyHandle]] = []  # heap of uncollected jobs by end time
        self._order = itertools.count()
        self.bytes_moved = dict.fromkeys(self._links, 0.0)
        self.collecting = False
        self._layouts: dict[BlockMeta, tuple[float, float]] = {}

    def add_layout(self, meta: BlockMeta, link_bytes: float, disk_bytes: float) -> None:
        """Time I/O jobs of objects of layout ``meta`` (another kind of cached object than the pool's
        blocks) by their own modelled bytes: ``disk_bytes`` each on the storage link; a
        read then goes on to the device, ``link_bytes`` each on the host -> device link (such an
        object is not scattered into device pages by a job of its own)."""
        self._layouts[meta] = (float(link_bytes), float(disk_bytes))

    def _submit(self, link_name: str, num_blocks: int, effect=None) -> SimCopyHandle:
        return self.submit_bytes(link_name, num_blocks * self.block_bytes, effect, num_blocks=num_blocks)

    def submit_bytes(self, link_name: str, nbytes: float, effect=None, *, not_before: float = 0.0,
                     num_blocks: int = 1) -> SimCopyHandle:
        """A job of ``nbytes`` modelled bytes on link ``link_name`` (``"device->host"``,
        ``"host->device"``, ``"disk"``) that starts when the link is free and not before
        ``not_before`` seconds (a job that follows another one: a disk read going on to the device).
        ``effect`` runs when the pool collects it.

        Raises:
            KeyError: an unknown link name.
        """
        link, now = self._links[link_name], self.clock.now
        start = max(now, not_before, self._free_at[link_name])
        self._free_at[link_name] = start + link.busy_s(nbytes)
        handle = SimCopyHandle(self, start, start + link.copy_s(nbytes), num_blocks, effect)
        heapq.heappush(self._ends, (handle.end_s, next(self._order), handle))
        self.bytes_moved[link_name] += nbytes
        return handle

    def gather(self, pools, pages: Sequence[int], staging) -> SimCopyHandle:
        """Device pages to host memory (device -> host link)."""
        return self._submit("device->host", len(pages))

    def scatter(self, staging, pools, pages: Sequence[int]) -> SimCopyHandle:
        """Host memory to device pages (host -> device link)."""
        return self._submit("host->device", len(pages))

    def run_io(self, job) -> SimCopyHandle:
        """An I/O job (:class:`kvtier.cache.seams.IOJob`, a disk tier's ``DiskJob``) on the storage
        link, a block's modelled bytes each (a layout of :meth:`add_layout`: its own bytes, and a
        read goes on over the host -> device link); it runs (``job.run()``: for a
        :class:`SimDisk`, blocks recorded or looked up) when the pool collects it."""
        sizes = self._layouts.get(job.meta)
        if sizes is None:
            return self._submit("disk", job.num_blocks, job.run)
        n = job.num_blocks
        if job.write:
            return self.submit_bytes("disk", n * sizes[1], job.run, num_blocks=n)
        after = self.submit_bytes("disk", n * sizes[1], num_blocks=n).end_s
        return self.submit_bytes("host->device", n * sizes[0], job.run, not_before=after, num_blocks=n)

    def _apply(self, effect: Callable[[], list[int]]) -> list[int]:
        """Run a collected job's ``effect`` with :attr:`collecting` set."""
        self.collecting = True
        try:
            return effect()
        finally:
            self.collecting = False

    def next_end_s(self, after: float = float("-inf")) -> float | None:
        """When the earliest job not yet collected ends, among those ending after ``after``
        seconds (None: none)."""
        ends = self._ends
        while ends and ends[0][2]._result is not None:
            heapq.heappop(ends)  # collected
        if not ends or ends[0][0] > after:
            return ends[0][0] if ends else None
        return min((end for end, _, h in ends if end > after and h._result is None), default=None)


class SimHostStore(HostStore):
    """Host slots whose copies take virtual time: a :class:`~kvtier.cache.tiers.host.HostStore`
    for objects that move between the device and host memory without a page copy job of their own:
    :meth:`fill` queues ``link_bytes`` per slot on the device -> host link,
    :meth:`read` returns a job over the host -> device link ending when they arrived.

    Args:
        host: the slots (placeholder bytes).
        copy_engine: the worker's copy engine (its links).
        link_bytes: modelled bytes one slot moves over one device's host link.
    """

    def __init__(self, host, copy_engine: SimCopyEngine, link_bytes: float):
        super().__init__(host, None)
        self.copy_engine, self.link_bytes = copy_engine, float(link_bytes)

    def fill(self, slots: Sequence[int], blocks: torch.Tensor) -> CopyJob:
        super().fill(slots, blocks)
        return self.copy_engine.submit_bytes("device->host", len(slots) * self.link_bytes, num_blocks=len(slots))

    def read(self, hashes: Sequence[bytes], slots: Sequence[int]) -> tuple[torch.Tensor, CopyJob]:
        buf, _ = super().read(hashes, slots)
        return buf, self.copy_engine.submit_bytes("host->device", len(slots) * self.link_bytes,
                                                  num_blocks=len(slots))
