"""Compiled Triton kernels on a GPU against the torch backend (fp32 references), at K2 widths.

Marked ``gpu``: skipped without a CUDA/ROCm device (``pytest -m gpu`` on a GPU machine; run by
``perf/gpu_check.sh``). Inputs are adversarial as in the interpreter tests: shuffled pages, NaN in
unused pages, a huge sentinel in unused ``block_table`` entries, a zero-length sequence. bf16 dots
with fp32 accumulation: tolerances are bf16's. The aiter backend's tests run where it is available
(ROCm, aiter installed) and are skipped with the reason elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from kvtier import ops
from kvtier.ops import dispatch
from tests.helpers.gpu_mla_inputs import RANK, SM_SCALE, _fp8, _paged
from tests.ops._compare import assert_close

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")]


@pytest.mark.parametrize("backend", ["triton", "hip"])
@pytest.mark.parametrize("heads", [8, 64, 17])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("kv_kind", ["bf16", "fp8"])
def test_mla_decode_on_gpu(heads, page_size, kv_kind, backend):
    reason = dispatch.unavailable_reason("mla_decode", backend, "cuda")
    if reason is not None:
        pytest.skip(f"backend {backend!r} unavailable: {reason}")
    kv_dtype = torch.bfloat16 if kv_kind == "bf16" else _fp8()
    scale = 1.0 if kv_kind == "bf16" else 0.05
    q, kv, bt, lens = _paged(5, heads, [0, 1, 97, 1823, 4096], page_size, kv_dtype)
    ref_out, ref_lse = ops.mla_decode(q, kv, bt, lens, SM_SCALE, RANK, kv_scale=scale, backend="torch")
    out, lse = ops.mla_decode(q, kv, bt, lens, SM_SCALE, RANK, kv_scale=scale, backend=backend)
    assert_close(out.float(), ref_out.float(), atol=1e-2, rtol=1.6e-2, name="out", max_cos_diff=2e-5)
    assert_close(lse, ref_lse, atol=1e-3, rtol=1e-4, name="lse")


@pytest.mark.parametrize("kv_kind", ["bf16", "fp8"])
def test_mla_extend_on_gpu(kv_kind):
    kv_dtype = torch.bfloat16 if kv_kind == "bf16" else _fp8()
    scale = 1.0 if kv_kind == "bf16" else 0.05
    new = [0, 1, 54, 300]
    q, kv, bt, lens = _paged(4, 16, [0, 17, 812, 300], 64, kv_dtype, new_tokens=new)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    ref_out, ref_lse = ops.mla_extend(q, kv, bt, cu, lens, SM_SCALE, RANK, kv_scale=scale, backend="torch")
    out, lse = ops.mla_extend(q, kv, bt, cu, lens, SM_SCALE, RANK, kv_scale=scale, backend="triton")
    assert_close(out.float(), ref_out.float(), atol=1e-2, rtol=1.6e-2, name="out", max_cos_diff=2e-5)
    assert_close(lse, ref_lse, atol=1e-3, rtol=1e-4, name="lse")


@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_moe_on_gpu(num_tokens):
    dev, gen = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    experts, hidden, inter, top_k = 384, 1024, 256, 8  # K2's expert count and top-k, narrower layers
    logits = torch.randn(num_tokens, experts, device=dev, generator=gen)
    bias = torch.randn(experts, device=dev, generator=gen) * 0.1
    w, ids = ops.moe_route(logits, bias, top_k, 1, 1, 2.827, backend="triton")
    rw, rids = ops.moe_route(logits, bias, top_k, 1, 1, 2.827, backend="torch")
    order, rorder = ids.sort(-1), rids.sort(-1)
    assert torch.equal(order.values, rorder.values)
    assert_close(w.gather(1, order.indices), rw.gather(1, rorder.indices), atol=1e-6, rtol=1e-5, name="topk_weights")
    x = torch.randn(num_tokens, hidden, device=dev, generator=gen, dtype=torch.bfloat16)
    w13 = torch.randn(experts, 2 * inter, hidden, device=dev, generator=gen, dtype=torch.bfloat16) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, inter, device=dev, generator=gen, dtype=torch.bfloat16) * inter ** -0.5
    got = ops.fused_moe(x, w13, w2, w, ids, backend="triton")
    ref = ops.fused_moe(x, w13, w2, w, ids, backend="torch")
    assert_close(got.float(), ref.float(), atol=3e-2, rtol=3e-2, name="fused_moe", max_cos_diff=1e-4)


_AITER_REASON = dispatch.unavailable_reason("mla_decode", "aiter", "cuda")
needs_aiter = pytest.mark.skipif(_AITER_REASON is not None, reason=f"aiter backend: {_AITER_REASON}")


@needs_aiter
@pytest.mark.filterwarnings("ignore:kvtier mla_decode on aiter")
@pytest.mark.parametrize("heads", [8, 64, 128])
@pytest.mark.parametrize("page_size", [1, 64])
def test_mla_decode_aiter_on_gpu(heads, page_size):
    """aiter's MLA decode (ROCm) through kvtier's adapter vs the torch reference: heads padded to
    16/128, pages expanded to token indices, a zero-length sequence; bf16 (what aiter takes)."""
    q, kv, bt, lens = _paged(5, heads, [0, 1, 97, 1823, 4096], page_size, torch.bfloat16)
    ref_out, ref_lse = ops.mla_decode(q, kv, bt, lens, SM_SCALE, RANK, backend="torch")
    out, lse = ops.mla_decode(q, kv, bt, lens, SM_SCALE, RANK, backend="aiter")
    assert_close(out.float(), ref_out.float(), atol=1e-2, rtol=1.6e-2, name="out", max_cos_diff=2e-5)
    assert_close(lse, ref_lse, atol=1e-3, rtol=1e-4, name="lse")


@needs_aiter
@pytest.mark.parametrize("num_tokens", [1, 300])
def test_fused_moe_aiter_on_gpu(num_tokens):
    dev, gen = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    experts, hidden, inter, top_k = 384, 1024, 256, 8
    w, ids = ops.moe_route(torch.randn(num_tokens, experts, device=dev, generator=gen), torch.zeros(experts, device=dev),
                           top_k, 1, 1, 2.827)
    x = torch.randn(num_tokens, hidden, device=dev, generator=gen, dtype=torch.bfloat16)
    w13 = torch.randn(experts, 2 * inter, hidden, device=dev, generator=gen, dtype=torch.bfloat16) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, inter, device=dev, generator=gen, dtype=torch.bfloat16) * inter ** -0.5
    got = ops.fused_moe(x, w13, w2, w, ids, backend="aiter")
    ref = ops.fused_moe(x, w13, w2, w, ids, backend="torch")
    assert_close(got.float(), ref.float(), atol=3e-2, rtol=3e-2, name="fused_moe", max_cos_diff=1e-4)


def test_sample_and_pages_on_gpu():
    dev, gen = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(9, 163840, device=dev, generator=gen)
    greedy = ops.sample(logits, torch.zeros(9, device=dev), torch.ones(9, device=dev), backend="triton")
    assert torch.equal(greedy, logits.argmax(-1))
    pools = [torch.randn(40, 64, 576, device=dev, generator=gen, dtype=torch.bfloat16) for _ in range(3)]
    pages = torch.randperm(40, device=dev, generator=gen)[:13]
    staged = ops.gather_pages(pools, pages, backend="triton")
    assert torch.equal(staged, ops.gather_pages(pools, pages, backend="torch"))
    fresh = [torch.zeros_like(p) for p in pools]
    ops.scatter_pages(staged, fresh, pages, backend="triton")
    for p, f in zip(pools, fresh):
        assert torch.equal(f[pages], p[pages])
