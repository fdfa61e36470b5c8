"""Adversarial paged MLA inputs on a GPU at K2 widths, and the GPU's fp8 dtype."""

from __future__ import annotations

import torch


RANK, ROPE, SM_SCALE, SENTINEL = 512, 64, 0.130861, 2**31 - 1


def _paged(batch, heads, seq_lens, page_size, kv_dtype, new_tokens=None, seed=0):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    pages_per_seq = max(1, -(-max(seq_lens) // page_size)) + 1
    num_pages = batch * pages_per_seq + 3
    kv = torch.full((num_pages, page_size, RANK + ROPE), float("nan"), device=dev, dtype=torch.bfloat16)
    perm = torch.randperm(num_pages, device=dev, generator=gen).to(torch.int32)
    block_table = torch.full((batch, pages_per_seq), SENTINEL, dtype=torch.int32, device=dev)
    for b, n in enumerate(seq_lens):
        used = -(-n // page_size)
        block_table[b, :used] = perm[b * pages_per_seq: b * pages_per_seq + used]
        rows = torch.randn(used * page_size, RANK + ROPE, device=dev, generator=gen, dtype=torch.bfloat16)
        rows[n:] = float("nan")  # tail slots of the last page
        kv[block_table[b, :used].long()] = rows.view(used, page_size, -1)
    if kv_dtype != torch.bfloat16:
        kv = kv.to(kv_dtype)
    total_q = batch if new_tokens is None else sum(new_tokens)
    q = torch.randn(total_q, heads, RANK + ROPE, device=dev, generator=gen, dtype=torch.bfloat16)
    return q, kv, block_table, torch.tensor(seq_lens, dtype=torch.int32, device=dev)


def _fp8():
    arch = torch.cuda.get_device_properties(0).gcnArchName if torch.version.hip else ""
    return torch.float8_e4m3fnuz if arch.startswith("gfx942") else torch.float8_e4m3fn
