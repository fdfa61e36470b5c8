"""The model's decode step, planned once outside, compiles whole with ``torch.compile(fullgraph=True)``
(no graph break: the layers read no device value on the host) and equals eager.

The caches are NaN-poisoned and the pages shuffled, with a huge sentinel past each sequence's pages.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.llm import _random_model
from tests.helpers.step_inputs import _caches, _decode_inputs, _page_tables, _prefill


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
