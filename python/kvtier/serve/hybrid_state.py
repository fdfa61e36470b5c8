"""The engine's side of a hybrid model's recurrent state: one KDA state slot per running sequence,
and the checkpoints it hands the pool.

A hybrid model (:class:`kvtier.model.kimi_linear.KimiLinearForCausalLM`: KDA + MLA layers) keeps,
beside the MLA layers' KV pages, a fixed-size recurrent state per sequence in a
:class:`kvtier.model.state_slots.StateSlots` pool. :class:`HybridState` owns that pool for a
:class:`kvtier.serve.runner.ModelRunner` (``max_num_seqs`` slots) and does its bookkeeping:

- a sequence gets a slot the first step it runs (admission). The slot starts from zeros when the
  sequence starts at token 0, or from the checkpoint the pool restored with its cached prefix
  (``KVState.restored_state`` at ``KVState.state_tokens``, :mod:`kvtier.cache.state_reuse`);
- a chunked prefill's next chunk starts from the state the previous chunk left in the slot;
- the slot of a sequence that is no longer running (finished, aborted or preempted) is freed at
  the start of the next step the runner runs, before any slot is taken.

With a pool that keeps states (:attr:`kvtier.cache.pool.KVPool.keeps_states`), the forward hands
back the state at chosen page boundaries, saved as checkpoints after the step (:meth:`HybridState.save`):

- **prompt end**: the last page boundary of what a prefill chunk computes up to the sequence's
  tokens so far (a prompt, or a preempted sequence's prompt and output), and the page boundary
  before it when the tokens end on one (where the same prompt sent again resumes) --
  :attr:`CheckpointKind.TURN`;
- **turn end**: the last page boundary a decode step crossed, kept (one copy per sequence) and
  saved when the sequence stops running (finished, or preempted) -- ``TURN``;
- **grid**: every ``state_checkpoint_tokens`` tokens of a prefill -- :attr:`CheckpointKind.GRID`.

Without such a pool (prefix caching off), a preempted sequence recomputes from its first token and
no prefix is reused across requests (:func:`device_only` turns the tiers off).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from kvtier.cache.pool import KVPool
from kvtier.cache.tiers.checkpoints import CheckpointKind
from kvtier.model.kimi_linear import KimiLinearForCausalLM
from kvtier.model.state_slots import StateBatch, StateCheckpoints, StateSlots
from kvtier.serve.config import EngineConfig
from kvtier.serve.request import Sequence, SequenceStatus
from kvtier.serve.step_plan import ScheduledBatch

log = logging.getLogger(__name__)


def is_hybrid(model) -> bool:
    """Whether ``model`` is a hybrid KDA + MLA model (it needs state slots)."""
    return isinstance(model, KimiLinearForCausalLM)


def device_only(config: EngineConfig) -> EngineConfig:
    """``config`` as a hybrid model runs it without prefix caching: no host, disk or remote tier
    (every prompt is computed from its first token). Logs a warning that says what it turned
    off (nothing when nothing was on). With prefix caching on, ``config`` is returned as it is:
    the pool keeps state checkpoints beside the MLA blocks (:func:`with_checkpoints`)."""
    pool = config.pool
    if pool.enable_prefix_caching:
        return config
    tiers = [name for name, on in (("host_cache_bytes", pool.host_cache_bytes > 0),
                                   ("disk_cache_dir", pool.disk_cache_dir is not None),
                                   ("remote_cache_url", pool.remote_cache_url is not None)) if on]
    if not tiers:
        return config
    log.warning("hybrid KDA + MLA model with prefix caching off: ignoring %s (nothing to reuse)", ", ".join(tiers))
    pool = dataclasses.replace(pool, host_cache_bytes=0, disk_cache_dir=None, disk_cache_bytes=0,
                               remote_cache_url=None)
    return dataclasses.replace(config, pool=pool)


def default_checkpoint_tokens(checkpoint_bytes: int, kv_bytes_per_token: int, page_size: int) -> int:
    """The default grid spacing of state checkpoints: the tokens whose MLA KV takes as many bytes
    as one checkpoint, rounded up to a page (so the grid at most doubles a prefix's bytes); at
    least one page. Kimi K3 (429 MiB fp32 state, 27,648 B/token): 16,896 tokens at 64-token pages."""
    tokens = -(-checkpoint_bytes // max(1, kv_bytes_per_token))
    return max(page_size, -(-tokens // page_size) * page_size)


def with_checkpoints(config: EngineConfig, checkpoint_bytes: int, kv_bytes_per_token: int) -> EngineConfig:
    """``config`` with its pool keeping state checkpoints of ``checkpoint_bytes`` bytes (prefix
    caching on): ``state_checkpoint_tokens`` 0 becomes :func:`default_checkpoint_tokens`."""
    pool = config.pool
    if not pool.enable_prefix_caching:
        return device_only(config)
    grid = pool.state_checkpoint_tokens or default_checkpoint_tokens(checkpoint_bytes, kv_bytes_per_token,
                                                                     pool.page_size)
    pool = dataclasses.replace(pool, state_checkpoint_bytes=checkpoint_bytes, state_checkpoint_tokens=grid)
    return dataclasses.replace(config, pool=pool)


class HybridState:
    """The state slots of a hybrid model's running sequences and the checkpoints they yield.

    Args:
        model: the hybrid model (its config sizes the slots; recurrent states fp32, conv windows
            in the model's dtype, on its device).
        num_slots: slots in the pool (the engine's ``max_num_seqs``).
        page_size: tokens per page (checkpoints sit on page boundaries).
        checkpoint_tokens: the grid spacing of prefill checkpoints (a multiple of ``page_size``),
            or 0 to take no checkpoints (a pool that keeps no states).

    Attributes:
        slots: the :class:`StateSlots` pool the model's forward reads and writes.
    """

    def __init__(self, model: KimiLinearForCausalLM, num_slots: int, page_size: int = 16, checkpoint_tokens: int = 0):
        self.slots = StateSlots(model.config, num_slots, state_dtype=torch.float32, conv_dtype=model.dtype,
                                device=model.embed_tokens.device)
        self.device = model.embed_tokens.device
        self.page_size, self.checkpoint_tokens = page_size, checkpoint_tokens
        self._held: dict[int, tuple[Sequence, int]] = {}  # seq_id -> (sequence, slot)
        self._absorbed: dict[int, int] = {}  # seq_id -> tokens the slot's state has taken in
        self._asked: list[tuple[Sequence, int, CheckpointKind]] = []  # this step's checkpoints, in batch order
        self._taken: list[tuple[Sequence, int, torch.Tensor, CheckpointKind]] = []  # to save after the step
        self._last: dict[int, tuple[Sequence, int, torch.Tensor]] = {}  # seq_id -> its last decode boundary

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes of one checkpoint (:meth:`StateSlots.pack`)."""
        return self.slots.checkpoint_bytes

    def slot_of(self, seq: Sequence) -> int | None:
        """The slot ``seq`` holds, or None."""
        held = self._held.get(seq.seq_id)
        return None if held is None else held[1]

    def release_stale(self) -> None:
        """Free the slots of sequences that are no longer running (finished, aborted, preempted)."""
        for seq_id, (seq, slot) in list(self._held.items()):
            if seq.status is not SequenceStatus.RUNNING:
                del self._held[seq_id], self._absorbed[seq_id]
                self.slots.free(slot)

    def _slot_for(self, seq: Sequence) -> int:
        start = seq.num_computed_tokens
        held = self._held.get(seq.seq_id)
        if held is None:
            slot = self.slots.allocate()  # zeroed
            self._held[seq.seq_id], self._absorbed[seq.seq_id] = (seq, slot), 0
        else:
            slot = held[1]
        kv = seq.kv
        if start == 0:
            if self._absorbed[seq.seq_id]:
                self.slots.reset(slot)  # re-admitted after preemption: recomputed from scratch
        elif kv.restored_state is not None and kv.state_tokens == start:
            self.slots.unpack(slot, kv.restored_state)  # the checkpoint placed with its cached prefix
        elif self._absorbed[seq.seq_id] != start:
            raise RuntimeError(f"sequence {seq.seq_id}: its KDA state has taken in {self._absorbed[seq.seq_id]} "
                               f"tokens but the step runs it from token {start}, and no checkpoint was restored "
                               "there")
        kv.restored_state = None
        self._absorbed[seq.seq_id] = start
        return slot

    def state_batch(self, batch: ScheduledBatch) -> StateBatch:
        """The step's :class:`StateBatch`: each sequence's slot in the step's order (extend chunks,
        then decodes), allocating, resetting or restoring slots as the module docstring says, and
        the page boundaries whose states the forward hands back."""
        self.release_stale()
        as_slots = lambda seqs: torch.tensor([self._slot_for(s) for s in seqs], dtype=torch.int32,  # noqa: E731
                                             device=self.device)
        state = StateBatch(prefill_slots=as_slots([s for s, _ in batch.extends]) if batch.extends else None,
                           decode_slots=as_slots(batch.decodes) if batch.decodes else None)
        self._asked = []
        if self.checkpoint_tokens:
            rows, lens = [], []
            for i, (seq, n) in enumerate(batch.extends):
                for boundary, kind in self.boundaries(seq.num_computed_tokens, n, seq.num_tokens):
                    rows.append(i)
                    lens.append(boundary - seq.num_computed_tokens)
                    self._asked.append((seq, boundary, kind))
            if rows:
                state.checkpoint_seq = torch.tensor(rows, dtype=torch.int32, device=self.device)
                state.checkpoint_len = torch.tensor(lens, dtype=torch.int32, device=self.device)
        return state

    def boundaries(self, start: int, num_new: int, num_tokens: int) -> list[tuple[int, CheckpointKind]]:
        """The checkpoint boundaries of a prefill chunk of ``num_new`` tokens from ``start``, of a
        sequence of ``num_tokens`` tokens so far: grid points, and its last page boundary (and the
        one before when the tokens end on a page boundary: the point the same prompt resumes from)."""
        ps, grid = self.page_size, self.checkpoint_tokens
        # The last page boundary, and the last one a request of exactly these tokens can reuse
        # (its last token is always computed): they differ when the tokens fill their last page.
        ends = {(num_tokens // ps) * ps, ((num_tokens - 1) // ps) * ps}
        out = []
        for b in range((start // ps + 1) * ps, start + num_new + 1, ps):
            if b in ends:
                out.append((b, CheckpointKind.TURN))
            elif b % grid == 0:
                out.append((b, CheckpointKind.GRID))
        return out

    def ran(self, batch: ScheduledBatch, checkpoints: StateCheckpoints | None = None) -> None:
        """Count the tokens each sequence's state took in by running ``batch``; keep the states
        the forward handed back (``checkpoints``, rows as :meth:`state_batch` asked) and the state
        of each decode that ended on a page boundary."""
        for seq, n in [*batch.extends, *((s, 1) for s in batch.decodes)]:
            self._absorbed[seq.seq_id] = seq.num_computed_tokens + n
        if checkpoints is not None:
            for row, (seq, boundary, kind) in enumerate(self._asked):
                self._taken.append((seq, boundary, self.slots.pack_checkpoint(checkpoints, row), kind))
        self._asked = []
        if self.checkpoint_tokens:
            for seq in batch.decodes:
                boundary = seq.num_computed_tokens + 1
                if boundary % self.page_size == 0:
                    self._last[seq.seq_id] = (seq, boundary, self.slots.pack(self._held[seq.seq_id][1]))

    def save(self, pool: KVPool) -> None:
        """Hand the pool the checkpoints of the last step, and the last decode boundary of each
        sequence that stopped running (finished or preempted), as turn ends. Call after the
        step's sequences advanced."""
        taken, self._taken = self._taken, []
        for seq, boundary, payload, kind in taken:
            pool.save_checkpoint(seq.kv, boundary, payload, kind)
        for seq_id, (seq, boundary, payload) in list(self._last.items()):
            if seq.status is SequenceStatus.RUNNING:
                continue
            del self._last[seq_id]
            if seq.finish_reason not in ("abort", "error") and boundary <= seq.num_tokens:
                pool.save_checkpoint(seq.kv, boundary, payload, CheckpointKind.TURN)


__all__ = ["HybridState", "default_checkpoint_tokens", "device_only", "is_hybrid", "with_checkpoints"]
