"""What a model caches per sequence, declared by the model: :meth:`cache_spec` of every model class.

An engine sizes its page pools, its state slots and its pool's checkpoint budgets from this one
record, and every size formula (the bench's tiers, the memory plans, the simulator) reads it, so
that no caller asks which model family it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheSpec:
    """A model's cache per sequence: paged KV in ``kv_layers`` layers and, for a hybrid model, one
    fixed-size recurrent state.

    Attributes:
        kv_layers: layers with KV pages (every layer of K2; the MLA layers of a hybrid model).
        kv_width: elements of one token's KV row in one layer (``kv_lora_rank + qk_rope_head_dim``:
            576 for K2 and K3).
        kv_dtype: dtype of the KV rows.
        state_bytes: bytes of one sequence's recurrent state as one checkpoint (the KDA recurrent
            states and conv windows of every linear layer, :meth:`kvtier.model.state_slots.StateSlots.pack`);
            0 for an attention-only model. A model with a state resumes a cached prefix only at a
            page boundary where a checkpoint of that state was taken; one without, after any block.

    Example:
        >>> CacheSpec(61, 576, torch.bfloat16).kv_bytes_per_token
        70272
    """

    kv_layers: int
    kv_width: int
    kv_dtype: torch.dtype
    state_bytes: int = 0

    @property
    def kv_row_bytes(self) -> int:
        """Bytes of one token's KV row in one layer."""
        return self.kv_width * self.kv_dtype.itemsize

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's KV over all ``kv_layers`` layers."""
        return self.kv_bytes_per_token_at(self.kv_dtype.itemsize)

    def kv_bytes_per_token_at(self, value_bytes: float) -> float:
        """Bytes of one token's KV over all ``kv_layers`` layers at ``value_bytes`` per value (a
        memory plan's KV dtype: 2 = bf16, 1 = FP8)."""
        return self.kv_layers * self.kv_width * value_bytes

    def kv_cache_shape(self, num_pages: int, page_size: int) -> tuple[int, int, int]:
        """``[num_pages, page_size, kv_width]``: one layer's page pool."""
        return num_pages, page_size, self.kv_width


__all__ = ["CacheSpec"]
