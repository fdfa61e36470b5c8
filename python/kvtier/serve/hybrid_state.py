"""The engine's side of a hybrid model's recurrent state: one KDA state slot per running sequence,
and the checkpoints it hands the pool.

A hybrid model (:class:`kvtier.model.kimi_linear.KimiLinearForCausalLM`: KDA + MLA layers) keeps,
beside the MLA layers' KV pages, a fixed-size recurrent state per sequence in a
:class:`kvtier.model.state_slots.StateSlots` pool. :class:`HybridState` owns that pool for a
:class:`kvtier.serve.runner.ModelRunner` (``max_num_seqs`` slots) and does its bookkeeping:

- a sequence gets a slot the first step it runs (admission). The slot starts from zeros when the
  sequence starts at token 0, or from the checkpoint the pool restored with its cached prefix,
  which rides on the step's batch (``ScheduledBatch.restores``, :mod:`kvtier.cache.checkpoints.reuse`);
- a chunked prefill's next chunk starts from the state the previous chunk left in the slot;
- the slot of a sequence that is no longer running (finished, aborted or preempted) is freed at
  the start of the next step the runner runs, before any slot is taken.

With checkpoints on (``checkpoint_tokens`` > 0), the forward hands back the state at chosen page
boundaries (:class:`CheckpointPlan`, which the simulator's timed runner shares), and the runner
returns them in its step result for the engine to hand the pool (``StepResult.checkpoints``):

- **prompt end**: the last page boundary of what a prefill chunk computes up to the sequence's
  tokens so far (a prompt, or a preempted sequence's prompt and output), and the page boundary
  before it when the tokens end on one (where the same prompt sent again resumes) --
  :attr:`CheckpointKind.TURN`;
- **turn end**: the last page boundary a decode step crossed, packed into a host-memory row of
  the sequence's slot (no device memory; every step's result offers it,
  ``StepResult.turn_ends``, and the engine saves it for a sequence that finished) or returned by
  the next step when the sequence was preempted -- ``TURN``;
- **grid**: every ``state_checkpoint_tokens`` tokens of a prefill -- :attr:`CheckpointKind.GRID`.

Without such a pool (prefix caching off), a preempted sequence recomputes from its first token and
no prefix is reused across requests (:func:`device_only` turns the tiers off).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence as Seq

import torch

from kvtier.cache.checkpoints.index import Checkpoint, CheckpointKind
from kvtier.model.cache_spec import CacheSpec
from kvtier.model.kimi_linear import KimiLinearForCausalLM
from kvtier.model.state_slots import StateBatch, StateCheckpoints, StateSlots
from kvtier.model.step import StepModel
from kvtier.options import check_choice, check_int
from kvtier.serve.config import EngineConfig
from kvtier.serve.request import Sequence, SequenceStatus
from kvtier.serve.step_plan import ScheduledBatch

log = logging.getLogger(__name__)


def device_only(config: EngineConfig) -> EngineConfig:
    """``config`` as a hybrid model runs it without prefix caching: no host, disk or remote tier
    (every prompt is computed from its first token). Logs a warning that says what it turned
    off (nothing when nothing was on). With prefix caching on, ``config`` is returned as it is:
    the pool keeps state checkpoints beside the MLA blocks (:func:`cache_config`)."""
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


def cache_config(config: EngineConfig, spec: CacheSpec) -> EngineConfig:
    """``config`` as a model with cache ``spec`` runs: an attention-only model's as it is; for a
    model with a recurrent state, the pool keeps checkpoints of ``spec.state_bytes`` (prefix
    caching on; a grid spacing of 0 becomes the default, :meth:`PoolConfig.keeping_checkpoints`), or,
    with prefix caching off, no tiers (:func:`device_only`)."""
    pool = config.pool
    if not spec.state_bytes:
        return config
    if not pool.enable_prefix_caching:
        return device_only(config)
    return dataclasses.replace(config, pool=pool.keeping_checkpoints(spec.state_bytes, spec.kv_bytes_per_token))


class CheckpointPlan:
    """Which checkpoints a step yields, without the states: the page boundaries of each prefill
    chunk (:meth:`boundaries`), the last page boundary each decode crossed (a turn's end), and the
    turn ends of sequences that stopped running. :class:`HybridState` fills the payloads from its
    slots; the simulator's timed runner keeps none.

    Args:
        page_size: tokens per page (checkpoints sit on page boundaries).
        checkpoint_tokens: the grid spacing of prefill checkpoints (a multiple of ``page_size``),
            or 0 to take no checkpoints (a pool that keeps none).
        policy: ``"turn"`` (prompt ends, turn ends and the grid) or ``"grid"`` (the grid only:
            prompt ends off the grid are not taken, decodes never).

    Raises:
        ValueError: a bad size, a grid that is not a multiple of ``page_size``, or an unknown policy.
    """

    POLICIES = ("turn", "grid")

    def __init__(self, page_size: int, checkpoint_tokens: int = 0, policy: str = "turn"):
        check_int("page_size", page_size, min_value=1)
        if check_int("checkpoint_tokens", checkpoint_tokens, min_value=0) % page_size:
            raise ValueError(f"checkpoint_tokens must be a multiple of page_size={page_size}, got {checkpoint_tokens}")
        check_choice("policy", policy, self.POLICIES)
        self.page_size, self.checkpoint_tokens, self.policy = page_size, checkpoint_tokens, policy
        self._last: dict[int, tuple[Sequence, Checkpoint]] = {}  # seq_id -> its last decode boundary

    def boundaries(self, start: int, num_new: int, num_tokens: int,
                   returns: Seq[int] = ()) -> list[tuple[int, CheckpointKind]]:
        """The checkpoint boundaries of a prefill chunk of ``num_new`` tokens from ``start``, of a
        sequence of ``num_tokens`` tokens so far: grid points, and its last page boundary (and the
        one before when the tokens end on a page boundary: the point the same prompt resumes from),
        and the last page boundary at or before each of ``returns`` (the positions a later request
        comes back to, ``Sequence.checkpoint_at``: the renderer's end of the tool declaration and of
        the last history message), the last three :attr:`CheckpointKind.TURN`."""
        ps, grid = self.page_size, self.checkpoint_tokens
        # The last page boundary, and the last one a request of exactly these tokens can reuse
        # (its last token is always computed): they differ when the tokens fill their last page.
        ends = {(num_tokens // ps) * ps, ((num_tokens - 1) // ps) * ps} | {b // ps * ps for b in returns}
        out = []
        for b in range((start // ps + 1) * ps, start + num_new + 1, ps):
            if b % grid == 0:
                out.append((b, CheckpointKind.GRID if b not in ends or self.policy == "grid" else CheckpointKind.TURN))
            elif b in ends and self.policy == "turn":
                out.append((b, CheckpointKind.TURN))
        return out

    def asked(self, batch: ScheduledBatch) -> list[tuple[int, Sequence, int, CheckpointKind]]:
        """``(row, seq, boundary, kind)`` for each checkpoint the step's prefill chunks yield
        (``row``: the chunk's index in ``batch.extends``), in batch order; none without a grid."""
        if not self.checkpoint_tokens:
            return []
        return [(i, seq, b, kind) for i, (seq, n) in enumerate(batch.extends)
                for b, kind in self.boundaries(seq.num_computed_tokens, n, seq.num_tokens, seq.checkpoint_at)]

    def decoded(self, batch: ScheduledBatch, snapshot) -> None:
        """Keep, for each decode of ``batch`` that ends on a page boundary, ``snapshot(seq)`` (its
        state's bytes, or None) as its turn end (call before its sequences advance)."""
        if not self.checkpoint_tokens or self.policy != "turn":
            return
        for seq in batch.decodes:
            boundary = seq.num_computed_tokens + 1
            if boundary % self.page_size == 0:
                self._last[seq.seq_id] = (seq, Checkpoint(seq.kv, boundary, snapshot(seq)))

    def turn_ends(self, batch: ScheduledBatch) -> dict[int, Checkpoint]:
        """By ``seq_id``, the turn end each decode of ``batch`` would leave if it stopped now."""
        return {s.seq_id: self._last[s.seq_id][1] for s in batch.decodes if s.seq_id in self._last}

    def stopped(self) -> list[Checkpoint]:
        """Forget the turn ends of sequences no longer running; those of preempted ones (not
        finished: the engine saved a finished one's from :meth:`turn_ends`) are returned."""
        out = []
        for seq_id, (seq, c) in list(self._last.items()):
            if seq.status is SequenceStatus.RUNNING:
                continue
            del self._last[seq_id]
            if seq.status is not SequenceStatus.FINISHED and c.num_tokens <= seq.num_tokens:
                out.append(c)
        return out


def turn_end_checkpoints(finished: list[Sequence], turn_ends: dict[int, Checkpoint]) -> list[Checkpoint]:
    """The turn ends of ``finished`` sequences that stopped well (not aborted, not failed)."""
    return [turn_ends[s.seq_id] for s in finished
            if s.seq_id in turn_ends and s.finish_reason not in ("abort", "error")
            and turn_ends[s.seq_id].num_tokens <= s.num_tokens]


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
        plan: the :class:`CheckpointPlan` of the checkpoints each step yields.
    """

    def __init__(self, model: KimiLinearForCausalLM, num_slots: int, page_size: int = 16, checkpoint_tokens: int = 0):
        self.slots = StateSlots(model.config, num_slots, conv_dtype=model.dtype,
                                device=model.embed_tokens.device)
        self.device = model.embed_tokens.device
        self.plan = CheckpointPlan(page_size, checkpoint_tokens)
        self._held: dict[int, tuple[Sequence, int]] = {}  # seq_id -> (sequence, slot)
        self._absorbed: dict[int, int] = {}  # seq_id -> tokens the slot's state has taken in
        self._asked: list[tuple[int, Sequence, int, CheckpointKind]] = []  # this step's checkpoints
        self._stopped: list[Checkpoint] = []  # turn ends of preempted sequences, returned by this step
        # Each slot's last decode page boundary, packed into a host row kept for the slot's life
        # (pinned beside a GPU): a turn's end costs no device memory (docs/k3.md, the turn-end save).
        self._turn_end_rows: dict[int, torch.Tensor] = {}

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
        # a preempted sequence's turn end leaves its slot's row, which the next holder overwrites
        self._stopped += [dataclasses.replace(c, payload=c.payload.clone()) for c in self.plan.stopped()]
        for seq_id, (seq, slot) in list(self._held.items()):
            if seq.status is not SequenceStatus.RUNNING:
                del self._held[seq_id], self._absorbed[seq_id]
                self.slots.free(slot)

    def _slot_for(self, seq: Sequence, restore: Checkpoint | None) -> int:
        start = seq.num_computed_tokens
        held = self._held.get(seq.seq_id)
        if held is None:
            slot = self.slots.allocate()  # zeroed
            self._held[seq.seq_id], self._absorbed[seq.seq_id] = (seq, slot), 0
        else:
            slot = held[1]
        if start == 0:
            if self._absorbed[seq.seq_id]:
                self.slots.reset(slot)  # re-admitted after preemption: recomputed from scratch
        elif restore is not None and restore.num_tokens == start:
            self.slots.unpack(slot, restore.payload)  # the checkpoint placed with its cached prefix
        elif self._absorbed[seq.seq_id] != start:
            raise RuntimeError(f"sequence {seq.seq_id}: its KDA state has taken in {self._absorbed[seq.seq_id]} "
                               f"tokens but the step runs it from token {start}, and no checkpoint was restored "
                               "there")
        self._absorbed[seq.seq_id] = start
        return slot

    def state_batch(self, batch: ScheduledBatch) -> StateBatch:
        """The step's :class:`StateBatch`: each sequence's slot in the step's order (extend chunks,
        then decodes), allocating, resetting or restoring slots as the module docstring says, and
        the page boundaries whose states the forward hands back."""
        self.release_stale()
        as_slots = lambda seqs: torch.tensor([self._slot_for(s, batch.restores.get(s.seq_id)) for s in seqs],  # noqa: E731
                                             dtype=torch.int32, device=self.device)
        state = StateBatch(prefill_slots=as_slots([s for s, _ in batch.extends]) if batch.extends else None,
                           decode_slots=as_slots(batch.decodes) if batch.decodes else None)
        self._asked = self.plan.asked(batch)
        if self._asked:
            state.checkpoint_seq = torch.tensor([row for row, *_ in self._asked], dtype=torch.int32,
                                                device=self.device)
            state.checkpoint_len = torch.tensor([b - seq.num_computed_tokens for _, seq, b, _ in self._asked],
                                                dtype=torch.int32, device=self.device)
        return state

    def ran(self, batch: ScheduledBatch, checkpoints: StateCheckpoints | None = None) -> list[Checkpoint]:
        """Count the tokens each sequence's state took in by running ``batch``; keep the state of
        each decode that ended on a page boundary. Returns the step's checkpoints: the states the
        forward handed back (``checkpoints``, rows as :meth:`state_batch` asked) and the turn ends
        of sequences preempted since the last step."""
        for seq, n in [*batch.extends, *((s, 1) for s in batch.decodes)]:
            self._absorbed[seq.seq_id] = seq.num_computed_tokens + n
        out = [] if checkpoints is None else [Checkpoint(seq.kv, b, self.slots.pack_checkpoint(checkpoints, row), kind)
                                              for row, (_, seq, b, kind) in enumerate(self._asked)]
        out, self._stopped, self._asked = out + self._stopped, [], []
        self.plan.decoded(batch, lambda seq: self._turn_end_row(self._held[seq.seq_id][1]))
        return out

    def turn_ends(self, batch: ScheduledBatch) -> dict[int, Checkpoint]:
        """By ``seq_id``, the turn end each decode of ``batch`` leaves if it stops now
        (:meth:`CheckpointPlan.turn_ends`)."""
        return self.plan.turn_ends(batch)

    def _turn_end_row(self, slot: int) -> torch.Tensor:
        """``slot``'s state packed into its host row (allocated at the slot's first turn end)."""
        row = self._turn_end_rows.get(slot)
        if row is None:
            row = self._turn_end_rows[slot] = torch.empty(self.checkpoint_bytes, dtype=torch.uint8,
                                                          pin_memory=self.device.type == "cuda")
        return self.slots.pack_into(slot, row)


class NoRecurrentState:
    """An attention-only model's recurrent state: none. Each step has no state batch and yields no
    checkpoints and no turn ends (:class:`HybridState`'s interface, so a runner has one path)."""

    slots = None

    def state_batch(self, batch: ScheduledBatch) -> None:
        return None

    def ran(self, batch: ScheduledBatch, checkpoints: StateCheckpoints | None = None) -> list[Checkpoint]:
        return []

    def turn_ends(self, batch: ScheduledBatch) -> dict[int, Checkpoint]:
        return {}


def recurrent_state(model: StepModel, config: EngineConfig) -> HybridState | NoRecurrentState:
    """The state slots a runner keeps for ``model`` as its cache spec declares them: ``max_num_seqs``
    slots taking checkpoints every ``config.pool.state_checkpoint_tokens`` when the pool keeps them
    (``state_checkpoint_bytes``, set by :func:`cache_config`), or none (``state_bytes`` 0).

    Raises:
        ValueError: ``config.cuda_graph`` with a model that has a recurrent state (decode graphs
            capture no state slots).
    """
    if not model.cache_spec().state_bytes:
        return NoRecurrentState()
    if config.cuda_graph:
        raise ValueError("cuda_graph=True is not supported for hybrid KDA + MLA models (decode graphs capture no "
                         "state slots); expected cuda_graph=False")
    pool = config.pool
    grid = pool.state_checkpoint_tokens if pool.state_checkpoint_bytes else 0
    return HybridState(model, config.max_num_seqs, pool.page_size, grid)


__all__ = ["CheckpointPlan", "HybridState", "NoRecurrentState", "cache_config",
           "device_only", "recurrent_state", "turn_end_checkpoints"]
