"""The paged MLA ops as ``torch.library`` ops, one kernel per device type.

``torch.ops.kvtier.mla_decode``, ``mla_extend`` and ``concat_and_cache_mla`` exist as soon as
``kvtier`` is imported. Their schemas carry no backend: the CPU kernel is the torch backend's
blocked kernel (:mod:`kvtier.ops._cpu_mla`; the fp32 reference where torch lacks its attention
kernel), the CUDA kernel (CUDA and ROCm builds of torch) runs :func:`kvtier.ops.dispatch.device_backend`'s
choice (Triton, else the HIP kernels where built, else the reference). Each op has a fake
implementation, so ``torch.compile`` traces it as one opaque node, and the Triton and HIP kernels
read no device value on the host, so a CUDA/HIP graph can capture them (the CPU kernels read the
lengths; ``concat_and_cache_mla`` reads nothing on either). They check nothing about values: callers pass
what :mod:`kvtier.ops.attention` checks (its plans check once per step).

Schemas (``Tensor(a!)``: written in place)::

    mla_decode(Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens, float sm_scale,
               int kv_lora_rank, float kv_scale, Tensor(a!) out, int num_splits=0) -> Tensor lse
    mla_extend(Tensor q, Tensor kv_cache, Tensor block_table, Tensor cu_seqlens_q, Tensor seq_lens,
               float sm_scale, int kv_lora_rank, float kv_scale, int max_new_tokens,
               Tensor(a!) out) -> Tensor lse
    concat_and_cache_mla(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()

``num_splits`` = 0 lets the kernel split each sequence's keys by the block_table capacity; a plan
passes the count it chose from the step's longest sequence. ``max_new_tokens`` is the largest
``cu_seqlens_q[b + 1] - cu_seqlens_q[b]`` (the extend grid's size, a host value).
"""

from __future__ import annotations

import torch

from kvtier import reference
from kvtier.ops import _cpu_mla
from kvtier.ops.dispatch import device_backend


def decode_impl(backend: str, q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank, kv_scale, out,
                num_splits=0):
    """Run ``backend``'s paged decode ("torch", "triton" or "hip"; aiter runs on its plan in
    :func:`kvtier.ops.mla_decode_run`); fills ``out``, returns lse. ``num_splits`` 0 = the launcher's choice."""
    splits = num_splits or None
    if backend == "triton":
        from kvtier.ops import _triton_mla

        return _triton_mla.mla_decode(q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank, kv_scale, out,
                                      num_splits=splits)
    if backend == "hip":
        from kvtier.ops import _native

        return _native.mla_decode(_native.gpu_kernels(), q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank,
                                  kv_scale, out, num_splits=splits)
    if q.device.type == "cpu":
        return _cpu_mla.mla_decode(q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank, out=out,
                                   kv_scale=kv_scale)[1]
    return reference.mla_decode(q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank, out=out,
                                kv_scale=kv_scale)[1]


def extend_impl(backend: str, q, kv_cache, block_table, cu_seqlens_q, seq_lens, sm_scale, kv_lora_rank, kv_scale,
                max_new_tokens, out):
    """Run ``backend``'s paged extend; fills ``out``, returns lse."""
    if backend == "triton":
        from kvtier.ops import _triton_mla

        return _triton_mla.mla_extend(q, kv_cache, block_table, cu_seqlens_q, seq_lens, sm_scale, kv_lora_rank,
                                      kv_scale, out, max_new_tokens)
    if q.device.type == "cpu":
        return _cpu_mla.mla_extend(q, kv_cache, block_table, cu_seqlens_q, seq_lens, sm_scale, kv_lora_rank,
                                   out=out, kv_scale=kv_scale)[1]
    return reference.mla_extend(q, kv_cache, block_table, cu_seqlens_q, seq_lens, sm_scale, kv_lora_rank, out=out,
                                kv_scale=kv_scale)[1]


def decode_cpu(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               sm_scale: float, kv_lora_rank: int, kv_scale: float, out: torch.Tensor,
               num_splits: int = 0) -> torch.Tensor:
    """The CPU kernel of ``torch.ops.kvtier.mla_decode`` (its schema), callable without the
    registration's dispatch (:func:`kvtier.ops.dispatch.calls_registered_op`)."""
    return decode_impl("torch", q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank, kv_scale, out)


_mla_decode_cpu = torch.library.custom_op("kvtier::mla_decode", mutates_args=("out",), device_types="cpu")(decode_cpu)


@_mla_decode_cpu.register_kernel("cuda")
def _(q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank, kv_scale, out, num_splits=0):
    return decode_impl(device_backend("mla_decode", q.device), q, kv_cache, block_table, seq_lens, sm_scale,
                       kv_lora_rank, kv_scale, out, num_splits)


@_mla_decode_cpu.register_fake
def _(q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank, kv_scale, out, num_splits=0):
    return q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32)


def extend_cpu(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
               seq_lens: torch.Tensor, sm_scale: float, kv_lora_rank: int, kv_scale: float, max_new_tokens: int,
               out: torch.Tensor) -> torch.Tensor:
    """The CPU kernel of ``torch.ops.kvtier.mla_extend`` (its schema), callable without the
    registration's dispatch."""
    return extend_impl("torch", q, kv_cache, block_table, cu_seqlens_q, seq_lens, sm_scale, kv_lora_rank, kv_scale,
                       max_new_tokens, out)


_mla_extend_cpu = torch.library.custom_op("kvtier::mla_extend", mutates_args=("out",), device_types="cpu")(extend_cpu)


@_mla_extend_cpu.register_kernel("cuda")
def _(q, kv_cache, block_table, cu_seqlens_q, seq_lens, sm_scale, kv_lora_rank, kv_scale, max_new_tokens, out):
    return extend_impl(device_backend("mla_extend", q.device), q, kv_cache, block_table, cu_seqlens_q, seq_lens,
                       sm_scale, kv_lora_rank, kv_scale, max_new_tokens, out)


@_mla_extend_cpu.register_fake
def _(q, kv_cache, block_table, cu_seqlens_q, seq_lens, sm_scale, kv_lora_rank, kv_scale, max_new_tokens, out):
    return q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32)


@torch.library.custom_op("kvtier::concat_and_cache_mla", mutates_args=("kv_cache",), device_types=("cpu", "cuda"))
def _concat_and_cache_mla_op(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                             slot_mapping: torch.Tensor) -> None:
    reference.concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping)


@_concat_and_cache_mla_op.register_fake
def _(kv_c, k_pe, kv_cache, slot_mapping):
    return None
