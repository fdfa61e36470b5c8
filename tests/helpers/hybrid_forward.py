"""The hybrid model run directly over prompt chunks, on its own shuffled pages and one state slot."""

from __future__ import annotations

import torch

from kvtier.model import AttentionBatch
from kvtier.model.state_slots import StateBatch, StateSlots


def _run(model, ids, chunks):
    c = model.config
    page = 16
    caches = [torch.zeros(4, page, c.kv_cache_dim) for _ in c.full_attn_layers]
    table = torch.tensor([[3, 1, 0, 2]], dtype=torch.int32)
    state = StateSlots(c, 2)
    slot = state.allocate()
    out, start = [], 0
    for n in chunks:
        pos = torch.arange(start, start + n)
        batch = AttentionBatch(slot_mapping=table[0, pos // page].long() * page + pos % page, num_prefill_tokens=n,
                               prefill_cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
                               prefill_seq_lens=torch.tensor([start + n], dtype=torch.int32), prefill_block_table=table)
        sb = StateBatch(prefill_slots=torch.tensor([slot], dtype=torch.int32))
        out.append(model(torch.tensor(ids[start:start + n]), pos, batch, caches, state, sb))
        start += n
    return torch.cat(out)
