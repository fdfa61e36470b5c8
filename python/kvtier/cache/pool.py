"""The tiered KV pool: device pages, host slots and disk blocks behind one prefix index.

A facade over jobs of one kind each: :mod:`~kvtier.cache.device_pages` (page accounting and
reuse order), :mod:`~kvtier.cache.prefix_reuse` (matching and placing cached prefixes, indexing
computed blocks), :mod:`~kvtier.cache.loads` (block loads into device pages),
:mod:`~kvtier.cache.writes` (write-through / write-back and host-slot eviction) and
:mod:`~kvtier.cache.prefetch` (tool-aware prefetch), sharing one
:class:`~kvtier.cache.tiers.PoolTiers`.

The pool works on each request's :class:`~kvtier.cache.kv_state.KVState` (its pages, block
hashes, hits and loads). It reports what it placed; the caller owns the request's progress
(``KVState.num_computed_tokens``). Scheduler-facing contract:

* ``begin_prefix(kv, partial=)``: give a page-less request its cached prefix. Blocks already in
  device pages are reused at once; blocks in host memory or on disk are loaded into fresh device
  pages by the copy engine (a disk block through a staging buffer) when the cost model says
  loading the prefix beats recomputing it. Returns a :class:`PrefixStart`: ``LOADING`` when the
  request must wait for loads (poll ``finish_prefix``); ``NO_ROOM`` when the loads need more
  free pages than there are and ``partial`` is False (nothing was taken: admit it later, when
  pages were freed).
* ``finish_prefix(kv)``: None while loads run; else the tokens of the prefix now in its pages
  (the caller sets ``num_computed_tokens`` to it). A failed, corrupt or missing block shrinks the
  hit to the contiguous prefix that loaded; the rest is recomputed.
* ``allocate``, ``register_computed``, ``free``, ``truncate``: page accounting. Full computed
  blocks are indexed as device copies; with write-through they are copied device -> host -> disk
  in the background (with write-back, only when evicted). A page, host copy or disk block stays
  referenced (locked) while a copy reads it, and a block is served only after its copy finished
  successfully.
* ``poll()``: once per step: finish ended writes and prefetches, start due tool-aware prefetches.
* ``recompute_s``, ``resume_s``, ``observe_prefill``, ``costs()``, ``stats()``, ``shares_disk_with``: what the
  pool's cost model expects and learns, and what it reports. The facade is these verbs only: its
  parts (index, tiers, copy engine, cost model, clock) are ``KVPool.tiers``, the jobs' shared
  state, which no caller outside :mod:`kvtier.cache` reaches into.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from kvtier.cache.block_hash import BLOCK_HASH_BYTES
from kvtier.cache.block_io import BlockIO
from kvtier.cache.checkpoints.index import Checkpoint, CheckpointKind
from kvtier.cache.checkpoints.reuse import resume_rule
from kvtier.cache.checkpoints.store import CheckpointStore
from kvtier.cache.config import PoolConfig
from kvtier.cache.cost_model import CostModel
from kvtier.cache.device_pages import DevicePages
from kvtier.cache.disk_tier import BlockMeta
from kvtier.cache.kv_state import KVState
from kvtier.cache.loads import Loads
from kvtier.cache.pool_stats import PoolSnapshot
from kvtier.cache.prefetch import Prefetcher
from kvtier.cache.prefix_index import Tier
from kvtier.cache.prefix_reuse import PrefixReuse, PrefixStart
from kvtier.cache.remote import RemoteTier
from kvtier.cache.seams import Clock, CopyEngine, DiskStore
from kvtier.cache.tiers import PoolTiers
from kvtier.cache.writes import Writes

__all__ = ["KVPool", "PrefixStart"]


class KVPool:
    """Device pages + host slots + disk blocks of the paged MLA cache, indexed by block hash.

    Args:
        config: sizes and policies.
        kv_caches: the model's per-layer page pools ``[num_device_pages, page_size, row]``.
        cost_model: load-vs-recompute decisions; None probes the tiers at start-up.
        copy_engine: moves blocks between tiers (:class:`kvtier.cache.seams.CopyEngine`); None
            starts a native :class:`kvtier.transfer.CopyEngine` with ``config.copy_threads``
            workers for CPU page pools, a :class:`kvtier.cache.device_copy.DeviceCopyEngine`
            (copy stream, pinned host tier) for GPU page pools
            (``DeviceCopyEngine("cpu", CpuStreams(...))`` runs that path on CPU pools, for tests).
            The simulator passes a virtual-time one (:mod:`kvtier.sim.copies`).
        disk: the disk tier (:class:`kvtier.cache.seams.DiskStore`); None opens the subdirectory
            of ``config.disk_cache_dir`` (when set) named after this pool's salt and block layout
            (:func:`kvtier.cache.tiers.disk_budget.namespace_dir`) as a
            :class:`kvtier.cache.disk_tier.DiskTier` with budget ``config.disk_cache_bytes``.
            Given, it is used whatever ``disk_cache_dir`` says (it needs the host tier all the
            same), and may hold blocks this pool cannot evict.
        clock: seconds, monotonic (:class:`kvtier.cache.seams.Clock`); what the eviction
            policy's TTLs and prefetch times are measured in. None = ``time.monotonic``.
        remote: the remote tier (:class:`kvtier.cache.remote.RemoteTier`); None opens
            ``config.remote_cache_url`` when set. Blocks are written to it from host slots in
            the background; a prefix that runs past the local tiers is looked up there
            (a lookup waits ``remote_timeout_s`` at most) and loaded like a disk hit. Its
            misses, corrupt values and timeouts are counted (``stats().sections["remote"]``) and recomputed.
        checkpoints: a hybrid model's state checkpoint store
            (:class:`kvtier.cache.checkpoints.store.CheckpointStore`, e.g. on the simulator's
            virtual-time tiers); None opens one on this pool's tiers when
            ``config.state_checkpoint_bytes`` is set (and prefix caching is on).

    Raises:
        ValueError: bad config: not a :class:`PoolConfig`, a host or disk budget that holds no
            block (``host_cache_bytes`` below one slot, ``disk_cache_bytes`` below one block
            file), a disk tier without a host block; for GPU page pools a host or disk tier where
            no GPU page kernel runs, or a ``host_cache_bytes`` over what pinned memory allows
            (:func:`kvtier.cache.device_copy.check_device_tiers`);
        RuntimeError: the disk directory cannot be used, or the remote store does not
            answer at start-up (names ``remote_cache_url``).

    Warns:
        RuntimeWarning: the disk tier can store no block (its budget is taken by blocks this
        pool cannot evict, or its filesystem is full); see ``stats().disk_capacity_blocks``.

    Attributes:
        config, page_size, kv_caches: as given (``page_size`` is ``config.page_size``).
        meta: the layout of one page-first block (:class:`kvtier.cache.disk_tier.BlockMeta`);
            ``block_bytes``: its payload bytes. What :meth:`export_blocks` and
            :meth:`import_blocks` move.

    Example:
        >>> from kvtier.cache.kv_state import KVState, TokenList
        >>> pool = KVPool(PoolConfig(page_size=4, num_device_pages=8), [torch.zeros(8, 4, 2)])
        >>> kv = KVState(TokenList(range(9)))
        >>> pool.begin_prefix(kv), pool.finish_prefix(kv)
        (<PrefixStart.READY: 'ready'>, 0)
        >>> pool.allocate(kv, 9), kv.page_ids
        (True, [0, 1, 2])
    """

    def __init__(self, config: PoolConfig, kv_caches: list[torch.Tensor], cost_model: CostModel | None = None, *,
                 copy_engine: CopyEngine | None = None, disk: DiskStore | None = None, clock: Clock | None = None,
                 remote: RemoteTier | None = None, checkpoints: CheckpointStore | None = None):
        self.tiers = PoolTiers(config, kv_caches, cost_model, copy_engine, disk, clock, remote)
        self.pages = DevicePages(self.tiers, on_evict=lambda blocks: self.writes.evicting(blocks))
        self.writes = Writes(self.tiers, self.pages)
        self.loads = Loads(self.tiers, self.pages)
        # Where a prefix may resume: after any block, or (a hybrid model) only at a checkpoint.
        self.resume_rule = resume_rule(self.tiers, checkpoints)
        self.reuse = PrefixReuse(self.tiers, self.pages, self.loads, self.writes, self.resume_rule)
        self.prefetcher = Prefetcher(self.tiers, self.pages, self.loads)
        self.block_io = BlockIO(self.tiers, self.pages)
        self.event_sink: Callable[[list], None] | None = None
        # What it was built with, fixed for its life: sizes and policies, page pools, block layout.
        self.config, self.page_size, self.kv_caches = config, config.page_size, kv_caches
        self.meta, self.block_bytes = self.tiers.meta, self.tiers.block_bytes

    def stats(self) -> PoolSnapshot:
        """The pool's counters, page and block counts now, as a copy (:class:`PoolSnapshot`) that
        the pool never changes: what metrics and reports read. Call it on the thread that drives
        the pool (its calls are not thread-safe); the snapshot may then go to any thread."""
        t = self.tiers
        cached = t.cached_blocks()
        return PoolSnapshot.of(t.stats, num_pages=self.pages.num_pages, num_free_pages=self.pages.num_free,
                               cached_blocks=cached, remote=None if t.remote is None else t.remote.stats,
                               sections=self.resume_rule.sections())

    # ---- device pages -------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return self.pages.num_free

    def num_private_pages(self, kv: KVState) -> int:
        """Device pages of ``kv`` no other request or running copy references (what freeing it
        would release)."""
        refs = self.pages.ref_counts
        return sum(refs[p] == 1 for p in kv.page_ids)

    def num_pages_needed(self, kv: KVState, num_tokens: int) -> int:
        """Pages ``kv`` must add to hold ``num_tokens`` tokens."""
        return self.pages.pages_needed(kv, num_tokens)

    def allocate(self, kv: KVState, num_tokens: int) -> bool:
        """Add pages so ``kv`` holds ``num_tokens`` tokens; False (nothing changed) if too few are free."""
        return self.pages.allocate(kv, num_tokens)

    @property
    def keeps_evicted_blocks(self) -> bool:
        """Whether a device page's full block outlives its eviction in a lower tier (a host tier
        with prefix caching), so a preempted request's computed blocks load back, not recomputed."""
        return self.config.enable_prefix_caching and self.tiers.host is not None

    def free(self, kv: KVState) -> None:
        """Drop ``kv``'s pages; its last pages become reusable first, its first pages last. A
        request freed while its loads run waits for them first. Its progress is the caller's."""
        self.reuse.free(kv)

    def truncate(self, kv: KVState, num_tokens: int) -> int:
        """Keep only the pages of ``kv``'s first ``num_tokens // page_size`` full blocks (a placed
        prefix that must not be reused whole); the rest stay cached but unreferenced.

        A hybrid pool's placed prefix whose restored state stands past ``num_tokens`` is cut to
        nothing (the state cannot be moved back; the sequence computes from token 0).

        Returns:
            the tokens ``kv``'s pages still hold at most (``kept_blocks * page_size``): the caller
            lowers ``num_computed_tokens`` to it.
        """
        return self.pages.truncate(kv, self.resume_rule.truncate(kv, num_tokens))

    # ---- prefix reuse and loads ---------------------------------------------------------------
    def begin_prefix(self, kv: KVState, *, partial: bool = True) -> PrefixStart:
        """Reuse or start loading ``kv``'s cached prefix.

        Args:
            kv: a request holding no pages.
            partial: when the loads the cost model chose need more device pages than are free,
                True loads the longest prefix that fits (the rest is recomputed; for a pool with
                nothing else to free), False takes nothing and returns ``NO_ROOM`` (the caller
                admits it once running requests freed pages, as vLLM's scheduler keeps a request
                waiting until its computed blocks fit, rather than recompute what it could load).

        Returns:
            ``READY`` (:meth:`finish_prefix` gives the tokens placed), ``LOADING`` or ``NO_ROOM``
            (only with ``partial=False``); see :class:`PrefixStart`.
        """
        return self.reuse.begin(kv, partial)

    def finish_prefix(self, kv: KVState) -> int | None:
        """None while ``kv``'s loads run; else the tokens of its cached prefix now in its pages
        (``KVState.num_prefix_tokens``), by tier in ``kv.prefix_tokens_by_tier``."""
        return self.reuse.finish(kv)

    def wait_prefix(self, kv: KVState, timeout_s: float | None = None) -> int | None:
        """Block (GIL released while copies run) until ``kv``'s prefix loads ended, then place
        them as :meth:`finish_prefix` does.

        Args:
            timeout_s: the longest wait in seconds of the pool's clock (None: no limit); loads
                still running then are left running, as after :meth:`begin_prefix`.

        Returns:
            the tokens of its cached prefix now in its pages (``KVState.num_prefix_tokens``); a
            block whose load failed and the blocks after it are not counted (they are
            recomputed). None when ``timeout_s`` passed first. Returns at once for a request
            with no loads running.
        """
        return self.reuse.finish(kv, wait=True, timeout_s=timeout_s)

    def estimate_prefix(self, kv: KVState) -> tuple[int, float]:
        """What :meth:`begin_prefix` would reuse for page-less ``kv`` now, taking nothing.

        Returns:
            ``(reused_tokens, load_s)``: prompt tokens it would place from cached blocks (device
            hits and the loads the cost model chooses), and the cost model's estimate of those
            loads in seconds (0.0 when every block is a device hit). Whether the loads' pages are
            free is not checked, and the remote store is not asked (it is called every step for
            every waiting request): remote blocks count once a lookup has indexed them.
        """
        return self.reuse.estimate(kv)

    def wait_for_loads(self, timeout_s: float) -> None:
        """Block (GIL released) until one pending load stage ends or ``timeout_s`` passes."""
        self.reuse.wait_any(timeout_s)

    @property
    def loading(self) -> list[KVState]:
        """Requests whose prefix loads run, in the order they started."""
        return list(self.reuse.loading.values())

    def register_computed(self, kv: KVState) -> None:
        """Index the pages of ``kv`` that became full (up to ``kv.num_computed_tokens``) and start
        their write-through copies."""
        self.reuse.register_computed(kv)

    def index_disk_block(self, block_hash: bytes) -> bool:
        """Index a block another pool stored in this pool's disk tier (a tier several workers
        share, e.g. a remote store); True if it was not indexed yet.

        The caller vouches that the block was written under this pool's salt and layout (a
        pool with the same :class:`PoolConfig` salt): an indexed block is served by hash.

        Raises:
            ValueError: this pool has no disk tier, or ``block_hash`` is not 16 bytes.
        """
        if self.tiers.disk is None:
            raise ValueError("index_disk_block needs a disk tier")
        if not isinstance(block_hash, bytes) or len(block_hash) != BLOCK_HASH_BYTES:
            raise ValueError(f"block_hash must be {BLOCK_HASH_BYTES} bytes, got {block_hash!r}")
        return self.tiers.disk_budget.add(block_hash)

    def shares_disk_with(self, other: KVPool) -> bool:
        """Whether ``other``'s disk tier is this pool's (one :class:`kvtier.cache.seams.DiskStore`
        several workers reach): blocks one stores there, the other can index
        (:meth:`index_disk_block`). False when either has no disk tier."""
        return self.tiers.disk is not None and self.tiers.disk is other.tiers.disk

    # ---- recurrent-state checkpoints (hybrid models) ------------------------------------------
    def take_restore(self, kv: KVState) -> Checkpoint | None:
        """The recurrent-state checkpoint ``kv``'s placed prefix ends with, handed over once (the
        scheduler puts it on the batch that runs the request's first chunk); None for an
        attention-only pool or a prefix placed without one."""
        return self.resume_rule.take_restore(kv)

    def save_checkpoint(self, kv: KVState, num_tokens: int, payload: torch.Tensor, kind: CheckpointKind) -> bool:
        """Keep ``payload`` as the recurrent-state checkpoint of ``kv`` after its first ``num_tokens``
        tokens, in every tier with room (:mod:`kvtier.cache.checkpoints.store`).

        Args:
            kv: the request the state belongs to (its tokens up to ``num_tokens`` are hashed if
                they are not yet).
            num_tokens: the boundary: a positive multiple of ``page_size``, at most ``kv.num_tokens``.
            payload: ``[config.state_checkpoint_bytes]`` uint8, on any device.
            kind: :class:`CheckpointKind` (``GRID`` points are dropped first under pressure).

        Returns:
            whether the checkpoint was new (one already kept is only touched).

        Raises:
            ValueError: a pool without state checkpoints, a bad ``num_tokens``, or a payload of
                the wrong size or dtype.
        """
        return self.resume_rule.save(kv, num_tokens, payload, kind, self.reuse.hash_blocks)

    def save_checkpoints(self, checkpoints: list[Checkpoint]) -> None:
        """:meth:`save_checkpoint` each of ``checkpoints`` (what a runner's step produced)."""
        for c in checkpoints:
            self.save_checkpoint(c.kv, c.num_tokens, c.payload, c.kind)

    # ---- the load decision's costs -----------------------------------------------------------
    def recompute_s(self, num_tokens: int) -> float:
        """Seconds the cost model expects prefilling ``num_tokens`` tokens to take (its measured
        prefill rate)."""
        return self.tiers.cost_model.recompute_s(num_tokens)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """Fold a prefill step of ``num_tokens`` tokens that took ``seconds`` into the cost
        model's prefill rate (a step with no tokens or no time is ignored)."""
        self.tiers.cost_model.observe_prefill(num_tokens, seconds)

    def resume_s(self, kv: KVState) -> float:
        """Seconds the cost model expects bringing ``kv``'s computed tokens back to take if it
        were freed now (a preemption) and placed again: each indexed full block
        (``kv.num_registered_blocks``) loaded from the host tier when the pool keeps evicted
        blocks there (:attr:`keeps_evicted_blocks`; a block still in its device page when the
        request comes back costs less), or recomputed when that is cheaper or there is no such
        tier; the tokens past them (the partial last page) recomputed. ``load_s(host, bytes) +
        recompute_s(tokens)`` of :class:`~kvtier.cache.cost_model.CostModel`."""
        cm = self.tiers.cost_model
        blocks = min(kv.num_registered_blocks, kv.num_computed_tokens // self.page_size)
        tail_s = cm.recompute_s(kv.num_computed_tokens - blocks * self.page_size)
        blocks_s = cm.recompute_s(blocks * self.page_size)
        if blocks and self.keeps_evicted_blocks:
            blocks_s = min(blocks_s, cm.load_s(Tier.HOST, blocks * self.block_bytes))
        return blocks_s + tail_s

    def costs(self) -> CostModel:
        """A copy of the cost model now (tier load costs, prefill rate in tokens/s), which the
        pool never changes: what calibration and routing read."""
        return copy.deepcopy(self.tiers.cost_model)

    # ---- tool-aware retention and prefetch ----------------------------------------------------
    def tool_wait(self, session_id, token_ids, expected_wait_s: float) -> None:
        """A session starts waiting on a tool expected to take ``expected_wait_s`` seconds.

        Args:
            session_id: any hashable id of the session.
            token_ids: [num_tokens] the session's token ids so far (a list of ints or a 1-D
                integer array, each in [0, 2**32); bools are not ids); its full blocks are hashed
                with this pool's salt.
            expected_wait_s: seconds, a finite number >= 0.

        What happens to those blocks is the eviction policy's business (nothing under ``lru``);
        the arguments are checked under every policy.

        Raises:
            ValueError: an argument of the wrong type or out of range, naming it.
        """
        self.tool_wait_blocks(session_id, self.prefetcher.hash_tokens(token_ids), expected_wait_s)

    def tool_wait_blocks(self, session_id, hashes: list[bytes], expected_wait_s: float) -> None:
        """:meth:`tool_wait` given the session's block hashes (16-byte chain hashes with this
        pool's salt, as ``KVState.block_hashes`` holds them) instead of its tokens.

        Raises:
            ValueError: an unhashable ``session_id``, ``hashes`` that are not a list of 16-byte
                ``bytes``, or a bad ``expected_wait_s``.
        """
        self.prefetcher.tool_wait_blocks(session_id, hashes, expected_wait_s)
        self.resume_rule.tool_wait(session_id, hashes)

    def tool_return(self, session_id) -> None:
        """The session's tool returned; its blocks lose any special treatment."""
        self.prefetcher.tool_return(session_id)
        self.resume_rule.tool_return(session_id)

    def returns_within(self, before_s: float, after_s: float) -> int:
        """Sessions waiting on a tool (:meth:`tool_wait`, under any policy) whose expected return
        is at most ``before_s`` seconds ago or ``after_s`` seconds ahead (the pool's clock).
        Sessions overdue by more than ``before_s`` are forgotten: they never count again."""
        return self.prefetcher.returns_within(before_s, after_s)

    def set_resume_target(self, resume_ttft_s: float | None) -> None:
        """Plan later tool waits so the session's next turn has a TTFT within ``resume_ttft_s``
        seconds when capacity allows (None: no target). Under ``tool-aware`` a waiting session's
        blocks are kept on the device through the wait, or demoted and prefetched back the cost
        model's load time plus a margin before the expected return
        (:func:`kvtier.cache.eviction.plan_resume`); ``lru`` does neither.

        Raises:
            ValueError: a target that is not a finite number > 0.
        """
        self.prefetcher.set_target(resume_ttft_s)

    # ---- background work ----------------------------------------------------------------------
    def poll(self, wait: bool = False) -> None:
        """Advance background work: finish ended writes and prefetches, start due prefetches.

        With ``wait``, block until every write (and its follow-up copies) and prefetch ended.
        """
        self.prefetcher.start_due()
        self.prefetcher.finish(wait)
        self.writes.finish(wait)
        self.resume_rule.poll(wait)
        if self.event_sink is not None:
            events = self.tiers.index.drain_events()
            states = self.resume_rule.drain_events()
            if states:
                self.event_sink(events, states)
            elif events:
                self.event_sink(events)

    # ---- blocks for another worker (P/D transfer) -----------------------------------------------
    def held_prefix(self, hashes: list[bytes]) -> int:
        """How many leading blocks of ``hashes`` this pool holds in a local tier (device, host, disk)."""
        return self.block_io.held_prefix(hashes)

    def export_blocks(self, hashes: list[bytes]):
        """``(hashes, payload)``: the device copies of blocks ``hashes`` in one page-first uint8 CPU
        buffer of ``len(hashes) * block_bytes``; None if one has no device copy or the copy failed
        (:meth:`kvtier.cache.block_io.BlockIO.export_blocks`)."""
        return self.block_io.export_blocks(hashes)

    def import_blocks(self, blocks: list[tuple[bytes, bytes]]) -> dict[str, int]:
        """Place checked ``(hash, payload)`` blocks into free device pages as cached copies; counts
        ``{"stored", "duplicate", "refused"}`` (:meth:`kvtier.cache.block_io.BlockIO.import_blocks`)."""
        return self.block_io.import_blocks(blocks)

    def layouts(self) -> dict[str, BlockMeta]:
        """The layout of each kind of object this pool exchanges with another worker, by the name it
        travels under: ``blocks`` (:attr:`meta`), then what its resume rule needs at a prefix's end
        (a hybrid model's ``states``, :meth:`export_resume_point`)."""
        return {"blocks": self.meta} | self.resume_rule.layouts()

    def export_resume_point(self, block_hash: bytes) -> dict[str, torch.Tensor]:
        """What another worker needs besides the blocks to resume a prefix that ends with block
        ``block_hash``, by kind (a uint8 CPU tensor of its layout each; empty for an attention-only
        pool, or where this pool holds nothing there or could not read it back)."""
        return self.resume_rule.export(block_hash)

    def import_values(self, kind: str, values: list[tuple[bytes, bytes]]) -> dict[str, int]:
        """Keep checked ``(key, payload)`` values of ``kind`` (a name of :meth:`layouts`) another worker
        sent: blocks as :meth:`import_blocks`, the rest as resume points (turn ends, in every tier
        with room); counts ``{"stored", "duplicate", "refused"}``.

        Raises:
            ValueError: this pool keeps nothing of ``kind``.
        """
        if kind == "blocks":
            return self.import_blocks(values)
        if kind not in self.layouts():
            raise ValueError(f"kind must be one of {list(self.layouts())}, got {kind!r}")
        return self.resume_rule.import_(values)

    def copy_job_costs(self, jobs: int = 512) -> tuple[float, float]:
        """Seconds per host -> device and disk -> host copy job of this pool's copy engine
        (:meth:`kvtier.cache.tiers.PoolTiers.copy_job_costs`)."""
        return self.tiers.copy_job_costs(jobs)

    def publish_events_to(self, sink: Callable[[list], None] | None) -> None:
        """From now on, hand the index's events (:class:`kvtier.cache.prefix_index.Event`) to
        ``sink`` in one batch per :meth:`poll` (e.g. a :class:`kvtier.cache.kv_events.KVEventPublisher`),
        with a hybrid pool's state checkpoint events as a second argument when there are some;
        None stops. Events from before the call are dropped: call it before serving."""
        self.tiers.index.drain_events()
        self.resume_rule.drain_events()
        self.event_sink = sink

    def close(self) -> None:
        """Release the remote tier's connections (the pool's other resources are memory)."""
        self.resume_rule.close()
        if self.tiers.remote is not None:
            self.tiers.remote.close()
