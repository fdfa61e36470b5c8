"""Triton launchers of the paged MLA ops: allocate scratch, pick the launch config, launch.

Arguments arrive checked by :mod:`kvtier.ops.attention`; ``out`` is allocated by the caller.
"""

from __future__ import annotations

import torch
import triton

from kvtier.ops import split_kv
from kvtier.ops._triton import arch_of, launchable, num_compute_units, triton_dot_dtype
from kvtier.triton_kernels import mla_decode as decode_kernels
from kvtier.triton_kernels import mla_extend as extend_kernels

MAX_KV_SPLITS = split_kv.MAX_KV_SPLITS


def decode_num_splits(batch: int, num_heads: int, max_kv_tokens: int, num_units: int) -> int:
    """:func:`kvtier.ops.split_kv.decode_num_splits` with this kernel's ``DECODE_BLOCK_H`` heads per program."""
    return split_kv.decode_num_splits(batch, num_heads, max_kv_tokens, num_units, decode_kernels.DECODE_BLOCK_H)


def _blocks(kv_lora_rank: int, rope_dim: int) -> tuple[int, int]:
    return triton.next_power_of_2(kv_lora_rank), triton.next_power_of_2(rope_dim)


def mla_decode(q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank, kv_scale, out, *, num_splits=None):
    """Fill ``out`` [B, H, R]; return lse [B, H] fp32. ``num_splits`` overrides the planner (tests)."""
    batch, num_heads, dim = q.shape
    lse = torch.empty(batch, num_heads, dtype=torch.float32, device=q.device)
    if batch == 0 or num_heads == 0:
        return lse
    page_size = kv_cache.shape[1]
    arch = arch_of(q.device)
    cfg = decode_kernels.decode_config(arch)
    if num_splits is None:
        num_splits = decode_num_splits(batch, num_heads, block_table.shape[1] * page_size,
                                       num_compute_units(q.device))
    block_c, block_r = _blocks(kv_lora_rank, dim - kv_lora_rank)
    part_out = torch.empty(batch, num_heads, num_splits, block_c, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    grid = (batch, triton.cdiv(num_heads, decode_kernels.DECODE_BLOCK_H), num_splits)
    launchable(decode_kernels.mla_decode_partial_kernel, q.device)[grid](
        q, kv_cache, block_table, seq_lens, part_out, part_lse,
        float(sm_scale), float(kv_scale), num_heads, kv_lora_rank, dim - kv_lora_rank,
        *q.stride(), *kv_cache.stride(), block_table.stride(0),
        PAGE_SIZE=page_size, NUM_SPLITS=num_splits, BLOCK_H=decode_kernels.DECODE_BLOCK_H,
        BLOCK_N=cfg["BLOCK_N"], BLOCK_C=block_c, BLOCK_R=block_r, DOT_DTYPE=triton_dot_dtype(q.dtype, q.device),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    launchable(decode_kernels.mla_decode_merge_kernel, q.device)[(batch, num_heads)](
        part_out, part_lse, out, lse, num_heads, kv_lora_rank, *out.stride(),
        NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_C=block_c,
        num_warps=decode_kernels.MERGE_NUM_WARPS,
    )
    return lse


def mla_extend(q, kv_cache, block_table, cu_seqlens_q, seq_lens, sm_scale, kv_lora_rank, kv_scale, out,
               max_new_tokens):
    """Fill ``out`` [T, H, R]; return lse [T, H] fp32. ``max_new_tokens``: max over sequences of n_q."""
    total_q, num_heads, dim = q.shape
    lse = torch.empty(total_q, num_heads, dtype=torch.float32, device=q.device)
    batch = block_table.shape[0]
    if total_q == 0 or num_heads == 0 or batch == 0:
        return lse
    cfg = extend_kernels.extend_config(arch_of(q.device))
    block_c, block_r = _blocks(kv_lora_rank, dim - kv_lora_rank)
    grid = (batch, triton.cdiv(max_new_tokens * num_heads, cfg["BLOCK_M"]))
    launchable(extend_kernels.mla_extend_kernel, q.device)[grid](
        q, kv_cache, block_table, cu_seqlens_q, seq_lens, out, lse,
        float(sm_scale), float(kv_scale), num_heads, kv_lora_rank, dim - kv_lora_rank,
        *q.stride(), *kv_cache.stride(), block_table.stride(0), *out.stride(),
        PAGE_SIZE=kv_cache.shape[1], BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_C=block_c,
        BLOCK_R=block_r, DOT_DTYPE=triton_dot_dtype(q.dtype, q.device),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return lse
