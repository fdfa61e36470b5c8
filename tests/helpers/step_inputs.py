"""NaN-poisoned caches, shuffled page tables and the prefill and decode inputs of the model-step tests."""

from __future__ import annotations

import math

import torch

from kvtier.model.batch import AttentionBatch


PAGE_SIZE, NUM_PAGES, SENTINEL = 4, 24, 2147480000
PROMPT_LENS = [5, 9, 1]


def _caches(model):
    shape = (NUM_PAGES, PAGE_SIZE, model.config.kv_cache_dim)
    return [torch.full(shape, math.nan, dtype=model.dtype) for _ in range(model.config.num_hidden_layers)]


def _page_tables(gen):
    """Shuffled pages per sequence, room for one more token each; sentinel-filled past them."""
    perm = torch.randperm(NUM_PAGES, generator=gen).tolist()
    width = max(-(-(n + 1) // PAGE_SIZE) for n in PROMPT_LENS) + 1
    table = torch.full((len(PROMPT_LENS), width), SENTINEL, dtype=torch.int32)
    for b, n in enumerate(PROMPT_LENS):
        used = -(-(n + 1) // PAGE_SIZE)
        table[b, :used] = torch.tensor(perm[:used], dtype=torch.int32)
        perm = perm[used:]
    return table


def _slots(table, b, positions):
    return [int(table[b, p // PAGE_SIZE]) * PAGE_SIZE + p % PAGE_SIZE for p in positions]


def _prefill(model, caches, table, gen, run=None):
    """Write every prompt into the caches: one extend step, planned eagerly, run by ``run`` (the model)."""
    ids = torch.randint(0, model.config.vocab_size, (sum(PROMPT_LENS),), generator=gen)
    positions = torch.cat([torch.arange(n) for n in PROMPT_LENS])
    slots = sum((_slots(table, b, range(n)) for b, n in enumerate(PROMPT_LENS)), [])
    cu = torch.tensor([0, *PROMPT_LENS], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    batch = AttentionBatch(slot_mapping=torch.tensor(slots), num_prefill_tokens=len(ids), prefill_cu_seqlens_q=cu,
                           prefill_seq_lens=torch.tensor(PROMPT_LENS, dtype=torch.int32), prefill_block_table=table)
    (model if run is None else run)(ids, positions, model.plan(positions, batch, caches), caches)


def _decode_inputs(model, table, gen):
    ids = torch.randint(0, model.config.vocab_size, (len(PROMPT_LENS),), generator=gen)
    positions = torch.tensor(PROMPT_LENS)
    slots = [_slots(table, b, [n])[0] for b, n in enumerate(PROMPT_LENS)]
    batch = AttentionBatch(slot_mapping=torch.tensor(slots), num_prefill_tokens=0,
                           decode_seq_lens=torch.tensor(PROMPT_LENS, dtype=torch.int32) + 1, decode_block_table=table)
    return ids, positions, batch


def one_prefill(model, n: int, page: int = 4, dtype=torch.float32, fill: float = 0.0, first_id: int = 1):
    """``(ids, positions, plan, caches)`` of one sequence's ``n``-token prefill: ids ``first_id..``,
    caches of ``dtype`` (one per KV layer of ``model.cache_spec()``) filled with ``fill`` (NaN: a
    row the step should not read poisons it), pages shuffled in a pool of 3 more than it uses."""
    pages = -(-n // page) + 2
    caches = [torch.full((pages + 3, page, model.config.kv_cache_dim), fill, dtype=dtype)
              for _ in range(model.cache_spec().kv_layers)]
    table = torch.randperm(pages + 3, generator=torch.Generator().manual_seed(n))[:pages].to(torch.int32)[None]
    pos = torch.arange(n)
    batch = AttentionBatch(slot_mapping=table[0, pos // page].long() * page + pos % page, num_prefill_tokens=n,
                           prefill_cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
                           prefill_seq_lens=torch.tensor([n], dtype=torch.int32), prefill_block_table=table)
    return torch.arange(first_id, n + first_id), pos, model.plan(pos, batch, caches), caches
