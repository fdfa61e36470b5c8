"""The kernels are torch.library ops, ``torch.ops.kvtier.*``: registered on ``import kvtier``, one
kernel per device type, no backend in the schema, a fake implementation each (``opcheck`` on CPU
with the adversarial paged inputs of ``test_mla.py``: shuffled NaN-poisoned pages, sentinels and an
in-range NaN page past each sequence's pages, zero-length sequences, a non-contiguous cache)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvtier import ops, reference
from kvtier.reference.sampling import apply_token_bitmask
from tests.helpers.mla_inputs import _paged_pool, _rounded

OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
RANK, ROPE, HEADS, SM_SCALE = 16, 8, 3, 0.3


def _paged(page_size=4, seq_lens=(9, 0, 6, 1), strided=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    seqs = [_rounded((n, RANK + ROPE), torch.float32, gen) for n in seq_lens]
    kv_cache, block_table = _paged_pool(seqs, page_size, torch.float32, gen, strided=strided)
    return kv_cache, block_table, torch.tensor(seq_lens, dtype=torch.int32), gen


def _schemas():
    return {name: str(getattr(torch.ops.kvtier, name).default._schema) for name in OPS}


OPS = ["concat_and_cache_mla", "fused_moe", "gather_pages", "mla_decode", "mla_extend", "moe_align_block_size",
       "moe_route", "sample", "scatter_pages"]


def test_every_op_is_registered_without_a_backend_argument():
    schemas = _schemas()
    assert all("backend" not in s for s in schemas.values()), schemas
    assert "Tensor(a7!) out" in schemas["mla_decode"] and "num_splits=0" in schemas["mla_decode"]


def test_fresh_process_importing_kvtier_can_call_mla_decode():
    code = ("import torch, kvtier\n"
            "q = torch.ones(2, 3, 24); kv = torch.ones(4, 4, 24); out = torch.empty(2, 3, 16)\n"
            "bt = torch.tensor([[0, 1], [2, 2147480000]], dtype=torch.int32)\n"
            "lse = torch.ops.kvtier.mla_decode(q, kv, bt, torch.tensor([5, 0], dtype=torch.int32), 0.2, 16, 1.0, out)\n"
            "print(round(out[0, 0, 0].item(), 4), out[1].abs().sum().item(), lse[1, 0].item())\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["1.0", "0.0", "inf"]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("num_splits", [0, 3])
def test_opcheck_mla_decode(page_size, num_splits):
    kv, bt, lens, gen = _paged(page_size)
    q = _rounded((len(lens), HEADS, RANK + ROPE), torch.float32, gen)
    out = torch.empty(len(lens), HEADS, RANK)
    torch.library.opcheck(torch.ops.kvtier.mla_decode.default, (q, kv, bt, lens, SM_SCALE, RANK, 1.0, out, num_splits),
                          test_utils=OPCHECK_UTILS)
    lse = torch.ops.kvtier.mla_decode(q, kv, bt, lens, SM_SCALE, RANK, 1.0, out, num_splits)
    assert bool(torch.isfinite(out).all()) and bool((out[1] == 0).all()) and lse[1].isinf().all()


@pytest.mark.parametrize("page_size", [1, 4])
def test_opcheck_mla_extend(page_size):
    kv, bt, lens, gen = _paged(page_size)
    cu = torch.tensor([0, 3, 3, 5, 6], dtype=torch.int32)
    q = _rounded((6, HEADS, RANK + ROPE), torch.float32, gen)
    out = torch.empty(6, HEADS, RANK)
    torch.library.opcheck(torch.ops.kvtier.mla_extend.default, (q, kv, bt, cu, lens, SM_SCALE, RANK, 1.0, 3, out),
                          test_utils=OPCHECK_UTILS)
    torch.ops.kvtier.mla_extend(q, kv, bt, cu, lens, SM_SCALE, RANK, 1.0, 3, out)
    assert bool(torch.isfinite(out).all())


def test_opcheck_concat_and_cache_mla_skips_minus_one():
    kv, _, _, gen = _paged(strided=False)
    slots = torch.tensor([5, -1, 0, kv.shape[0] * kv.shape[1] - 1, -1])
    kv_c, k_pe = torch.randn(5, RANK, generator=gen), torch.randn(5, ROPE, generator=gen)
    torch.library.opcheck(torch.ops.kvtier.concat_and_cache_mla.default, (kv_c, k_pe, kv.clone(), slots),
                          test_utils=OPCHECK_UTILS)
    want = kv.clone()
    want.view(-1, RANK + ROPE)[slots[slots >= 0]] = torch.cat([kv_c, k_pe], -1)[slots >= 0]
    torch.ops.kvtier.concat_and_cache_mla(kv_c, k_pe, kv, slots)
    assert torch.equal(kv.nan_to_num(7.0), want.nan_to_num(7.0))


def test_concat_and_cache_mla_with_every_token_skipped_writes_nothing():
    kv, _, _, gen = _paged(strided=False)
    before = kv.clone()
    torch.ops.kvtier.concat_and_cache_mla(torch.randn(3, RANK), torch.randn(3, ROPE), kv, torch.full((3,), -1))
    assert torch.equal(kv.nan_to_num(7.0), before.nan_to_num(7.0))


def test_opcheck_moe_ops():
    gen = torch.Generator().manual_seed(1)
    logits, bias = torch.randn(5, 16, generator=gen), torch.randn(16, generator=gen) * 0.1
    torch.library.opcheck(torch.ops.kvtier.moe_route.default, (logits, bias, 3, 4, 2, 2.5, True),
                          test_utils=OPCHECK_UTILS)
    weights, ids = torch.ops.kvtier.moe_route(logits, bias, 3, 4, 2, 2.5, True)
    torch.library.opcheck(torch.ops.kvtier.moe_align_block_size.default, (ids, 16, 4), test_utils=OPCHECK_UTILS)
    sorted_ids, expert_ids, num_padded = torch.ops.kvtier.moe_align_block_size(ids, 16, 4)
    assert int(num_padded) % 4 == 0 and sorted(sorted_ids[sorted_ids < ids.numel()].tolist()) == list(range(15))
    hidden = torch.randn(5, 8, generator=gen)
    w13, w2 = torch.randn(16, 6, 8, generator=gen), torch.randn(16, 8, 3, generator=gen)
    torch.library.opcheck(torch.ops.kvtier.fused_moe.default, (hidden, w13, w2, weights, ids), test_utils=OPCHECK_UTILS)
    torch.testing.assert_close(torch.ops.kvtier.fused_moe(hidden, w13, w2, weights, ids),
                               reference.fused_moe(hidden, w13, w2, weights, ids))


def test_opcheck_page_ops():
    kv, _, _, _ = _paged(strided=False)
    pools = [kv.nan_to_num(1.0), kv.nan_to_num(2.0) + 1]
    pages = torch.tensor([4, 0, 2])
    staging = torch.empty(3, 2, *kv.shape[1:])
    torch.library.opcheck(torch.ops.kvtier.gather_pages.default, (pools, pages, staging), test_utils=OPCHECK_UTILS)
    torch.ops.kvtier.gather_pages(pools, pages, staging)
    assert torch.equal(staging, reference.gather_pages(pools, pages))
    torch.library.opcheck(torch.ops.kvtier.scatter_pages.default, (staging + 1, [p.clone() for p in pools], pages),
                          test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("with_mask", [False, True])
def test_opcheck_sample(with_mask):
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 40, generator=gen)
    temperature, top_p = torch.tensor([0.0, 0.7, 1.0, 1.3]), torch.tensor([1.0, 0.9, 1.0, 0.5])
    mask = torch.randint(-2**31, 2**31 - 1, (4, 2), generator=gen, dtype=torch.int32) if with_mask else None
    uniforms = torch.rand(4, generator=gen)
    torch.library.opcheck(torch.ops.kvtier.sample.default, (logits, temperature, top_p, uniforms, mask),
                          test_utils=OPCHECK_UTILS)
    tokens = torch.ops.kvtier.sample(logits, temperature, top_p, uniforms, mask)
    masked = logits if mask is None else apply_token_bitmask(logits, mask)
    assert int(tokens[0]) == int(masked[0].argmax())
    assert bool(torch.isfinite(masked.gather(1, tokens[:, None])).all())


def test_torch_compile_fullgraph_traces_the_public_op():
    kv, bt, lens, gen = _paged()
    q = _rounded((len(lens), HEADS, RANK + ROPE), torch.float32, gen)

    def step(q, kv, plan):  # planned outside: the plan reads seq_lens on the host, run does not
        out, lse = ops.mla_decode_run(q * 2.0, kv, plan, SM_SCALE)
        return out + 1.0, lse

    plan = ops.plan_mla_decode(bt, lens, 4, HEADS, RANK, max_seq_len=12)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(q, kv, plan), step(q, kv, plan), strict=True):
        torch.testing.assert_close(got, want)


def test_ops_run_inside_named_profiler_ranges():
    kv, bt, lens, gen = _paged()
    q = _rounded((len(lens), HEADS, RANK + ROPE), torch.float32, gen)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ops.mla_decode(q, kv, bt, lens, SM_SCALE, RANK)
        ops.mla_extend(q, kv, bt, torch.tensor([0, 1, 1, 3, 4], dtype=torch.int32), lens, SM_SCALE, RANK)
    names = {e.name for e in prof.events()}
    assert {"kvtier::mla_decode", "kvtier::mla_extend"} <= names
