"""Paged MLA extend on the CPU, blocked: the ``torch`` backend's CPU kernel.

Same contract and signature as :func:`kvtier.reference.mla_extend` (its fp32 reference, which the
tests compare it to), computed without the reference's ``[n_q, H, L]`` score tensor: each
sequence's new tokens attend to

* its cached prefix (keys ``[0, L - n_q)``, all visible to every query), and
* its new tokens (keys ``[L - n_q, L)``, a square causal block),

each through PyTorch's blocked CPU attention kernel (``aten::_scaled_dot_product_flash_attention_for_cpu``,
which skips the masked blocks of a causal square and returns the log-sum-exp), and the two partial
results are merged by their log-sum-exps: ``lse = logaddexp(lse_1, lse_2)``,
``out = out_1 * exp(lse_1 - lse) + out_2 * exp(lse_2 - lse)`` (the merge of FlashAttention-2's
online softmax, Dao 2023, §3.1; FlashInfer's ``merge_state``). The latent row is both key and
value (the value is its first ``kv_lora_rank`` columns: the kernel needs equal key and value
widths, so it computes the rope columns of the output too and they are dropped). Every head reads
the one latent head, so the prefix runs the ``n_q * H`` query rows as a single head
(:func:`_shared_keys`); the causal block, whose mask is per row, runs per head on a per-head copy
of its keys while that copy is small (:data:`EXPAND_COPY_BYTES`).

Accumulation is fp32. A bf16 cache read by bf16 queries (no ``kv_scale``) goes into the kernel as
it is (it accumulates in fp32; no fp32 copy of the context is made), and a decode step runs all
its sequences in one kernel call (:func:`mla_decode`); other inputs are upcast to fp32 and
dequantised by ``kv_scale`` as the reference does. The results differ from the reference by fp32
rounding (a different summation order) and, for bf16, by the kernel's bf16 probabilities and
output (within the bf16 tolerances of ``tests/ops/test_cpu_mla.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvtier import reference
from kvtier.reference.mla import _attend as _dense_attend
from kvtier.reference.mla import _gather_kv

_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

MIN_PAIRS = 4096
"""Sequences with fewer query-key pairs than this take the reference's dense path (one small
matmul costs less than two kernel calls and a merge)."""


def available() -> bool:
    """Whether this torch build has the blocked CPU attention kernel (else the reference runs)."""
    return _FLASH is not None


EXPAND_COPY_BYTES = 32 << 20
"""The causal block's latent keys are copied to every head when that copy stays under this many
bytes: the blocked kernel runs 1.7x faster on contiguous per-head keys than on an expanded view
(384 new tokens, 4 heads of 576, bf16: 2.0 against 3.5 ms, torch 2.13 on one core)."""


def _shared_keys(q: torch.Tensor, kv: torch.Tensor, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n_q, H, D] over every row of kv [L, D] (no mask): all heads attend to the one latent
    head, so the ``n_q * H`` query rows run as one head (no copy of kv). Returns (out [n_q, H, D],
    lse [n_q, H] fp32)."""
    n_q, heads, dim = q.shape
    k = kv[None, None]
    out, lse = _FLASH(q.reshape(1, 1, n_q * heads, dim), k, k, 0.0, False, scale=sm_scale)[:2]
    return out.view(n_q, heads, dim), lse.view(n_q, heads)


def _causal_block(q: torch.Tensor, kv: torch.Tensor, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n_q, H, D] over kv [n_q, D], query i seeing keys <= i (the kernel skips the masked
    blocks). Returns (out [n_q, H, D], lse [n_q, H] fp32)."""
    heads = q.shape[1]
    k = kv.expand(1, heads, *kv.shape)
    if k.numel() * k.element_size() <= EXPAND_COPY_BYTES:
        k = k.contiguous()
    out, lse = _FLASH(q.transpose(0, 1).unsqueeze(0), k, k, 0.0, True, scale=sm_scale)[:2]
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)


def _attend(q: torch.Tensor, kv: torch.Tensor, sm_scale: float, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n_q, H, D], the last ``n_q`` of ``kv`` [L, D] (both fp32, or both bf16: the kernel
    accumulates in fp32); causal. Returns (out [n_q, H, kv_lora_rank] fp32 when merged with a
    prefix, else in q's dtype, lse [n_q, H] fp32)."""
    n_q = q.shape[0]
    prefix = kv.shape[0] - n_q
    out, lse = _causal_block(q, kv[prefix:], sm_scale)
    if prefix:
        out_p, lse_p = _shared_keys(q, kv[:prefix], sm_scale)
        merged = torch.logaddexp(lse_p, lse)
        out = (out_p.float() * torch.exp(lse_p - merged).unsqueeze(-1)
               + out.float() * torch.exp(lse - merged).unsqueeze(-1))
        lse = merged
    return out[..., :kv_lora_rank], lse


def _reads_native(q: torch.Tensor, kv_cache: torch.Tensor, kv_scale) -> bool:
    """Whether the kernel can read q and the cache as they are: one dtype (fp32 or bf16), no scale."""
    return kv_scale in (None, 1.0) and q.dtype == kv_cache.dtype and q.dtype in (torch.float32, torch.bfloat16)


