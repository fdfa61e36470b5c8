"""Where a cached prefix may resume: the pool's resume rule.

:class:`kvtier.cache.prefix_reuse.PrefixReuse` asks its rule where a matched prefix may resume,
starts the rule's reads beside the block loads and lets it settle the placement. An
attention-only model resumes after any block (:class:`EveryBlock`, the null rule: nothing to read,
nothing to restore). A hybrid model (KDA + MLA) resumes only at a recurrent-state checkpoint
(:class:`CheckpointReuse`): the MLA blocks alone would skip tokens the state never took in, the
state alone has no KV to attend to. For it:

- **choosing**: the reusable prefix is the longest one whose MLA blocks are reachable and whose
  checkpoint at exactly that boundary is reachable, each on any tier; among those points the cost
  model takes the one that saves the most (:meth:`kvtier.cache.cost_model.CostModel.best_resume_point`).
  Matched MLA tokens past the last reachable checkpoint are counted as lost (``tokens_lost``).
- **restoring**: the checkpoint read starts beside the block loads; the prefix is placed only when
  both ended well. A checkpoint that fails its check (missing, or corrupt: CRC, size, key) or a
  block load that failed falls back to the longest earlier point whose blocks loaded and whose
  checkpoint reads back (read then, synchronously), down to token 0; each fallback is counted.
- **retention**: a session waiting on a tool keeps its last checkpoint protected in every tier
  that holds it until the tool returns.

The restored state leaves the pool as data: :meth:`take_restore` hands the placed prefix's
:class:`~kvtier.cache.checkpoints.index.Checkpoint` to whoever places the request's first chunk
(the scheduler puts it on the step's batch), which loads it into the sequence's state slot. The
request's :class:`~kvtier.cache.kv_state.KVState` carries no state.
"""

from __future__ import annotations

import torch

from kvtier.cache.checkpoints.index import TIER_NAMES, Checkpoint, CheckpointKind
from kvtier.cache.checkpoints.store import CheckpointStore, open_checkpoints
from kvtier.cache.kv_state import KVState
from kvtier.cache.prefix_index import Tier
from kvtier.cache.tiers import PoolTiers

_REMOTE_LOOKUP_KEYS = 4096  # checkpoint keys below the matched prefix's end asked of a remote store at most
_PRICED_POINTS = 16  # resume points the cost model compares at most (longest first)


class EveryBlock:
    """The resume rule of an attention-only model: a prefix resumes after any block it matched.

    Every method is the identity or does nothing; :meth:`save` raises, as there is nowhere to
    keep a checkpoint.

    Attributes:
        store, stats: None (no checkpoints are kept or counted).
    """

    store = stats = None

    def choose(self, hashes: list[bytes], rows, take: int, *, remote: bool) -> tuple[int, Tier | None, int]:
        """``(take, None, 0)``: the cost model's choice stands, nothing is lost."""
        return take, None, 0

    def start(self, kv: KVState, hashes: list[bytes], placed: int, chosen: int, point: Tier | None,
              lost: int) -> None:
        """Nothing to read."""

    def done(self, kv: KVState) -> bool:
        """True: nothing is read."""
        return True

    def wait(self, kv: KVState, timeout_s: float | None) -> None:
        """Nothing to wait for."""

    def settle(self, kv: KVState, loaded_blocks: int) -> int:
        """``loaded_blocks``: every loaded block is a resume point."""
        return loaded_blocks

    def truncate(self, kv: KVState, num_tokens: int) -> int:
        """``num_tokens``: a prefix may be cut anywhere."""
        return num_tokens

    def take_restore(self, kv: KVState) -> Checkpoint | None:
        """None: there is no state to restore."""
        return None

    def free(self, kv: KVState) -> None:
        """Nothing is held for ``kv``."""

    def save(self, kv: KVState, num_tokens: int, payload, kind: CheckpointKind, hash_blocks) -> bool:
        """Raises ValueError: this pool keeps no checkpoints."""
        raise ValueError("save_checkpoint needs a pool with state checkpoints (state_checkpoint_bytes > 0 and "
                         "prefix caching on)")

    def layouts(self) -> dict:
        """Nothing besides the blocks travels to another worker."""
        return {}

    def export(self, key: bytes) -> dict:
        """Nothing besides the blocks is needed to resume on another worker."""
        return {}

    def tool_wait(self, session_id, hashes: list[bytes]) -> None:
        """Nothing to protect."""

    def tool_return(self, session_id) -> None:
        """Nothing was protected."""

    def sections(self) -> dict:
        """No counters beyond the blocks' (:attr:`kvtier.cache.pool_stats.PoolSnapshot.sections`)."""
        return {}

    def poll(self, wait: bool = False) -> None:
        """No writes run."""

    def drain_events(self) -> list:
        """No events: ``[]``."""
        return []

    def close(self) -> None:
        """Nothing to close."""


