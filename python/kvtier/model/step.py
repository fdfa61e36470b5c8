"""The step interface every model class has, so that an engine runs any of them the same way.

A step is ``plan`` (check the step's metadata and plan its attention once for all layers), then
``step`` (run every layer; hidden states and the recurrent-state checkpoints the step was asked
for), then ``compute_logits`` on the rows to sample. ``cache_spec`` says what to allocate: the KV
page pools, and state slots (:class:`~kvtier.model.state_slots.StateSlots`) when ``state_bytes``
is not 0. An attention-only model takes ``state=None, state_batch=None`` and returns no
checkpoints, so a caller has one path for every model.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvtier.model.batch import AttentionBatch
from kvtier.model.cache_spec import CacheSpec
from kvtier.model.state_slots import StateBatch, StateCheckpoints, StateSlots


class StepModel(Protocol):
    """What :class:`kvtier.model.KimiK2ForCausalLM` and
    :class:`kvtier.model.kimi_linear.KimiLinearForCausalLM` both are.

    Attributes:
        config: the model's config (``vocab_size``, ``max_position_embeddings``, ``eos_token_id``, ...).
        dtype: the compute dtype (the dtype of the KV rows).
        embed_tokens: ``[vocab_size, hidden_size]``; its device is the model's.
    """

    config: object
    dtype: torch.dtype
    embed_tokens: torch.Tensor

    def cache_spec(self) -> CacheSpec:
        """What the model caches per sequence."""
        ...

    def plan(self, positions: torch.Tensor, batch: AttentionBatch, kv_caches: list[torch.Tensor], *,
             decode_max_seq_len: int | None = None) -> AttentionBatch:
        """``batch`` checked (positions ``[T]`` int64, slot mapping, cache shapes) and planned for
        every layer. Raises ValueError naming what is out of range."""
        ...

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
             kv_caches: list[torch.Tensor], state: StateSlots | None = None, state_batch: StateBatch | None = None
             ) -> tuple[torch.Tensor, StateCheckpoints | None]:
        """``(hidden [T, hidden_size], checkpoints)``: the final-normed hidden states and the
        recurrent states at ``state_batch``'s checkpoint boundaries (None when it names none, and
        always for an attention-only model). ``state``/``state_batch``: the slot pool and each
        sequence's slot; None for an attention-only model."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` -> ``[n, vocab_size]`` fp32 logits."""
        ...


__all__ = ["StepModel"]
