"""Copies down the tiers: device -> host -> disk and -> remote, write-through or write-back.

Every block goes down through the staging layer (host memory, ``PoolTiers.staging``: slots,
their LRU eviction, the host column of the index) and, below it, to every
:class:`~kvtier.cache.tiers.protocol.TierStore` (disk, remote) through that interface only: when
its host copy is made, or, under write-back, for a tier that ``spills``, when its host copy is
evicted. Nothing here names a tier.

Write-through copies each block down as soon as it is full and indexed; write-back only when
its device page (or host slot) is taken for something else. A page or host copy a write reads
stays referenced (locked) until the write ended, and a block is indexed in the tier it was
written to only once its copy finished successfully.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.cache.device_pages import DevicePages
from kvtier.cache.prefix_index import Tier
from kvtier.cache.seams import CopyJob, JobPart
from kvtier.cache.tiers import PoolTiers
from kvtier.cache.tiers.protocol import Admit, TierStore
from kvtier.transfer import CopyError


@dataclass(slots=True)
class Write:
    """One block being copied down: to ``target`` from device ``page`` or host ``slot``."""

    hash: bytes
    target: Tier               # the staging tier (from a device page) or one below it (from a host slot)
    handle: CopyJob
    page: int = -1             # device page read (-1: a write from a host slot)
    slot: int = -1             # host slot read and locked (-1: not locked: a private copy of it,
                               # see Writes._slot_down, or the tier copied it at once)


class Writes:
    """The writes in flight of one pool and what starts them."""

    def __init__(self, tiers: PoolTiers, pages: DevicePages):
        self.tiers = tiers
        self.pages = pages
        self.pending: list[Write] = []
        self._below: dict[Tier, dict[bytes, int]] = {}  # writes below host in ``pending``: how many of each hash
        self._spills: list[tuple[Tier, bytes, int]] | None = None  # host copies to spill in one job per tier

    def pending_below(self) -> dict[str, dict[bytes, int]]:
        """The writes below the staging layer in flight, by tier name: how many of each hash
        (what a tier's budget counts as committed)."""
        return {self.tiers.stores[tier].name: dict(n) for tier, n in self._below.items() if n}

    @property
    def write_back(self) -> bool:
        return self.tiers.config.write_policy == "write-back"

    def evicting(self, blocks: list[tuple[bytes, int]]) -> None:
        """Cached device pages are being reused: under write-back copy their blocks (``(hash,
        page)`` pairs) to host first, in one job, and wait (nothing else can touch the pages
        meanwhile)."""
        t, host = self.tiers, self.tiers.staging
        if not self.write_back or host is None:
            return
        held = host.held([h for h, _ in blocks])
        kept = [h for (h, _), on_host in zip(blocks, held) if on_host]
        blocks = [b for b, on_host in zip(blocks, held) if not on_host]
        # The host copies of the others are what write-back keeps of them: the most recently
        # used there, as a copy written now would be, and locked, so that they are not evicted
        # to make room for these (which would lose them).
        host.touch(kept)
        locked = bool(kept) and host.lock(kept)
        self._spills = []  # the host copies evicted for them spill in one job per tier
        try:
            slots = self._host_slots(len(blocks))
        finally:
            if locked:
                host.unlock(kept)
            self._flush_spills()  # before the slots are overwritten below
        t.stats.stores_refused[host.name] += len(blocks) - len(slots)
        blocks = blocks[:len(slots)]
        if not blocks:
            return
        staging = host.staging(len(blocks))
        job = t.copy_engine.gather(t.kv_caches, [page for _, page in blocks], staging)
        try:
            statuses = job.result()
        except CopyError:
            statuses = []  # every block failed
        ok = [k < len(statuses) and statuses[k] == 0 for k in range(len(blocks))]
        good = [k for k in range(len(blocks)) if ok[k]]
        if len(good) == len(blocks):
            host.fill(slots, staging)
        elif good:  # only the blocks that were copied: the others' slots are given back
            host.fill([slots[k] for k in good], staging[good])
        self._host_copies_ended([h for h, _ in blocks], slots, ok)

    def computed(self, h: bytes, page: int) -> None:
        """Block ``h`` was just computed into ``page`` and indexed: start its write-through copy."""
        if not self.write_back:
            self.page_to_host(h, page)

    def _host_slot(self) -> int:
        """A free host slot (see :meth:`_host_slots`); -1 if none."""
        slots = self._host_slots(1)
        return slots[0] if slots else -1

    def _host_slots(self, n: int) -> list[int]:
        """Up to ``n`` free host slots (:meth:`kvtier.cache.tiers.host.HostStore.allocate`):
        evicted copies spill down first under write-back; when every slot is held by copies
        still in flight, those are finished first (back-pressure)."""
        spill = self._spill_evicted if self.write_back else None
        return self.tiers.staging.allocate(n, spill, drain=self._drain)

    def _drain(self) -> bool:
        if not self.pending:
            return False
        self.finish(wait=True)
        return True

    def _spill_evicted(self, victims: list[tuple[bytes, int]]) -> None:
        for store in self.tiers.lower_stores():
            if store.spills:
                for h, victim in victims:
                    self._slot_down(store, h, victim, evicting=True)

    def page_to_host(self, h: bytes, page: int) -> None:
        """Start copying block ``h`` from ``page`` to a host slot; the page stays referenced
        until the copy ended."""
        t, host = self.tiers, self.tiers.staging
        if host is None or host.held([h])[0]:
            return
        slot = self._host_slot()
        if slot < 0:
            t.stats.stores_refused[host.name] += 1
            return
        handle = t.copy_engine.gather(t.kv_caches, [page], host.slot(slot))
        self.pages.ref(page)
        self.pending.append(Write(h, host.tier, handle, page=page, slot=slot))

    def _slot_down(self, store: TierStore, h: bytes, slot: int, evicting: bool = False) -> None:
        """Start writing the host copy of ``h`` in ``slot`` to ``store``. The copy stays locked
        until the write ended (unless the tier copies its input at once); with ``evicting`` (the
        slot is about to hold another block) the write reads a private copy of the block
        instead, so the serving loop never waits for the tier (until that write ends, a lookup
        finds the block in no tier: a miss)."""
        t, host = self.tiers, self.tiers.staging
        if t.in_tier(h, store.tier):
            return
        pending = self._below.setdefault(store.tier, {})
        admit = store.admit(pending.keys())
        if admit != Admit.YES:
            if admit == Admit.FULL:
                t.stats.stores_refused[store.name] += 1
            return
        if evicting:
            pending[h] = pending.get(h, 0) + 1  # counts against the budget until flushed
            spills = self._spills if self._spills is not None else []
            spills.append((store.tier, h, slot))
            if self._spills is None:
                self._flush_spills(spills)
        elif store.copies_input:
            self.pending.append(Write(h, store.tier, store.write([h], host.slot(slot))))
            pending[h] = pending.get(h, 0) + 1
        elif host.lock([h]):
            self.pending.append(Write(h, store.tier, store.write([h], host.slot(slot)), slot=slot))
            pending[h] = pending.get(h, 0) + 1

    def _write_ended(self, tier: Tier, h: bytes) -> None:
        """One write of ``h`` to ``tier`` counted in ``_below`` ended (or will never start)."""
        pending = self._below[tier]
        if pending[h] == 1:
            del pending[h]
        else:
            pending[h] -= 1

    def _flush_spills(self, spills: list[tuple[Tier, bytes, int]] | None = None) -> None:
        """Start one write per tier of the evicted host copies collected (``spills``, else those
        :meth:`evicting` collected), reading private copies of their slots now (the slots are
        about to hold other blocks): one job for all of a tier's, so that evicting many blocks
        (1-token blocks evict thousands at once) neither queues a job per block nor waits on a
        full queue."""
        if spills is None:
            spills, self._spills = self._spills or [], None
        t = self.tiers
        for tier in dict.fromkeys(tier for tier, _, _ in spills):
            mine = [(h, slot) for x, h, slot in spills if x == tier]
            hashes = [h for h, _ in mine]
            try:
                job = t.stores[tier].write(hashes, t.staging.copy_out([slot for _, slot in mine]))
            except BaseException:
                for h in hashes:  # no write will end for them: they no longer count against the budget
                    self._write_ended(tier, h)
                raise
            for k, h in enumerate(hashes):
                self.pending.append(Write(h, tier, JobPart(job, k, len(hashes))))

    def _finish_one(self, w: Write) -> None:
        t = self.tiers
        try:
            status = w.handle.result()
        except CopyError:
            status = [-1]
        if w.page >= 0:  # a device page copied into a host slot
            self.pages.unref(w.page)
            self._host_copies_ended([w.hash], [w.slot], [status == [0]])
            return
        store = t.stores[w.target]
        self._write_ended(w.target, w.hash)
        if w.slot >= 0:
            t.staging.unlock([w.hash])
        end = store.stored(w.hash, status)
        if end.indexed:
            t.stats.bytes_written[store.name] += t.block_bytes
        if end.refused:
            t.stats.stores_refused[store.name] += 1
        t.stats.copy_errors += end.error

    def _host_copies_ended(self, hashes: list[bytes], slots: list[int], ok: list[bool]) -> None:
        """Copies of blocks ``hashes`` into host ``slots`` ended (``ok``: which succeeded): index
        the good ones (one index call for all) and start their copies further down; give back the
        slots of the failed ones and of blocks that got a host copy meanwhile."""
        t, host = self.tiers, self.tiers.staging
        good = [i for i, k in enumerate(ok) if k]
        inserted = host.index_copies([hashes[i] for i in good], [slots[i] for i in good])
        kept = [i for i, k in zip(good, inserted) if k]
        t.stats.bytes_written[host.name] += len(kept) * t.block_bytes
        lower = [s for s in t.lower_stores() if not (self.write_back and s.spills)]
        for i in kept:
            for store in lower:
                self._slot_down(store, hashes[i], slots[i])
        kept_set = set(kept)
        host.release([slots[i] for i in range(len(hashes)) if i not in kept_set])
        t.stats.copy_errors += len(hashes) - len(good)

    def finish(self, wait: bool) -> None:
        """Collect the writes that ended (with ``wait``: every write, and the ones they start)."""
        while self.pending:
            ready, pending = [], []
            for w in self.pending:
                (ready if wait or w.handle.done() else pending).append(w)
            if not ready:
                return
            self.pending = pending
            for w in ready:
                self._finish_one(w)
            if not wait:
                return
