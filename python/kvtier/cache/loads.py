"""Loads of blocks into device pages from the tiers below them, through one interface
(:class:`kvtier.cache.tiers.protocol.TierStore`): the tier reads the block into a host buffer
(host memory: the slot itself, at once), then the copy engine copies that into the device page.
A tier with cheap random access (``batch_reads``: host memory) reads the blocks of one prefix in
one call and they go to the device in one copy job.

A load's source copy is locked in the index before its page is taken (see
:meth:`kvtier.cache.prefix_reuse.PrefixReuse.begin`) and unlocked when the load ended; a failed,
corrupt or missing source ends the load with ``ok = False`` (what is missing is recomputed;
the tier's :meth:`~kvtier.cache.tiers.protocol.TierStore.failed_read` says whether its index
entry goes), and a load counts as done only once its bytes are in the device page.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.cache.device_pages import DevicePages
from kvtier.cache.prefix_index import Tier
from kvtier.cache.seams import CopyJob, JobPart
from kvtier.cache.tiers import PoolTiers
from kvtier.cache.tiers.protocol import TierStore
from kvtier.transfer import CopyError


@dataclass(slots=True)
class BlockLoad:
    """One block on its way into device page ``page`` (``ok``: None while it runs)."""

    hash: bytes
    page: int                  # destination device page
    source: Tier               # DEVICE = already resident
    handle: CopyJob | None = None
    stage: Tier | None = None  # tier whose copy the load reads (locked until the load ended)
    staging: torch.Tensor | None = None  # the host buffer the tier read the block into
    ok: bool | None = None
    copy_s: float = 0.0  # seconds its copy jobs ran (worker time), for the cost model
    share: float = 1.0   # its part of the copy job it ran in (1 / blocks copied together)
    reading: bool = False  # the tier's read is running (then the copy to the device page)


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
        self._read(self.tiers.stores[source], [b], [int(row[source])])
        return b

    def start_all(self, hashes: list[bytes], rows, sources: list[Tier], take: int) -> list[BlockLoad]:
        """:meth:`start` for the first ``take`` blocks of a prefix (``hashes``, their index
        ``rows`` [n, num_tiers] int64 and fastest ``sources``), the blocks of each ``batch_reads``
        tier in one read and one copy job: their pages are taken after the others' (a take may
        write an evicted block down the tiers, never one of these: the caller locked them)."""
        stores = self.tiers.stores
        batched: dict[Tier, list[int]] = {}
        loads: list[BlockLoad | None] = []
        for i in range(take):
            store = stores.get(sources[i])
            if store is not None and store.batch_reads:
                batched.setdefault(sources[i], []).append(i)
                loads.append(None)
            else:
                loads.append(self.start(hashes[i], rows[i], sources[i]))
        for tier, group in batched.items():
            for i, page in zip(group, self.pages.take_many(len(group))):
                loads[i] = BlockLoad(hashes[i], page, tier, share=1.0 / len(group))
            self._read(stores[tier], [loads[i] for i in group], [int(rows[i][tier]) for i in group])
        return loads

    def _read(self, store: TierStore, loads: list[BlockLoad], slots: list[int]) -> None:
        """Start the tier reads of ``loads`` (one call); a read that ended at once goes on to
        the device in one copy job for all of them."""
        buf, job = store.read([b.hash for b in loads], slots)
        n = len(loads)
        blocks = buf.reshape(-1).view(torch.uint8).view(n, self.tiers.block_bytes)
        for k, b in enumerate(loads):
            b.stage, b.reading = store.tier, True
            b.staging, b.handle = (buf if n == 1 else blocks[k]), (job if n == 1 else JobPart(job, k, n))
        if not job.done():
            return  # each block goes on when its read ended (:meth:`advance`)
        statuses = _statuses(job)
        good = [k for k in range(n) if k < len(statuses) and statuses[k] == 0]
        for k in range(n):
            if k not in good:
                self._end_stage(loads[k], [statuses[k]] if k < len(statuses) else [-1])
        if not good:
            return
        src = buf if len(good) == n else blocks[good]
        scatter = self.tiers.copy_engine.scatter(src, self.tiers.kv_caches, [loads[k].page for k in good])
        for j, k in enumerate(good):
            b = loads[k]
            b.copy_s += b.handle.run_s
            b.reading, b.staging, b.handle = False, src, JobPart(scatter, j, len(good))

    def _end_stage(self, b: BlockLoad, status: list[int]) -> None:
        """Account for the copy that just ended and start the next one, if any."""
        t = self.tiers
        ok, reading = status == [0], b.reading
        b.handle, b.reading = None, False
        if ok and reading:  # in the host buffer: copy it into the device page
            b.handle = t.copy_engine.scatter(b.staging, t.kv_caches, [b.page])
            return
        if b.stage is not None:
            unlocked = t.index.unlock([b.hash], b.stage)
            assert unlocked, "a load's source copy was not locked while it was read"
        stage, b.stage, b.staging = b.stage, None, None
        if ok:
            t.stats.bytes_loaded[t.stores[stage].name] += t.block_bytes
            t.cost_model.observe_copy(b.source, t.block_bytes, b.copy_s, b.share)
            b.ok = True
            return
        failure = t.stores[stage].failed_read(status[0] if status else -1) if reading else None
        if failure is not None and failure.drop:
            t.index.remove(b.hash, stage)
        t.stats.copy_errors += failure is None or failure.error
        b.ok = False

    def advance(self, b: BlockLoad, wait: bool) -> bool:
        """Move one block load on; True once it ended (``b.ok`` says how)."""
        while b.ok is None:
            if not wait and not b.handle.done():
                return False
            status = _statuses(b.handle)
            b.copy_s += b.handle.run_s
            self._end_stage(b, status)
        return True

    def advance_all(self, loads: list[BlockLoad]) -> bool:
        """Move every pending load of ``loads`` on without waiting; True once all ended."""
        self._end_shared_jobs(loads, wait=False)
        return all([self.advance(b, wait=False) for b in loads if b.ok is None])

    def wait_all(self, loads: list[BlockLoad], timeout_s: float | None = None) -> bool:
        """Block until every load of ``loads`` ended, or at most ``timeout_s`` seconds of the
        tiers' clock (None: no limit); True once all ended. A load still running at the limit
        is left running (:meth:`advance_all` moves it on later)."""
        if timeout_s is None:
            self._end_shared_jobs(loads, wait=True)
            while not all(self.advance(b, wait=True) for b in loads):
                pass
            return True
        clock = self.tiers.clock
        deadline = clock() + timeout_s
        while not self.advance_all(loads):
            left = deadline - clock()
            if left <= 0:
                return False
            pending = next(b for b in loads if b.ok is None)
            pending.handle.wait(left)
        return True

    def _end_shared_jobs(self, loads: list[BlockLoad], wait: bool) -> None:
        """End the loads of each device copy job among ``loads`` (:meth:`start_all` copies the
        blocks of a ``batch_reads`` tier in one) that ended (with ``wait``: once it ended) and
        succeeded for every block, together: one index call unlocks their source copies and the
        cost model learns the job once (the same estimate as block by block: see
        ``CostModel.observe_copy``). A job with a failed block is left to :meth:`advance`."""
        jobs: dict[int, list[BlockLoad]] = {}
        for b in loads:
            if b.ok is None and not b.reading and b.stage is not None and isinstance(b.handle, JobPart):
                jobs.setdefault(id(b.handle.job), []).append(b)
        t = self.tiers
        for parts in jobs.values():
            job, tier = parts[0].handle.job, parts[0].stage
            if not wait and not job.done():
                continue
            try:
                statuses = job.result()
            except CopyError:
                continue
            if not all(b.handle.i < len(statuses) and statuses[b.handle.i] == 0 for b in parts):
                continue
            unlocked = t.index.unlock([b.hash for b in parts], tier)
            assert unlocked, "a load's source copy was not locked while it was read"
            share = sum(b.share for b in parts)
            t.stats.bytes_loaded[t.stores[tier].name] += len(parts) * t.block_bytes
            t.cost_model.observe_copy(tier, len(parts) * t.block_bytes, job.run_s * share, share)
            for b in parts:
                b.copy_s += b.handle.run_s
                b.handle, b.stage, b.staging, b.ok = None, None, None, True


def _statuses(job: CopyJob) -> list[int]:
    """``job.result()``, or ``[-1]`` when the job failed as a whole."""
    try:
        return job.result()
    except CopyError:
        return [-1]
