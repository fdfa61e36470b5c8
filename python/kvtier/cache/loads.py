"""Loads of blocks into device pages: from host memory directly (the host blocks of one prefix in
one copy job), from the disk or the remote tier through a staging buffer, and the accounting when
each block's stage ends.

A load's source copy is locked in the index before its page is taken (see
:meth:`kvtier.cache.prefix_reuse.PrefixReuse.begin`) and unlocked when the copy that reads it
ended; a failed, corrupt or missing source ends the load with ``ok = False`` (what is missing
is recomputed), and a load counts as done only once its bytes are in the device page.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.cache.device_pages import DevicePages
from kvtier.cache.disk_tier import DiskStatus, aligned_empty
from kvtier.cache.prefix_index import Tier
from kvtier.cache.remote import RemoteStatus
from kvtier.cache.seams import CopyJob, JobPart
from kvtier.cache.tiers import PoolTiers
from kvtier.transfer import CopyError


@dataclass(slots=True)
class BlockLoad:
    """One block on its way into device page ``page`` (``ok``: None while it runs)."""

    hash: bytes
    page: int                  # destination device page
    source: Tier               # DEVICE = already resident
    handle: CopyJob | None = None
    stage: Tier | None = None  # tier the running copy reads from (its copy there is locked)
    staging: torch.Tensor | None = None  # where a disk read lands before going to the device page
    ok: bool | None = None
    copy_s: float = 0.0  # seconds its copy jobs ran (worker time), for the cost model
    share: float = 1.0   # its part of the copy job it ran in (1 / blocks copied together)


class Loads:
    """Starts block loads and moves them on as their copies end."""

    def __init__(self, tiers: PoolTiers, pages: DevicePages):
        self.tiers = tiers
        self.pages = pages

    def start(self, h: bytes, row, source: Tier) -> BlockLoad:
        """Start loading block ``h`` from ``source`` (its copy there locked by the caller) into a
        fresh page; a block already on the device (``source`` DEVICE, its page referenced by the
        caller) is done at once. ``row``: the block's index row (``PrefixIndex.match``)."""
        if source == Tier.DEVICE:
            return BlockLoad(h, int(row[Tier.DEVICE]), source, ok=True)
        b = BlockLoad(h, self.pages.take(), source)
        if source == Tier.HOST:
            self._host_to_device(b, int(row[Tier.HOST]))
        else:
            self._staged_read(b, source)
        return b

    def start_all(self, hashes: list[bytes], rows, sources: list[Tier], take: int) -> list[BlockLoad]:
        """:meth:`start` for the first ``take`` blocks of a prefix (``hashes``, their index
        ``rows`` [n, num_tiers] int64 and fastest ``sources``), its host blocks in one copy job:
        their pages are taken first (a take may write an evicted block down the tiers, never one
        of these: the caller locked them), then the blocks are read from their host slots."""
        loads = [self.start(hashes[i], rows[i], sources[i]) if sources[i] != Tier.HOST else None
                 for i in range(take)]
        host = [i for i in range(take) if sources[i] == Tier.HOST]
        if not host:
            return loads
        for i, page in zip(host, self.pages.take_many(len(host))):
            loads[i] = BlockLoad(hashes[i], page, Tier.HOST, stage=Tier.HOST, share=1.0 / len(host))
        t = self.tiers
        staging = t.host.read([int(rows[i][Tier.HOST]) for i in host])
        job = t.copy_engine.scatter(staging, t.kv_caches, [loads[i].page for i in host])
        for k, i in enumerate(host):
            loads[i].handle = JobPart(job, k, len(host))
        return loads

    def _host_to_device(self, b: BlockLoad, slot: int) -> None:
        t = self.tiers
        b.stage = Tier.HOST
        b.handle = t.copy_engine.scatter(t.host.slot(slot), t.kv_caches, [b.page])

    def _staged_read(self, b: BlockLoad, source: Tier) -> None:
        """Read a disk or remote block into a staging buffer (then :meth:`_end_stage` copies it
        into the device page)."""
        t = self.tiers
        b.stage = source
        b.staging = aligned_empty(t.block_bytes, pin_memory=t.host is not None and t.host.storage.is_pinned())
        if source == Tier.DISK:
            b.handle = t.copy_engine.disk_read(t.disk, [b.hash], t.meta, b.staging)
        else:
            b.handle = t.remote.get([b.hash], b.staging)

    def _end_stage(self, b: BlockLoad, status: list[int]) -> None:
        """Account for the copy that just ended and start the next one, if any."""
        t = self.tiers
        stage, ok = b.stage, status == [0]
        if stage is not None:
            unlocked = t.index.unlock([b.hash], stage)
            assert unlocked, "a load's source copy was not locked while it was read"
        b.handle, b.stage = None, None
        if not ok:
            if stage == Tier.REMOTE:  # lossy by contract: a counted miss (remote.stats), not an error
                if status[:1] != [RemoteStatus.UNAVAILABLE]:
                    t.index.remove(b.hash, Tier.REMOTE)
            else:
                t.stats.copy_errors += 1
            if stage == Tier.DISK and status and status[0] in (DiskStatus.CORRUPT, DiskStatus.MISSING):
                t.index.remove(b.hash, Tier.DISK)  # the disk tier already dropped the file
            b.ok, b.staging = False, None
        elif stage in (Tier.DISK, Tier.REMOTE):  # in the staging buffer: copy it into the device page
            t.stats.bytes_loaded[stage.name.lower()] += t.block_bytes
            b.handle = t.copy_engine.scatter(b.staging, t.kv_caches, [b.page])
        else:
            if stage == Tier.HOST:
                t.stats.bytes_loaded["host"] += t.block_bytes
            t.cost_model.observe_copy(b.source, t.block_bytes, b.copy_s, b.share)
            b.ok, b.staging = True, None

    def advance(self, b: BlockLoad, wait: bool) -> bool:
        """Move one block load on; True once it ended (``b.ok`` says how)."""
        while b.ok is None:
            if not wait and not b.handle.done():
                return False
            try:
                status = b.handle.result()
            except CopyError:
                status = [-1]
            b.copy_s += b.handle.run_s
            self._end_stage(b, status)
        return True

    def advance_all(self, loads: list[BlockLoad]) -> bool:
        """Move every pending load of ``loads`` on without waiting; True once all ended."""
        self._end_host_jobs(loads, wait=False)
        return all([self.advance(b, wait=False) for b in loads if b.ok is None])

    def wait_all(self, loads: list[BlockLoad]) -> None:
        """Block until every load of ``loads`` ended."""
        self._end_host_jobs(loads, wait=True)
        while not all(self.advance(b, wait=True) for b in loads):
            pass

    def _end_host_jobs(self, loads: list[BlockLoad], wait: bool) -> None:
        """End the host loads of each copy job among ``loads`` (:meth:`start_all` copies a
        prefix's host blocks in one) that ended (with ``wait``: once it ended) and succeeded
        for every block, together: one index call unlocks their host copies and the cost model
        learns the job once (the same estimate as block by block: see
        ``CostModel.observe_copy``). A job with a failed block is left to :meth:`advance`."""
        jobs: dict[int, list[BlockLoad]] = {}
        for b in loads:
            if b.ok is None and b.stage == Tier.HOST and isinstance(b.handle, JobPart):
                jobs.setdefault(id(b.handle.job), []).append(b)
        t = self.tiers
        for parts in jobs.values():
            job = parts[0].handle.job
            if not wait and not job.done():
                continue
            try:
                statuses = job.result()
            except CopyError:
                continue
            if not all(b.handle.i < len(statuses) and statuses[b.handle.i] == 0 for b in parts):
                continue
            unlocked = t.index.unlock([b.hash for b in parts], Tier.HOST)
            assert unlocked, "a load's source copy was not locked while it was read"
            share = sum(b.share for b in parts)
            t.stats.bytes_loaded["host"] += len(parts) * t.block_bytes
            t.cost_model.observe_copy(Tier.HOST, len(parts) * t.block_bytes, job.run_s * share, share)
            for b in parts:
                b.copy_s += b.handle.run_s
                b.handle, b.stage, b.ok = None, None, True
