"""The quantized-weight ops (:mod:`kvtier.ops.quant`) as ``torch.library`` ops, and the backend
implementations the public ops dispatch to.

The registered ops (no backend in the schemas; CPU kernel = the fp32 reference, CUDA
kernel = :func:`kvtier.ops.dispatch.device_backend`'s choice, the reference for the two dequantize
ops on both; fake implementations for tracing)::

    dequantize_int4_group(Tensor weight_packed, Tensor weight_scale, int group_size) -> Tensor
    dequantize_fp8_block(Tensor weight, Tensor weight_scale_inv, int[] block_size) -> Tensor
    linear_w4a16(Tensor x, Tensor weight_packed, Tensor weight_scale, int group_size, Tensor? bias,
                 ScalarType out_dtype) -> Tensor
    linear_fp8_block(Tensor x, Tensor weight, Tensor weight_scale_inv, int[] block_size, Tensor? bias,
                     ScalarType out_dtype) -> Tensor
    fused_moe_w4a16(Tensor hidden_states, Tensor w13_packed, Tensor w13_scale, Tensor w2_packed,
                    Tensor w2_scale, Tensor topk_weights, Tensor topk_ids, int group_size) -> Tensor
    fused_moe_fp8_block(Tensor hidden_states, Tensor w13, Tensor w13_scale_inv, Tensor w2,
                        Tensor w2_scale_inv, Tensor topk_weights, Tensor topk_ids, int[] block_size) -> Tensor
"""

from __future__ import annotations

import torch

from kvtier.ops.dispatch import device_backend
from kvtier.reference import quant as ref

INT4_PER_INT32 = ref.INT4_PER_INT32


# --------------------------------------------------------------------------------------------
# backend implementations


def _triton():
    from kvtier.ops import _triton_quant

    return _triton_quant


def _linear_w4a16_impl(backend, x, weight_packed, weight_scale, group_size, bias, out_dtype):
    if backend == "triton":
        return _triton().linear_w4a16(x, weight_packed, weight_scale, group_size, bias, out_dtype)
    return ref.linear_w4a16(x, weight_packed, weight_scale, group_size, bias, out_dtype)


def _linear_fp8_impl(backend, x, weight, weight_scale_inv, block_size, bias, out_dtype):
    if backend == "triton":
        return _triton().linear_fp8_block(x, weight, weight_scale_inv, block_size, bias, out_dtype)
    return ref.linear_fp8_block(x, weight, weight_scale_inv, block_size, bias, out_dtype)


def _moe_w4a16_impl(backend, *args):
    return _triton().fused_moe_w4a16(*args) if backend == "triton" else ref.fused_moe_w4a16(*args)


def _moe_fp8_impl(backend, *args):
    return _triton().fused_moe_fp8_block(*args) if backend == "triton" else ref.fused_moe_fp8_block(*args)


# --------------------------------------------------------------------------------------------
# torch.library ops


@torch.library.custom_op("kvtier::dequantize_int4_group", mutates_args=(), device_types=("cpu", "cuda"))
def _dequantize_int4_op(weight_packed: torch.Tensor, weight_scale: torch.Tensor, group_size: int) -> torch.Tensor:
    return ref.dequantize_int4_group(weight_packed, weight_scale, group_size=group_size)


@_dequantize_int4_op.register_fake
def _(weight_packed, weight_scale, group_size):
    return weight_packed.new_empty(*weight_packed.shape[:-1], weight_packed.shape[-1] * INT4_PER_INT32,
                                   dtype=torch.float32)


@torch.library.custom_op("kvtier::dequantize_fp8_block", mutates_args=(), device_types=("cpu", "cuda"))
def _dequantize_fp8_op(weight: torch.Tensor, weight_scale_inv: torch.Tensor, block_size: list[int]) -> torch.Tensor:
    return ref.dequantize_fp8_block(weight, weight_scale_inv, tuple(block_size))


@_dequantize_fp8_op.register_fake
def _(weight, weight_scale_inv, block_size):
    return weight.new_empty(weight.shape, dtype=torch.float32)


@torch.library.custom_op("kvtier::linear_w4a16", mutates_args=(), device_types="cpu")
def _linear_w4a16_cpu(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor, group_size: int,
                      bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    return ref.linear_w4a16(x, weight_packed, weight_scale, group_size, bias, out_dtype)


@_linear_w4a16_cpu.register_kernel("cuda")
def _(x, weight_packed, weight_scale, group_size, bias, out_dtype):
    return _linear_w4a16_impl(device_backend("linear_w4a16", x.device), x, weight_packed, weight_scale, group_size,
                              bias, out_dtype)


@_linear_w4a16_cpu.register_fake
def _(x, weight_packed, weight_scale, group_size, bias, out_dtype):
    return x.new_empty(x.shape[0], weight_packed.shape[0], dtype=out_dtype)


@torch.library.custom_op("kvtier::linear_fp8_block", mutates_args=(), device_types="cpu")
def _linear_fp8_cpu(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, block_size: list[int],
                    bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    return ref.linear_fp8_block(x, weight, weight_scale_inv, tuple(block_size), bias, out_dtype)


@_linear_fp8_cpu.register_kernel("cuda")
def _(x, weight, weight_scale_inv, block_size, bias, out_dtype):
    return _linear_fp8_impl(device_backend("linear_fp8_block", x.device), x, weight, weight_scale_inv,
                            tuple(block_size), bias, out_dtype)


@_linear_fp8_cpu.register_fake
def _(x, weight, weight_scale_inv, block_size, bias, out_dtype):
    return x.new_empty(x.shape[0], weight.shape[0], dtype=out_dtype)


@torch.library.custom_op("kvtier::fused_moe_w4a16", mutates_args=(), device_types="cpu")
def _moe_w4a16_cpu(hidden_states: torch.Tensor, w13_packed: torch.Tensor, w13_scale: torch.Tensor,
                   w2_packed: torch.Tensor, w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   group_size: int) -> torch.Tensor:
    return ref.fused_moe_w4a16(hidden_states, w13_packed, w13_scale, w2_packed, w2_scale, topk_weights, topk_ids,
                               group_size)


@_moe_w4a16_cpu.register_kernel("cuda")
def _(hidden_states, w13_packed, w13_scale, w2_packed, w2_scale, topk_weights, topk_ids, group_size):
    return _moe_w4a16_impl(device_backend("fused_moe_w4a16", hidden_states.device), hidden_states, w13_packed,
                           w13_scale, w2_packed, w2_scale, topk_weights, topk_ids, group_size)


@_moe_w4a16_cpu.register_fake
def _(hidden_states, w13_packed, w13_scale, w2_packed, w2_scale, topk_weights, topk_ids, group_size):
    return torch.empty_like(hidden_states)


@torch.library.custom_op("kvtier::fused_moe_fp8_block", mutates_args=(), device_types="cpu")
def _moe_fp8_cpu(hidden_states: torch.Tensor, w13: torch.Tensor, w13_scale_inv: torch.Tensor, w2: torch.Tensor,
                 w2_scale_inv: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 block_size: list[int]) -> torch.Tensor:
    return ref.fused_moe_fp8_block(hidden_states, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids,
                                   tuple(block_size))


@_moe_fp8_cpu.register_kernel("cuda")
def _(hidden_states, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids, block_size):
    return _moe_fp8_impl(device_backend("fused_moe_fp8_block", hidden_states.device), hidden_states, w13,
                         w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids, tuple(block_size))


@_moe_fp8_cpu.register_fake
def _(hidden_states, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids, block_size):
    return torch.empty_like(hidden_states)
