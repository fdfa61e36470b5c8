"""The engine's side of a hybrid model's recurrent state: one KDA state slot per running sequence.

A hybrid model (:class:`kvtier.model.kimi_linear.KimiLinearForCausalLM`: KDA + MLA layers) keeps,
beside the MLA layers' KV pages, a fixed-size recurrent state per sequence in a
:class:`kvtier.model.state_slots.StateSlots` pool. :class:`HybridState` owns that pool for a
:class:`kvtier.serve.runner.ModelRunner` (``max_num_seqs`` slots) and does its bookkeeping:

- a sequence gets a slot the first step it runs (admission) and the slot is zeroed whenever the
  sequence starts its prompt from token 0 (a fresh prompt, or one re-admitted after preemption);
- a chunked prefill's next chunk starts from the state the previous chunk left in the slot;
- the slot of a sequence that is no longer running (finished, aborted or preempted) is freed at
  the start of the next step the runner runs, before any slot is taken, so running sequences
  (at most ``max_num_seqs``) always find one.

A preempted sequence recomputes from its first token: its MLA pages mean nothing without the
state at their end, and the slot's state has moved past them. For the same reason prefix reuse
across requests is off for hybrid models (:func:`device_only`): a cached block would skip tokens
whose state the new sequence never saw. Keeping states at page boundaries so that blocks can be
reused is the hybrid cache's work, not done here.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from kvtier.model.kimi_linear import KimiLinearForCausalLM
from kvtier.model.state_slots import StateBatch, StateSlots
from kvtier.serve.config import EngineConfig
from kvtier.serve.request import Sequence, SequenceStatus
from kvtier.serve.step_plan import ScheduledBatch

log = logging.getLogger(__name__)


def is_hybrid(model) -> bool:
    """Whether ``model`` is a hybrid KDA + MLA model (it needs state slots)."""
    return isinstance(model, KimiLinearForCausalLM)


def device_only(config: EngineConfig) -> EngineConfig:
    """``config`` as a hybrid model runs it: no prefix reuse across requests and no host, disk or
    remote tier (every prompt is computed from its first token). Logs a warning that says what
    it turned off (nothing when nothing was on)."""
    pool = config.pool
    tiers = [name for name, on in (("host_cache_bytes", pool.host_cache_bytes > 0),
                                   ("disk_cache_dir", pool.disk_cache_dir is not None),
                                   ("remote_cache_url", pool.remote_cache_url is not None)) if on]
    if not (pool.enable_prefix_caching or tiers):
        return config
    log.warning(
        "hybrid KDA + MLA model: prefix caching is off and the engine keeps KV in device pages only "
        "(no block reuse across requests until the hybrid cache keeps KDA states with them)%s",
        f"; ignoring {', '.join(tiers)}" if tiers else "")
    pool = dataclasses.replace(pool, enable_prefix_caching=False, host_cache_bytes=0, disk_cache_dir=None,
                               disk_cache_bytes=0, remote_cache_url=None)
    return dataclasses.replace(config, pool=pool)


class HybridState:
    """The state slots of a hybrid model's running sequences.

    Args:
        model: the hybrid model (its config sizes the slots; recurrent states fp32, conv windows
            in the model's dtype, on its device).
        num_slots: slots in the pool (the engine's ``max_num_seqs``).

    Attributes:
        slots: the :class:`StateSlots` pool the model's forward reads and writes.
    """

    def __init__(self, model: KimiLinearForCausalLM, num_slots: int):
        self.slots = StateSlots(model.config, num_slots, state_dtype=torch.float32, conv_dtype=model.dtype,
                                device=model.embed_tokens.device)
        self.device = model.embed_tokens.device
        self._held: dict[int, tuple[Sequence, int]] = {}  # seq_id -> (sequence, slot)
        self._absorbed: dict[int, int] = {}  # seq_id -> tokens the slot's state has taken in

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
            if start != 0:
                raise RuntimeError(f"sequence {seq.seq_id} of a hybrid model starts at token {start}, but it holds "
                                   "no KDA state: hybrid sequences must run from their first token (no prefix reuse)")
            slot = self.slots.allocate()  # zeroed
            self._held[seq.seq_id], self._absorbed[seq.seq_id] = (seq, slot), 0
            return slot
        slot = held[1]
        if start == 0:
            self.slots.reset(slot)  # re-admitted after preemption: recomputed from scratch
            self._absorbed[seq.seq_id] = 0
        elif self._absorbed[seq.seq_id] != start:
            raise RuntimeError(f"sequence {seq.seq_id}: its KDA state has taken in {self._absorbed[seq.seq_id]} "
                               f"tokens but the step runs it from token {start}")
        return slot

    def state_batch(self, batch: ScheduledBatch) -> StateBatch:
        """The step's :class:`StateBatch`: each sequence's slot in the step's order (extend chunks,
        then decodes), allocating or resetting slots as the module docstring says."""
        self.release_stale()
        as_slots = lambda seqs: torch.tensor([self._slot_for(s) for s in seqs], dtype=torch.int32,  # noqa: E731
                                             device=self.device)
        return StateBatch(prefill_slots=as_slots([s for s, _ in batch.extends]) if batch.extends else None,
                          decode_slots=as_slots(batch.decodes) if batch.decodes else None)

    def ran(self, batch: ScheduledBatch) -> None:
        """Count the tokens each sequence's state took in by running ``batch``."""
        for seq, n in [*batch.extends, *((s, 1) for s in batch.decodes)]:
            self._absorbed[seq.seq_id] = seq.num_computed_tokens + n


__all__ = ["HybridState", "device_only", "is_hybrid"]
