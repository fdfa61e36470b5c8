"""Adversarial paged MLA inputs and the dense float64 attention oracle of the MLA op tests."""

from __future__ import annotations

import math

import torch


SENTINEL = 2147480000  # FlashMLA's out-of-range block_table filler


def _paged_pool(seqs, page_size, dtype, gen, *, strided, extra_pages=3):
    """Scatter each ``[L_b, D]`` sequence into a shuffled, NaN-poisoned page pool.

    Returns ``(kv_cache [num_pages, page_size, D], block_table [B, max_pages] int32)``. With
    ``strided`` the cache is a column slice of a wider NaN tensor (non-contiguous view).
    """
    width = seqs[0].shape[1]
    needed = [math.ceil(s.shape[0] / page_size) for s in seqs]
    num_pages = sum(needed) + extra_pages
    max_pages = max(needed) + 2  # every row has unused entries
    perm = torch.randperm(num_pages, generator=gen).tolist()
    unused = perm[sum(needed):]
    if strided:
        wide = torch.full((num_pages, page_size, width + 7), math.nan, dtype=dtype)
        kv_cache = wide[:, :, 3:3 + width]
        assert not kv_cache.is_contiguous()
    else:
        kv_cache = torch.full((num_pages, page_size, width), math.nan, dtype=dtype)
    block_table = torch.full((len(seqs), max_pages), SENTINEL, dtype=torch.int32)
    nxt = 0
    for b, seq in enumerate(seqs):
        for p in range(needed[b]):
            page_id = perm[nxt]
            nxt += 1
            block_table[b, p] = page_id
            rows = seq[p * page_size:(p + 1) * page_size]
            kv_cache[page_id, :rows.shape[0]] = rows.to(dtype)
        block_table[b, needed[b]] = unused[b % len(unused)]  # in range, but a NaN page
    return kv_cache, block_table


def _dense_attention(q, seq_kv, n_q, sm_scale, kv_lora_rank):
    """Float64 causal attention of ``n_q`` queries at the last ``n_q`` positions of ``seq_kv``.

    q: [n_q, H, D]; seq_kv: [L, D]. Returns out [n_q, H, r], lse [n_q, H]; a query with no keys
    gets out = 0 and lse = +inf (the documented convention).
    """
    q, kv = q.double(), seq_kv.double()
    seq_len, num_heads = kv.shape[0], q.shape[1]
    out = torch.zeros(n_q, num_heads, kv_lora_rank, dtype=torch.float64)
    lse = torch.full((n_q, num_heads), math.inf, dtype=torch.float64)
    for i in range(n_q):
        visible = kv[:seq_len - n_q + i + 1]
        if visible.shape[0] == 0:
            continue
        scores = (q[i] @ visible.T) * sm_scale  # [H, keys]
        peak = scores.max(dim=-1, keepdim=True).values
        weights = torch.exp(scores - peak)
        total = weights.sum(dim=-1, keepdim=True)
        out[i] = (weights / total) @ visible[:, :kv_lora_rank]
        lse[i] = (peak + torch.log(total)).squeeze(-1)
    return out, lse


def _rounded(shape, dtype, gen, scale=1.0):
    """Random values already representable in ``dtype`` (so the oracle and op see the same input)."""
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def _make_q(shape, dtype, gen, *, strided):
    q = _rounded(shape, dtype, gen)
    if strided:  # a non-contiguous q as well: rows of a wider buffer
        wide = torch.full((*shape[:-1], shape[-1] + 5), math.nan, dtype=dtype)
        wide[..., 2:2 + shape[-1]] = q
        q = wide[..., 2:2 + shape[-1]]
        assert not q.is_contiguous()
    return q
