"""The model's decode step, planned once outside, compiles whole with ``torch.compile(fullgraph=True)``
(no graph break: the layers read no device value on the host) and equals eager.

The caches are NaN-poisoned and the pages shuffled, with a huge sentinel past each sequence's pages.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvtier.llm import _random_model
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


@pytest.mark.slow
# Tolerance relative to the largest logit. fp32: summation order only. bf16: inductor fuses
# elementwise chains and rounds intermediates to bf16 at other points than eager does; measured
# 1.3% of the largest logit (1.7 ulps), mean 0.2%; allowed 4 ulps (4 * 2**-7).
@pytest.mark.parametrize("dtype, rel", [(torch.float32, 1e-5), (torch.bfloat16, 4 * 2**-7)], ids=["fp32", "bf16"])
def test_decode_step_compiles_fullgraph_and_equals_eager(dtype, rel):
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    model = _random_model("tiny", seed=5, dtype=dtype, device="cpu")
    caches, table = _caches(model), _page_tables(gen)
    with torch.inference_mode():
        _prefill(model, caches, table, gen)
        ids, positions, batch = _decode_inputs(model, table, gen)
        planned = model.plan(positions, batch, caches)

        def decode_step(ids, positions, batch, caches):
            return model.compute_logits(model(ids, positions, batch, caches))

        eager_caches = [c.clone() for c in caches]
        want = decode_step(ids, positions, planned, eager_caches)
        compiled = torch.compile(decode_step, fullgraph=True)
        got = compiled(ids, positions, planned, caches)
    assert bool(torch.isfinite(want).all())
    atol = rel * float(want.abs().max())
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    for got_cache, want_cache in zip(caches, eager_caches, strict=True):  # the new token's rows were written
        scale = float(want_cache.nan_to_num(0.0).abs().max())
        torch.testing.assert_close(got_cache, want_cache, atol=rel * scale, rtol=0, equal_nan=True)


def test_extend_and_decode_steps_trace_whole_without_a_graph_break():
    """Dynamo alone (no inductor: fast): fullgraph tracing fails on any host read in the layers."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(1)
    model = _random_model("tiny", seed=5, dtype=torch.float32, device="cpu")
    caches, table = _caches(model), _page_tables(gen)
    traced = torch.compile(model, fullgraph=True, backend="eager")
    with torch.inference_mode():
        eager_caches = [c.clone() for c in caches]
        _prefill(model, eager_caches, table, torch.Generator().manual_seed(2))
        _prefill(model, caches, table, torch.Generator().manual_seed(2), run=traced)
        torch.testing.assert_close(caches, eager_caches, atol=1e-5, rtol=0, equal_nan=True)
        ids, positions, batch = _decode_inputs(model, table, gen)
        planned = model.plan(positions, batch, caches)
        want = model(ids, positions, planned, eager_caches)
        got = traced(ids, positions, planned, caches)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