def _gather_rows(kv_cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, D] rows of one sequence in the cache's dtype (its pages only)."""
    page_size = kv_cache.shape[1]
    pages = block_table_row[:(seq_len + page_size - 1) // page_size].long()
    return kv_cache[pages].reshape(-1, kv_cache.shape[-1])[:seq_len]


def mla_extend(q, kv_cache, block_table, cu_seqlens_q, seq_lens, sm_scale, kv_lora_rank, *, out=None,
               kv_scale=None):
    """Ragged causal MLA over a paged cache, on the CPU; see :func:`kvtier.ops.mla_extend`.

    Args: as :func:`kvtier.reference.mla_extend` (q [total_q, H, D]; kv_cache [num_pages, page_size, D];
    block_table [batch, max_pages] int32; cu_seqlens_q [batch + 1] int32; seq_lens [batch] int32).

    Returns:
        ``(out [total_q, H, kv_lora_rank] in q.dtype (or written into ``out``), lse [total_q, H]
        fp32)``; a sequence with no new token contributes nothing, one with no key gives out 0 and
        lse ``+inf``.
    """
    if _FLASH is None:
        return reference.mla_extend(q, kv_cache, block_table, cu_seqlens_q, seq_lens, sm_scale, kv_lora_rank,
                                    out=out, kv_scale=kv_scale)
    total_q, num_heads, _ = q.shape
    res = torch.empty(total_q, num_heads, kv_lora_rank, dtype=torch.float32, device=q.device)
    lse = torch.empty(total_q, num_heads, dtype=torch.float32, device=q.device)
    cu = cu_seqlens_q.tolist()
    native = _reads_native(q, kv_cache, kv_scale)
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = cu[b], cu[b + 1]
        n_q = end - start
        if n_q == 0:
            continue
        if seq_len == 0:
            res[start:end], lse[start:end] = 0.0, math.inf
            continue
        if n_q * seq_len < MIN_PAIRS:
            res[start:end], lse[start:end] = _dense_attend(q[start:end].float(), _gather_kv(
                kv_cache, block_table[b], seq_len, kv_scale), sm_scale, kv_lora_rank, seq_len - n_q)
        elif native:  # the kernel reads bf16 as it is: no fp32 copy of the context
            rows = _gather_rows(kv_cache, block_table[b], seq_len)
            res[start:end], lse[start:end] = _attend(q[start:end], rows, sm_scale, kv_lora_rank)
        else:
            res[start:end], lse[start:end] = _attend(q[start:end].float(), _gather_kv(
                kv_cache, block_table[b], seq_len, kv_scale), sm_scale, kv_lora_rank)
    out = res.to(q.dtype) if out is None else out.copy_(res)
    return out, lse


def _read_slots(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``kv_cache`` rows at ``slots`` ([...] int64, ``page * page_size + offset``) -> [..., D] in
    the cache's dtype: one ``index_select`` of whole rows over the cache's ``[num_pages *
    page_size, D]`` view (a row copy each; indexing the page and slot dims separately costs
    an index computation per element, 2-3x slower for 8 x 400 rows of 576), or that two-index
    gather when the cache's pages are not evenly strided (no such view)."""
    if kv_cache.stride(0) != kv_cache.shape[1] * kv_cache.stride(1):
        page_size = kv_cache.shape[1]
        return kv_cache[slots // page_size, slots % page_size]
    rows = kv_cache.flatten(0, 1).index_select(0, slots.reshape(-1))
    return rows.view(*slots.shape, kv_cache.shape[-1])


def concat_and_cache_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:
    """Write ``[kv_c | k_pe]`` of each token into slot ``slot_mapping[t]`` (``-1`` skips it), in
    place, on the CPU: the contract of :func:`kvtier.reference.concat_and_cache_mla` (its
    reference, which never reads a value on the host so that a CUDA graph can capture it) with the
    skipped tokens dropped on the host and the rows written by one ``index_copy_`` over the
    cache's ``[num_pages * page_size, D]`` view (the reference's eight small ops and two-index
    scatter cost 120 µs for 8 tokens, this 20 µs, measured with torch 2.13 on one core).

    kv_c [T, kv_lora_rank], k_pe [T, D - kv_lora_rank] float; kv_cache [num_pages, page_size, D];
    slot_mapping [T] int32/int64 (checked by the caller, :func:`kvtier.ops.concat_and_cache_mla`).
    """
    if kv_cache.stride(0) != kv_cache.shape[1] * kv_cache.stride(1):  # no row view: the reference
        reference.concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping)
        return
    slots = slot_mapping.long()
    rows = torch.cat([kv_c, k_pe], dim=-1).to(kv_cache.dtype)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, rows = slots[keep], rows[keep]
    kv_cache.view(-1, kv_cache.shape[-1]).index_copy_(0, slots, rows)


PAD_FACTOR = 2
"""A decode step runs as one batched kernel call (:func:`_decode_batched`) when padding every
sequence to the longest costs at most this many times the keys the batch holds; past it (one
long context among short ones) each sequence runs on its own."""


@dataclass(frozen=True, eq=False)
class _DecodeGather:
    """What every layer of one decode step shares (derived from block_table and seq_lens only):
    the slot each padded key reads and the mask of the padding."""

    block_table: torch.Tensor  # copies of the step's metadata the gather was built from
    seq_lens: torch.Tensor
    page_size: int
    lens: list[int]
    slots: torch.Tensor  # [batch, L] int64
    mask: torch.Tensor  # [batch, 1, 1, L] in the queries' dtype: 0 or -inf
    empty: torch.Tensor | None  # [batch] bool, None when no sequence is empty

    def fits(self, block_table, seq_lens, page_size: int, dtype: torch.dtype) -> bool:
        return (self.page_size == page_size and self.mask.dtype == dtype
                and block_table.shape == self.block_table.shape and seq_lens.shape == self.seq_lens.shape
                and block_table.device == self.block_table.device
                and torch.equal(block_table, self.block_table) and torch.equal(seq_lens, self.seq_lens))


_last_gather: _DecodeGather | None = None
"""The last decode step's gather: the layers of a step pass the same block_table and seq_lens
(the step's plan), so it is built once a step, not once a layer. Reuse is checked by value (two
``torch.equal`` of a few hundred bytes, 10 µs against the 150 µs of a build), so new or refilled
metadata never runs on a stale gather."""


def _decode_gather(block_table, seq_lens, page_size: int, dtype: torch.dtype) -> _DecodeGather:
    global _last_gather
    held = _last_gather
    if held is not None and held.fits(block_table, seq_lens, page_size, dtype):
        return held
    lens = seq_lens.tolist()
    dev = block_table.device
    lens_t = seq_lens.to(device=dev, dtype=torch.long)
    pos = torch.arange(max(lens, default=0), device=dev)
    valid = pos[None, :] < lens_t[:, None]  # [batch, L]
    at = torch.where(valid, pos[None, :], 0)
    pages = torch.where(lens_t[:, None] > 0, block_table.long().gather(1, at // page_size), 0)
    mask = torch.zeros(len(lens), 1, 1, pos.numel(), dtype=dtype, device=dev).masked_fill_(
        ~valid[:, None, None, :], -math.inf)
    empty = lens_t == 0
    held = _DecodeGather(block_table.clone(), seq_lens.clone(), page_size, lens, pages * page_size + at % page_size,
                         mask, empty if 0 in lens else None)
    _last_gather = held
    return held


def _decode_batched(q, kv_cache, gather: _DecodeGather, sm_scale, kv_lora_rank):
    """All sequences of a decode step in one call of the blocked CPU kernel, in the cache's dtype:
    each sequence's ``H`` query heads are the query rows of one attention head over its keys (the
    shared latent row), padded to the longest sequence (``max(lens)`` keys) and masked. A padded
    key reads the sequence's own first slot (every slot it reads is one it owns: a slot no
    sequence owns may hold anything, NaN included, and a zero weight would not cancel it).
    Returns (out [batch, H, kv_lora_rank] in q.dtype, lse [batch, H] fp32), out 0 and lse
    ``+inf`` for an empty sequence."""
    kv = _read_slots(kv_cache, gather.slots).unsqueeze(1)  # [batch, 1, L, D]
    out, lse = _FLASH(q.unsqueeze(1), kv, kv, 0.0, False, attn_mask=gather.mask, scale=sm_scale)[:2]
    out, lse = out[:, 0, :, :kv_lora_rank], lse[:, 0].float()  # [batch, H, R], [batch, H]
    if gather.empty is not None:
        empty = gather.empty
        out, lse = out.masked_fill(empty[:, None, None], 0.0), lse.masked_fill(empty[:, None], math.inf)
    return out, lse


def mla_decode(q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank, *, out=None, kv_scale=None):
    """One query per sequence over its ``seq_lens[b]`` cached tokens (see :func:`kvtier.ops.mla_decode`):
    q [batch, H, D], seq_lens [batch] int32; returns ``(out [batch, H, kv_lora_rank] in q.dtype,
    lse [batch, H] fp32)``, out 0 and lse ``+inf`` for an empty sequence.

    When q and the cache share a dtype (``kv_scale`` None or 1) and padding to the longest sequence
    stays within ``PAD_FACTOR``, the whole batch is one call of the blocked CPU kernel in that
    dtype (:func:`_decode_batched`: fp32 accumulation, bf16 inputs read as they are, no fp32 copy
    of the context); else sequence by sequence as :func:`mla_extend` (fp32)."""
    if _FLASH is not None and seq_lens.numel() and _reads_native(q, kv_cache, kv_scale):
        gather = _decode_gather(block_table, seq_lens, kv_cache.shape[1], q.dtype)
        lens = gather.lens
        if max(lens) > 0 and len(lens) * max(lens) <= PAD_FACTOR * sum(lens):
            res, lse = _decode_batched(q, kv_cache, gather, sm_scale, kv_lora_rank)
            return (res.contiguous() if out is None else out.copy_(res)), lse
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return mla_extend(q, kv_cache, block_table, cu, seq_lens, sm_scale, kv_lora_rank, out=out, kv_scale=kv_scale)
