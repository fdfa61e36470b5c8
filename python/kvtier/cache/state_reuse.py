"""Exact prefix reuse for hybrid models: MLA blocks and the recurrent-state checkpoint at their end,
restored together or not at all.

A hybrid model's sequence can resume after ``k`` blocks only from the KDA state at exactly that
boundary: the MLA blocks alone would skip tokens the state never took in, the state alone has no
KV to attend to. So for a pool with state checkpoints (:class:`kvtier.cache.tiers.checkpoints.CheckpointStore`):

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

The restored state reaches the caller as ``KVState.restored_state`` (the checkpoint's bytes) with
``KVState.state_tokens`` (where it stands); the caller loads it into the sequence's state slot.
"""

from __future__ import annotations

import torch

from kvtier.cache.checkpoint_index import TIER_NAMES
from kvtier.cache.kv_state import KVState
from kvtier.cache.prefix_index import Tier
from kvtier.cache.tiers import PoolTiers
from kvtier.cache.tiers.checkpoints import CheckpointKind, CheckpointStore

_REMOTE_LOOKUP_KEYS = 4096  # checkpoint keys below the matched prefix's end asked of a remote store at most
_PRICED_POINTS = 16  # resume points the cost model compares at most (longest first)


class StateReuse:
    """The checkpoint side of a hybrid pool's prefix reuse (see the module docstring)."""

    def __init__(self, tiers: PoolTiers, store: CheckpointStore):
        self.tiers, self.store = tiers, store
        self.page_size = tiers.config.page_size
        self._sessions: dict[object, list[bytes]] = {}  # tool-waiting session -> protected keys

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

    def choose(self, hashes: list[bytes], rows, *, remote: bool) -> tuple[int, Tier | None, int]:
        """The resume point of a matched prefix: ``(k, tier, lost)``, the blocks to place, where
        the checkpoint at their end comes from (``(0, None)``: compute from token 0), and the
        matched tokens past the last reachable checkpoint (what exact hits lose).

        Args:
            hashes: the prompt's block hashes; ``rows``: the index rows of its matched blocks
                (``len(rows)`` blocks reachable, as ``PrefixReuse.match`` returns them).
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

    def count_lost(self, tokens: int) -> None:
        """Count ``tokens`` matched MLA tokens a placed prefix lost to a missing checkpoint."""
        self.store.stats.tokens_lost += tokens

    def start(self, kv: KVState, hashes: list[bytes], k: int, tier: Tier | None) -> None:
        """Start reading the checkpoint after block ``k`` (nothing for ``k == 0``)."""
        kv.restored_state, kv.state_tokens = None, 0
        kv.state_read = None if k == 0 else (k, self.store.read(hashes[k - 1], tier))

    def done(self, kv: KVState) -> bool:
        """Whether ``kv``'s checkpoint read ended (True when none runs)."""
        return kv.state_read is None or kv.state_read[1].done()

    def wait(self, kv: KVState, timeout_s: float | None) -> None:
        """Block until ``kv``'s checkpoint read ended or ``timeout_s`` seconds passed (None: no limit)."""
        if kv.state_read is not None:
            kv.state_read[1].wait(timeout_s)

    def settle(self, kv: KVState, loaded_blocks: int) -> int:
        """The blocks to place once the checkpoint read and the block loads ended:
        ``loaded_blocks`` leading blocks loaded. Sets ``kv.restored_state`` / ``kv.state_tokens``;
        falls back (see the module docstring) when the checkpoint or a block failed."""
        pending, kv.state_read = kv.state_read, None
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
        kv.restored_state, kv.state_tokens = read.payload, k * self.page_size
        self.store.stats.hits[TIER_NAMES[read.tier]] += 1
        return k

    def save(self, kv: KVState, num_tokens: int, payload, kind: CheckpointKind) -> bool:
        """Store ``payload`` as the checkpoint after ``kv``'s first ``num_tokens`` tokens (its block
        hashes must reach that far). Returns whether it was new."""
        return self.store.save(kv.block_hashes[num_tokens // self.page_size - 1], payload, kind)

    # ---- checkpoints for another worker (P/D transfer) ----------------------------------------
    def export(self, key: bytes):
        """Checkpoint ``key``'s bytes (a ``[checkpoint_bytes]`` uint8 CPU tensor) read from its
        fastest tier, or None when no tier holds it or the read failed."""
        tier = self.store.locate(key)
        if tier is None:
            return None
        read = self.store.read(key, tier)
        read.wait()
        return read.payload.cpu() if self.store.ended(read) else None

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