class CheckpointReuse(EveryBlock):
    """The resume rule of a hybrid model: only at a checkpoint (see the module docstring).

    Args:
        tiers: the pool's tiers (index, cost model, block bytes).
        store: the pool's :class:`~kvtier.cache.checkpoints.store.CheckpointStore` (on the
            simulator's virtual-time tiers in a simulated worker).
    """

    def __init__(self, tiers: PoolTiers, store: CheckpointStore):
        self.tiers, self.store, self.stats = tiers, store, store.stats
        self.page_size = tiers.config.page_size
        self._sessions: dict[object, list[bytes]] = {}  # tool-waiting session -> protected keys
        self._reads: dict[int, tuple[int, object]] = {}  # id(kv) -> (blocks, read in flight)
        self._restores: dict[int, Checkpoint] = {}  # id(kv) -> the placed prefix's checkpoint

    def points(self, hashes: list[bytes], num_blocks: int, limit: int | None = None) -> list[tuple[int, Tier]]:
        """``(k, tier)`` for each boundary ``k <= num_blocks`` (longest first) whose checkpoint is
        indexed, with its fastest tier; the first ``limit`` only (None: all)."""
        out = []
        for k in range(num_blocks, 0, -1):
            tier = self.store.locate(hashes[k - 1])
            if tier is not None:
                out.append((k, tier))
                if limit is not None and len(out) >= limit:
                    break
        return out

    def choose(self, hashes: list[bytes], rows, take: int, *, remote: bool) -> tuple[int, Tier | None, int]:
        """The resume point of a matched prefix: ``(k, tier, lost)``, the blocks to place, where
        the checkpoint at their end comes from (``(0, None)``: compute from token 0), and the
        matched tokens past the last reachable checkpoint (what exact hits lose).

        Args:
            hashes: the prompt's block hashes; ``rows``: the index rows of its matched blocks
                (``len(rows)`` blocks reachable, as ``PrefixReuse.match`` returns them).
            take: the blocks the cost model would load without a checkpoint (not used: the
                checkpoint's cost is priced with them).
            remote: ask the remote store for checkpoint keys not indexed yet.

        The :data:`_PRICED_POINTS` longest points are priced (an earlier one saves less unless
        every later one sits in a slow tier, and the list is walked every step per waiting request).
        """
        n = len(rows)
        if n == 0:
            return 0, None, 0
        if remote:
            self.store.lookup_remote(hashes[max(0, n - _REMOTE_LOOKUP_KEYS):n])
        points = self.points(hashes, n, _PRICED_POINTS)
        lost = (n - (points[0][0] if points else 0)) * self.page_size
        t = self.tiers
        sources = t.fastest_tiers(rows)
        j = t.cost_model.best_resume_point(sources, t.block_bytes, self.page_size, points, self.store.checkpoint_bytes)
        return (0, None, lost) if j < 0 else (*points[j], lost)

    def start(self, kv: KVState, hashes: list[bytes], placed: int, chosen: int, point: Tier | None,
              lost: int) -> None:
        """Count ``lost`` tokens and start reading the checkpoint after the ``placed`` blocks: at
        ``chosen`` from ``point`` when all were placed, else at the best point they reach."""
        self.store.stats.tokens_lost += lost
        k = chosen
        if placed < chosen:  # fewer pages than planned: the best point the placed blocks reach
            k, point = next(iter(self.points(hashes, placed)), (0, None))
        self.free(kv)
        if k:
            self._reads[id(kv)] = (k, self.store.read(hashes[k - 1], point))

    def done(self, kv: KVState) -> bool:
        """Whether ``kv``'s checkpoint read ended (True when none runs)."""
        pending = self._reads.get(id(kv))
        return pending is None or pending[1].done()

    def wait(self, kv: KVState, timeout_s: float | None) -> None:
        """Block until ``kv``'s checkpoint read ended or ``timeout_s`` seconds passed (None: no limit)."""
        pending = self._reads.get(id(kv))
        if pending is not None:
            pending[1].wait(timeout_s)

    def settle(self, kv: KVState, loaded_blocks: int) -> int:
        """The blocks to place once the checkpoint read and the block loads ended
        (``loaded_blocks`` leading blocks loaded); keeps the restored checkpoint for
        :meth:`take_restore`; falls back (see the module docstring) when the checkpoint or a block
        failed."""
        pending = self._reads.pop(id(kv), None)
        if pending is None:
            return 0
        k, read = pending
        ok = self.store.ended(read)
        if ok and loaded_blocks >= k:
            return self._restored(kv, k, read)
        self.store.stats.fallbacks += 1
        limit = min(loaded_blocks, k - 1 if not ok else k)
        for k2, tier in self.points(kv.block_hashes, limit):
            read = self.store.read(kv.block_hashes[k2 - 1], tier)
            read.wait()
            if self.store.ended(read):
                return self._restored(kv, k2, read)
        return 0

    def _restored(self, kv: KVState, k: int, read) -> int:
        self._restores[id(kv)] = Checkpoint(kv, k * self.page_size, read.payload)
        self.store.stats.hits[TIER_NAMES[read.tier]] += 1
        return k

    def truncate(self, kv: KVState, num_tokens: int) -> int:
        """``num_tokens``, or 0 when ``kv``'s restored state stands past it (a state cannot be
        moved back: the sequence computes from token 0)."""
        restore = self._restores.get(id(kv))
        if restore is not None and num_tokens < restore.num_tokens:
            del self._restores[id(kv)]
            return 0
        return num_tokens

    def take_restore(self, kv: KVState) -> Checkpoint | None:
        """The checkpoint ``kv``'s placed prefix ends with (``num_tokens``: its boundary;
        ``payload``: ``[checkpoint_bytes]`` uint8), handed over once; None when there is none."""
        return self._restores.pop(id(kv), None)

    def free(self, kv: KVState) -> None:
        """Drop what is held for ``kv``: a read in flight ends unused, a restore is forgotten."""
        self._restores.pop(id(kv), None)
        pending = self._reads.pop(id(kv), None)
        if pending is not None:
            pending[1].wait()

    def save(self, kv: KVState, num_tokens: int, payload, kind: CheckpointKind, hash_blocks) -> bool:
        """Store ``payload`` as the checkpoint after ``kv``'s first ``num_tokens`` tokens
        (``hash_blocks(kv, n)`` extends its block hashes to ``n`` blocks first). Returns whether
        it was new. ValueError: ``num_tokens`` not a positive multiple of ``page_size`` within the
        request's tokens."""
        ps = self.page_size
        if not isinstance(num_tokens, int) or num_tokens <= 0 or num_tokens % ps or num_tokens > kv.num_tokens:
            raise ValueError(f"num_tokens must be a positive multiple of page_size={ps} and at most the request's "
                             f"{kv.num_tokens} tokens, got {num_tokens!r}")
        hash_blocks(kv, num_tokens // ps)
        return self.store.save(kv.block_hashes[num_tokens // ps - 1], payload, kind)

    def sections(self) -> dict:
        """``{"state": a copy of the checkpoint counters}`` (:class:`kvtier.cache.checkpoints.index.StateStats`;
        :attr:`kvtier.cache.pool_stats.PoolSnapshot.sections`)."""
        return {"state": self.stats.copy()}

    def poll(self, wait: bool = False) -> None:
        """Index the store's writes that ended (all of them, waiting, with ``wait``)."""
        self.store.poll(wait)

    def drain_events(self) -> list:
        """The store's ``(stored, tier, key)`` events since the last call."""
        return self.store.drain_events()

    def close(self) -> None:
        """Wait for the store's writes and stop its threads."""
        self.store.close()

    # ---- checkpoints for another worker (P/D transfer) ----------------------------------------
    def layouts(self) -> dict:
        """``{"states": the checkpoint layout}``: a prefix resumes on another worker only with the
        checkpoint at its end, sent as a value of this layout."""
        return {"states": self.store.meta}

    def export(self, key: bytes) -> dict:
        """``{"states": checkpoint key's bytes}`` (a ``[checkpoint_bytes]`` uint8 CPU tensor) read
        from its fastest tier; empty when no tier holds it or the read failed."""
        tier = self.store.locate(key)
        if tier is None:
            return {}
        read = self.store.read(key, tier)
        read.wait()
        return {"states": read.payload.cpu()} if self.store.ended(read) else {}

    def import_(self, values: list[tuple[bytes, bytes]]) -> dict[str, int]:
        """Keep checked checkpoints ``(key, payload bytes)`` from another worker as turn ends;
        counts ``{"stored", "duplicate", "refused"}`` (refused: no tier had room)."""
        counts = {"stored": 0, "duplicate": 0, "refused": 0}
        for key, raw in values:
            if self.store.locate(key) is not None:
                counts["duplicate"] += 1
                continue
            self.store.save(key, torch.frombuffer(bytearray(raw), dtype=torch.uint8), CheckpointKind.TURN)
            counts["stored" if self.store.locate(key) is not None or self.store.pending(key) else "refused"] += 1
        return counts

    # ---- tool-aware retention -----------------------------------------------------------------
    def tool_wait(self, session_id, hashes: list[bytes]) -> None:
        """Protect the last checkpoint under ``hashes`` (a waiting session's blocks) until
        :meth:`tool_return`."""
        self.tool_return(session_id)
        for k, _ in self.points(hashes, len(hashes))[:1]:
            key = hashes[k - 1]
            self.store.protect([key])
            self._sessions[session_id] = [key]

    def tool_return(self, session_id) -> None:
        """The session's tool returned: its checkpoint is evictable again (nothing for an unknown session)."""
        self.store.unprotect(self._sessions.pop(session_id, []))


def resume_rule(tiers: PoolTiers, store: CheckpointStore | None = None) -> EveryBlock:
    """A pool's resume rule: :class:`CheckpointReuse` over ``store`` (None: the store its config
    asks for, ``state_checkpoint_bytes`` with prefix caching, :func:`open_checkpoints`), or
    :class:`EveryBlock` when it keeps no checkpoints."""
    c = tiers.config
    if store is None and c.state_checkpoint_bytes and c.enable_prefix_caching:
        store = open_checkpoints(tiers)
    return EveryBlock() if store is None else CheckpointReuse(tiers, store)


__all__ = ["CheckpointReuse", "EveryBlock", "resume_rule"]
