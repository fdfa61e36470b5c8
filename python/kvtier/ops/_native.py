"""Launchers of the native kernels: tensors in, raw arguments out.

Two libraries take the same arguments (``hip/csrc/kernel_bindings.h``): :func:`gpu_kernels`, the
GPU kernels in ``kvtier._hip`` (backend ``"hip"``, CUDA/ROCm tensors), and :func:`cpu_kernels`, the
C++ CPU implementations of the same semantics in ``kvtier._C.kernels_cpu`` (CPU tensors; what the
CPU tests check against the torch references). The functions here take that library as their
first argument and do allocate → launch for arguments the public ops in :mod:`kvtier.ops` already
checked; they add only the checks the native ABI needs (unit inner strides, dtype pairs).
"""

from __future__ import annotations

import contextlib
import types

import torch

from kvtier.ops import split_kv

# kvtier::DType codes (hip/include/kvtier/numeric.h).
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3,
               torch.float8_e4m3fnuz: 4}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
# (q dtype, kv_cache dtype) pairs with a paged MLA decode instantiation (out has q's dtype).
MLA_DTYPE_PAIRS = ((torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
                   (torch.bfloat16, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e4m3fnuz))


def gpu_kernels() -> types.ModuleType:
    """``kvtier._hip`` (ImportError when it is not built)."""
    from kvtier import _hip

    return _hip


def cpu_kernels() -> types.ModuleType:
    """``kvtier._C.kernels_cpu``: the CPU implementations, same signatures as :func:`gpu_kernels`."""
    from kvtier._C import kernels_cpu

    return kernels_cpu


def _launch_context(device: torch.device):
    """The device guard and the stream handle for a launch on ``device`` (0 on CPU)."""
    if device.type != "cuda":
        return contextlib.nullcontext(), 0
    return torch.cuda.device(device), torch.cuda.current_stream(device).cuda_stream


def page_copy(lib, kv_pools, pages: torch.Tensor, staging: torch.Tensor, *, gather: bool) -> int:
    """Gather (``gather=True``) pools -> staging, or scatter staging -> pools; returns the word size in
    bytes the copy used (16 = vector accesses). Arguments as checked by :mod:`kvtier.ops.pages`."""
    first = kv_pools[0]
    es = first.element_size()
    host_ptrs = [p.data_ptr() for p in kv_pools]
    table = torch.tensor(host_ptrs, dtype=torch.int64, device=staging.device)  # stream-ordered with the launch
    pages = pages.contiguous()
    guard, stream = _launch_context(staging.device)
    fn = lib.gather_pages if gather else lib.scatter_pages
    with guard:
        return fn(table.data_ptr(), host_ptrs, pages.data_ptr(), pages.dtype == torch.int64, staging.data_ptr(),
                  pages.numel(), first.shape[0], first.shape[1] * first.shape[2] * es, first.stride(0) * es, stream)


def moe_align_block_size(lib, topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """The contract of :func:`kvtier.ops.moe_align_block_size` on a native library."""
    ids = topk_ids.contiguous()
    dev, num_pairs = ids.device, ids.numel()
    max_padded = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(max_padded // block_m, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    work = torch.empty(max(1, lib.moe_align_workspace_size(num_pairs, num_experts)), dtype=torch.int32, device=dev)
    guard, stream = _launch_context(dev)
    with guard:
        lib.moe_align_block_size(ids.data_ptr(), num_pairs, num_experts, block_m, sorted_ids.data_ptr(),
                                 expert_ids.data_ptr(), num_padded.data_ptr(), work.data_ptr(), stream)
    return sorted_ids, expert_ids, num_padded


def check_mla_dtypes(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    """Raise ValueError unless (q, kv_cache) dtypes have a native decode instantiation."""
    if (q_dtype, kv_dtype) not in MLA_DTYPE_PAIRS:
        pairs = ", ".join(f"({str(a)[6:]}, {str(b)[6:]})" for a, b in MLA_DTYPE_PAIRS)
        raise ValueError(f"backend='hip' mla_decode supports (q, kv_cache) dtypes {pairs}; got "
                         f"({str(q_dtype)[6:]}, {str(kv_dtype)[6:]})")


def mla_decode_num_splits(lib, q: torch.Tensor, block_table: torch.Tensor, page_size: int) -> int:
    """Split count of :func:`mla_decode` on ``lib`` (1 on CPU, where there are no parallel units to fill)."""
    if q.device.type != "cuda":
        return 1
    units = torch.cuda.get_device_properties(q.device).multi_processor_count
    return split_kv.decode_num_splits(q.shape[0], q.shape[1], block_table.shape[1] * page_size, units,
                                      lib.MLA_HEADS_PER_BLOCK)


def mla_decode(lib, q, kv_cache, block_table, seq_lens, sm_scale: float, kv_lora_rank: int, kv_scale: float,
               out: torch.Tensor, *, num_splits: int | None = None) -> torch.Tensor:
    """Fill ``out`` [B, H, R]; return lse [B, H] fp32. ``num_splits`` overrides the planner (tests).

    Raises ValueError for a dtype pair without an instantiation or a cache whose last dim is strided.
    """
    check_mla_dtypes(q.dtype, kv_cache.dtype)
    if kv_cache.stride(-1) != 1:
        raise ValueError(f"backend='hip' needs kv_cache.stride(-1) == 1, got strides {kv_cache.stride()}")
    batch, num_heads, dim = q.shape
    lse = torch.empty(batch, num_heads, dtype=torch.float32, device=q.device)
    if batch == 0 or num_heads == 0:
        return lse
    page_size = kv_cache.shape[1]
    if num_splits is None:
        num_splits = mla_decode_num_splits(lib, q, block_table, page_size)
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    seq_lens = seq_lens.contiguous()
    dst = out if out.stride(-1) == 1 else torch.empty_like(out, memory_format=torch.contiguous_format)
    part_out = torch.empty(batch, num_heads, num_splits, kv_lora_rank, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    sizes = [batch, num_heads, dim, kv_lora_rank, page_size, block_table.shape[1], kv_cache.shape[0], num_splits]
    guard, stream = _launch_context(q.device)
    with guard:
        lib.mla_decode(q.data_ptr(), kv_cache.data_ptr(), block_table.data_ptr(), seq_lens.data_ptr(), dst.data_ptr(),
                       lse.data_ptr(), part_out.data_ptr(), part_lse.data_ptr(), list(q.stride()[:2]),
                       list(kv_cache.stride()[:2]), block_table.stride(0), list(dst.stride()[:2]), sizes,
                       float(sm_scale), float(kv_scale), DTYPE_CODES[q.dtype], DTYPE_CODES[kv_cache.dtype], stream)
    if dst is not out:
        out.copy_(dst)
    return lse
