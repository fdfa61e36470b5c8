"""The paged MLA ops are torch.library custom ops that torch.compile can trace (fake impls)."""

from __future__ import annotations

import pytest
import torch

from kvtier import ops
from kvtier.ops import dispatch


def _args(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 24, generator=gen).to(dtype)
    kv = torch.randn(6, 4, 24, generator=gen).to(dtype)
    bt = torch.tensor([[0, 1, 2], [3, 2**31 - 1, 2**31 - 1], [4, 5, 2**31 - 1]], dtype=torch.int32)
    lens = torch.tensor([9, 0, 6], dtype=torch.int32)
    return q, kv, bt, lens


def _backends():
    return ["torch"] + (["triton"] if dispatch.is_backend_supported("mla_decode", "triton", "cpu") else [])


@pytest.mark.parametrize("backend", _backends())
def test_opcheck_mla_decode(backend):
    q, kv, bt, lens = _args()
    out = q.new_empty(3, 2, 16)
    torch.library.opcheck(torch.ops.kvtier.mla_decode.default, (q, kv, bt, lens, 0.3, 16, 1.0, backend, out),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("backend", _backends())
def test_opcheck_mla_extend(backend):
    q, kv, bt, lens = _args()
    cu = torch.tensor([0, 2, 2, 3], dtype=torch.int32)
    out = q.new_empty(3, 2, 16)
    torch.library.opcheck(torch.ops.kvtier.mla_extend.default,
                          (q, kv, bt, cu, lens, 0.3, 16, 1.0, 2, backend, out),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_torch_compile_fullgraph_traces_the_op():
    q, kv, bt, lens = _args()

    def step(q, kv, bt, lens):
        out = q.new_empty(q.shape[0], q.shape[1], 16)
        lse = torch.ops.kvtier.mla_decode(q * 2.0, kv, bt, lens, 0.3, 16, 1.0, "torch", out)
        return out + 1.0, lse

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got_out, got_lse = compiled(q, kv, bt, lens)
    want_out, want_lse = step(q, kv, bt, lens)
    torch.testing.assert_close(got_out, want_out)
    torch.testing.assert_close(got_lse, want_lse)


def test_ops_run_inside_named_profiler_ranges():
    q, kv, bt, lens = _args()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ops.mla_decode(q, kv, bt, lens, 0.3, 16)
        ops.mla_extend(q, kv, bt, torch.tensor([0, 2, 2, 3], dtype=torch.int32), lens, 0.3, 16)
    names = {e.name for e in prof.events()}
    assert {"kvtier::mla_decode", "kvtier::mla_extend"} <= names
