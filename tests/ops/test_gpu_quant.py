"""Compiled quantized-weight Triton kernels on a GPU against the fp32 references, at K2 widths
(H = 7168, I = 2048; eight experts, one never picked with NaN scales; top-8 of them is all but one).

Marked ``gpu``: skipped without a CUDA/ROCm device (``pytest -m gpu``; run by ``perf/gpu_check.sh``).
Compiled, the W4A16 weight tile is rounded to bf16 before its dot and the outputs are bf16, so
the tolerances are bf16's; W8A8 quantizes identically up to the GPU's fp32 division (an activation
on an fp8 rounding boundary may land one fp8 step away: a few 1e-3 of the output at most).
"""

from __future__ import annotations

import math

import pytest
import torch

from kvtier import ops, reference
from kvtier.reference import quant as rq
from tests.ops._compare import assert_close

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")]

HIDDEN, INTER, EXPERTS, TOP_K = 7168, 2048, 8, 7


def _fp8_dtype():
    from kvtier.ops._triton import arch_of

    return ops.fp8_e4m3_dtype(arch_of(torch.device("cuda")))


def _close(got, want, cos, name="out"):
    peak = float(want.float().abs().max())
    assert_close(got, want, atol=2e-2 * peak, rtol=2e-2, max_cos_diff=cos, name=name)


def _routing(num_tokens, gen):
    dev = torch.device("cuda")
    ids = torch.stack([torch.randperm(EXPERTS - 1, device=dev, generator=gen)[:TOP_K] for _ in range(num_tokens)])
    return torch.rand(num_tokens, TOP_K, device=dev, generator=gen), ids.to(torch.int32)


def _int4(shape, gen):
    w = torch.randn(*shape, device="cuda", generator=gen) / math.sqrt(shape[-1])
    packed, scale = rq.quantize_int4_group(w, 32)
    return packed, scale.to(torch.bfloat16)


def _fp8(shape, gen, dtype):
    w = torch.randn(*shape, device="cuda", generator=gen) / math.sqrt(shape[-1])
    n, k = shape[-2:]
    blocks = w.unflatten(-1, (k // 128, 128)).unflatten(-3, (n // 128, 128))
    top = float(torch.finfo(dtype).max)
    scale_inv = blocks.abs().amax(dim=(-3, -1)) / top
    q = (blocks / scale_inv[..., :, None, :, None]).flatten(-2).flatten(-3, -2)
    return q.clamp(-top, top).to(dtype), scale_inv


@pytest.mark.parametrize("num_tokens", [1, 300])
def test_fused_moe_w4a16_on_gpu(num_tokens):
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    w13p, w13s = _int4((EXPERTS, 2 * INTER, HIDDEN), gen)
    w2p, w2s = _int4((EXPERTS, HIDDEN, INTER), gen)
    w13s[-1] = math.nan
    w2s[-1] = math.nan
    x = torch.randn(num_tokens, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16)
    weights, ids = _routing(num_tokens, gen)
    got = ops.fused_moe_w4a16(x, w13p, w13s, w2p, w2s, weights, ids, backend="triton")
    assert bool(torch.isfinite(got).all())
    _close(got, reference.fused_moe_w4a16(x, w13p, w13s, w2p, w2s, weights, ids), 5e-5)


@pytest.mark.parametrize("num_tokens", [1, 300])
def test_fused_moe_fp8_block_on_gpu(num_tokens):
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    dtype = _fp8_dtype()
    w13, s13 = _fp8((EXPERTS, 2 * INTER, HIDDEN), gen, dtype)
    w2, s2 = _fp8((EXPERTS, HIDDEN, INTER), gen, dtype)
    s13[-1] = math.nan
    s2[-1] = math.nan
    x = torch.randn(num_tokens, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16)
    weights, ids = _routing(num_tokens, gen)
    got = ops.fused_moe_fp8_block(x, w13, s13, w2, s2, weights, ids, backend="triton")
    assert bool(torch.isfinite(got).all())
    _close(got, reference.fused_moe_fp8_block(x, w13, s13, w2, s2, weights, ids), 1e-4)


@pytest.mark.parametrize("m", [1, 1000])
@pytest.mark.parametrize("n, k", [(576, 7168), (7168, 2048)], ids=["kv_a-N576", "down"])
def test_linear_fp8_block_on_gpu(m, n, k):
    gen = torch.Generator(device="cuda").manual_seed(m + n)
    dtype = _fp8_dtype()
    npad = -(-n // 128) * 128
    weight, scale_inv = _fp8((npad, k), gen, dtype)
    weight, scale_inv = weight[:n].contiguous(), scale_inv[: -(-n // 128)].contiguous()
    x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    got = ops.linear_fp8_block(x, weight, scale_inv, backend="triton")
    _close(got, reference.linear_fp8_block(x, weight, scale_inv), 1e-4)


@pytest.mark.parametrize("m", [1, 1000])
def test_linear_w4a16_on_gpu(m):
    gen = torch.Generator(device="cuda").manual_seed(m)
    packed, scale = _int4((HIDDEN, INTER), gen)
    x = torch.randn(m, INTER, device="cuda", generator=gen, dtype=torch.bfloat16)
    bias = torch.randn(HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16)
    got = ops.linear_w4a16(x, packed, scale, bias=bias, backend="triton")
    _close(got, reference.linear_w4a16(x, packed, scale, bias=bias), 5e-5)
