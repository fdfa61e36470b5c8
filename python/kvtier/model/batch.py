"""The attention metadata of one forward step over a paged MLA cache."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvtier import ops
from kvtier.ops import MLADecodePlan, MLAExtendPlan


@dataclass
class AttentionBatch:
    """Where each token of a mixed prefill/decode step reads and writes the paged cache.

    Tokens are ordered prefill (extend) tokens first, then one token per decoding sequence.

    Attributes:
        slot_mapping: [num_tokens] int64, cache slot ``page_id * page_size + offset`` written
            by each token; -1 skips the write.
        num_prefill_tokens: how many leading tokens belong to extend sequences.
        prefill_cu_seqlens_q: [P + 1] int32 prefix sums of new tokens per extend sequence.
        prefill_seq_lens: [P] int32 cached tokens per extend sequence after this step.
        prefill_block_table: [P, max_pages] int32.
        decode_seq_lens: [D] int32 cached tokens per decoding sequence after this step.
        decode_block_table: [D, max_pages] int32.
        decode_plan, extend_plan: the attention plans of the step's decode and extend tokens
            (:func:`kvtier.ops.plan_mla_decode`, :func:`kvtier.ops.plan_mla_extend`), made once
            per step by :meth:`kvtier.model.kimi_k2.KimiK2ForCausalLM.plan` with the checks of
            ``slot_mapping`` and the positions.
        planned: True once that was done; the layers then read no device value on the host.
    """

    slot_mapping: torch.Tensor
    num_prefill_tokens: int
    prefill_cu_seqlens_q: torch.Tensor | None = None
    prefill_seq_lens: torch.Tensor | None = None
    prefill_block_table: torch.Tensor | None = None
    decode_seq_lens: torch.Tensor | None = None
    decode_block_table: torch.Tensor | None = None
    decode_plan: MLADecodePlan | None = None
    extend_plan: MLAExtendPlan | None = None
    planned: bool = False

    @property
    def num_decode_tokens(self) -> int:
        return 0 if self.decode_seq_lens is None else int(self.decode_seq_lens.shape[0])

    def with_plans(self, cache: torch.Tensor, num_heads: int, kv_lora_rank: int, backend: str,
                   decode_max_seq_len: int | None = None) -> AttentionBatch:
        """This batch with its decode and extend attention plans made once for the step
        (:func:`kvtier.ops.plan_mla_decode` / :func:`kvtier.ops.plan_mla_extend`) over ``cache``
        ([num_pages, page_size, row] of one layer; every layer's has its shape), ``planned`` set.
        ``decode_max_seq_len``: an upper bound of ``decode_seq_lens`` known on the host (None:
        read from it)."""
        page_size, num_pages = cache.shape[1], cache.shape[0]
        decode_plan = extend_plan = None
        if self.num_decode_tokens:
            decode_plan = ops.plan_mla_decode(self.decode_block_table, self.decode_seq_lens, page_size, num_heads,
                                              kv_lora_rank, num_pages=num_pages, max_seq_len=decode_max_seq_len,
                                              backend=backend)
        if self.num_prefill_tokens:
            extend_plan = ops.plan_mla_extend(self.prefill_block_table, self.prefill_cu_seqlens_q,
                                              self.prefill_seq_lens, page_size, num_heads, kv_lora_rank,
                                              num_pages=num_pages, backend=backend)
        return dataclasses.replace(self, decode_plan=decode_plan, extend_plan=extend_plan, planned=True)
