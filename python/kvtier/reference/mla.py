"""Paged MLA attention references (weight-absorbed form, one shared latent KV head).

Per query token and head, over ``L`` cached tokens of width ``D = kv_lora_rank + rope_dim``:
``scores = q . kv^T * sm_scale``, ``out = softmax(scores) @ kv[:, :kv_lora_rank]``.

Bytes (decode, per sequence): ``L*D`` cache elements + ``H*D`` q + ``H*kv_lora_rank`` out
(times each tensor's element size; the cache is read once for all heads, which share it).
FLOPs (decode): ``2*H*L*D + 2*H*L*kv_lora_rank``. Extend: same per query over its visible keys,
i.e. ``(2*D + 2*kv_lora_rank) * H * sum_i visible_i`` with ``visible_i = prefix + i + 1``; bytes
``L*D`` cache + ``n_q*H*(D + kv_lora_rank)`` q/out per sequence.

FP8 caches store ``kv / kv_scale`` (e4m3); the references dequantise ``kv_cache * kv_scale``.
"""

import math

import torch


def mla_decode_bytes(batch: int, num_heads: int, seq_len: int, dim: int, kv_lora_rank: int, kv_bytes: int,
                     q_bytes: int) -> int:
    """DRAM bytes of one decode step: each sequence's ``seq_len`` cache rows once (shared by all heads),
    q in, out out (lse and block_table ignored)."""
    return batch * (seq_len * dim * kv_bytes + num_heads * (dim + kv_lora_rank) * q_bytes)


def mla_decode_flops(batch: int, num_heads: int, seq_len: int, dim: int, kv_lora_rank: int) -> int:
    """FLOPs of one decode step: scores ``2*H*L*D`` plus values ``2*H*L*kv_lora_rank`` per sequence."""
    return batch * 2 * num_heads * seq_len * (dim + kv_lora_rank)


def _gather_kv(kv_cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int,
               kv_scale: float | None = None) -> torch.Tensor:
    """[seq_len, D] fp32 rows of one sequence (times ``kv_scale``); reads only pages that hold its tokens."""
    page_size = kv_cache.shape[1]
    num_pages = (seq_len + page_size - 1) // page_size
    pages = block_table_row[:num_pages].long()
    rows = kv_cache[pages].reshape(-1, kv_cache.shape[-1])[:seq_len].float()
    return rows if kv_scale is None else rows * kv_scale


def _attend(q: torch.Tensor, kv: torch.Tensor, sm_scale: float, kv_lora_rank: int, first_pos: int):
    """q: [n_q, H, D] fp32 at positions first_pos.. ; kv: [L, D] fp32. Causal. Returns out, lse."""
    n_q, num_heads, _ = q.shape
    if kv.shape[0] == 0:
        out = q.new_zeros(n_q, num_heads, kv_lora_rank)
        return out, q.new_full((n_q, num_heads), math.inf)
    scores = torch.einsum("qhd,kd->qhk", q, kv) * sm_scale
    q_pos = torch.arange(n_q, device=q.device) + first_pos
    k_pos = torch.arange(kv.shape[0], device=q.device)
    visible = k_pos[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~visible[:, None, :], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    out = torch.einsum("qhk,kr->qhr", probs, kv[:, :kv_lora_rank])
    return out, lse


def mla_extend(q, kv_cache, block_table, cu_seqlens_q, seq_lens, sm_scale, kv_lora_rank, *, out=None,
               kv_scale=None):
    """Ragged causal MLA over a paged cache; see :func:`kvtier.ops.mla_extend` for the contract.

    Query ``i`` of sequence ``b`` sits at position ``seq_lens[b] - n_q(b) + i`` and sees keys at
    positions ``<=`` its own. Returns ``(out [total_q, H, kv_lora_rank] in q.dtype, lse
    [total_q, H] fp32, natural log, +inf where no key is visible)``.
    """
    total_q, num_heads, _ = q.shape
    res = torch.empty(total_q, num_heads, kv_lora_rank, dtype=torch.float32, device=q.device)
    lse = torch.empty(total_q, num_heads, dtype=torch.float32, device=q.device)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        start, end = cu[b], cu[b + 1]
        kv = _gather_kv(kv_cache, block_table[b], seq_len, kv_scale)
        res[start:end], lse[start:end] = _attend(q[start:end].float(), kv, sm_scale, kv_lora_rank,
                                                 seq_len - (end - start))
    out = res.to(q.dtype) if out is None else out.copy_(res)
    return out, lse


def mla_decode(q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank, *, out=None, kv_scale=None):
    """One query per sequence attending to all ``seq_lens[b]`` cached tokens (see ops.mla_decode)."""
    batch = q.shape[0]
    cu = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    return mla_extend(q, kv_cache, block_table, cu, seq_lens, sm_scale, kv_lora_rank, out=out, kv_scale=kv_scale)


def concat_and_cache_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:
    """Write ``[kv_c | k_pe]`` of each token into slot ``slot_mapping[t]`` (``-1`` = skip).

    Reads no device value on the host (so a CUDA graph can capture it): a skipped token rewrites
    the row the first written token writes, with the same value (or slot 0 with its own value when
    no token is written), so every duplicate index of the one scatter carries one value.

    Bytes: ``T*D`` read + ``T*D`` written.
    """
    if slot_mapping.numel() == 0:
        return
    page_size = kv_cache.shape[1]
    rows = torch.cat([kv_c, k_pe], dim=-1).to(kv_cache.dtype)
    slots = slot_mapping.long()
    keep = slots >= 0
    first = torch.argmax(keep.to(torch.int32))  # first written token (0 when none is)
    spare = slots[first].clamp(min=0)
    spare_row = torch.where(keep[first], rows[first], kv_cache[spare // page_size, spare % page_size])
    target = torch.where(keep, slots, spare)
    values = torch.where(keep[:, None], rows, spare_row[None, :])
    kv_cache[target // page_size, target % page_size] = values
