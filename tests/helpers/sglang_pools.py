"""SGLang's CPU host pools, built from SGLang's own device pools on "cpu" (as SGLang's CPU unit
tests build them), for the storage backend's conformance tests and perf/sglang_storage_bench.py.
Imports SGLang: use it only inside the SGLang venv.

A host pool checks that the machine has its bytes free beside a 10 GiB reserve; these pools are a
few MB (the bench's 302 MB), so they are booked against an explicit budget
(``host_memory_budget_scope``, SGLang's way to size pools explicitly) and do not fail on a shared
machine whose free memory dips below the reserve.
"""

from __future__ import annotations

import torch

BUDGET_BYTES = 2 << 30
"""The host memory the pools of one helper call may book (SGLang's explicit sizing)."""


def mha_pool(layout: str, page_size: int = 16, layers: int = 4, heads: int = 2, head_dim: int = 64,
             tokens: int = 64):
    """``MHATokenToKVPoolHost`` (bf16 K/V, ``heads`` x ``head_dim``) over an ``MHATokenToKVPool`` of
    ``tokens`` slots, host/device ratio 2."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    device = MHATokenToKVPool(tokens, page_size, torch.bfloat16, heads, head_dim, layers, "cpu", False,
                              start_layer=0, end_layer=layers)
    info = device.get_device_pool_infos()[0].buffer_info
    with host_memory_budget_scope(BUDGET_BYTES):
        return MHATokenToKVPoolHost(info, 2.0, 0, page_size, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=device.size, start_layer=0, end_layer=layers)


def mla_pool(layout: str, page_size: int = 16, layers: int = 3, tokens: int = 64):
    """``MLATokenToKVPoolHost`` of Kimi K2's row (kv_lora_rank 512 + qk_rope_head_dim 64, bf16) over
    an ``MLATokenToKVPool`` of ``tokens`` slots, host/device ratio 2."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    device = MLATokenToKVPool(tokens, page_size, torch.bfloat16, 512, 64, layers, "cpu", False,
                              start_layer=0, end_layer=layers)
    info = device.get_device_pool_infos()[0].buffer_info
    with host_memory_budget_scope(BUDGET_BYTES):
        return MLATokenToKVPoolHost(info, 2.0, 0, page_size, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=device.size, start_layer=0, end_layer=layers,
                                    target_layer_num=layers)


def page_bytes(pool, start: int) -> torch.Tensor:
    """A copy of the flat data page at token slot ``start`` as uint8."""
    return pool.get_data_page(start, flat=True).contiguous().view(torch.uint8).clone()


def fill(pool, seed: int = 0) -> None:
    """Random bf16 values in the whole pool."""
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g).to(pool.kv_buffer.dtype))
