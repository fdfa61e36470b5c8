"""Paged MLA attention ops (weight-absorbed: one latent KV head shared by all query heads).

Cache layout per layer (DESIGN.md): ``kv_cache [num_pages, page_size, kv_lora_rank + qk_rope_head_dim]``;
row ``[0:kv_lora_rank]`` is the normalised latent ``c_kv``, ``[kv_lora_rank:]`` the rotated rope key.
"""

from __future__ import annotations

import math

import torch
from torch.profiler import record_function

from kvtier import reference
from kvtier.ops.checks import FLOAT_DTYPES, check_out, check_tensor
from kvtier.ops.dispatch import register_backend, resolve_backend

# fp8 e4m3 caches (with a per-tensor kv_scale): e4m3fn (OCP: gfx950, NVIDIA) and e4m3fnuz (gfx942).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
KV_CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES

register_backend("mla_decode", "triton", "hip", "aiter")
register_backend("mla_extend", "triton")


def _check_paged(q, kv_cache, block_table, seq_lens, kv_lora_rank, kv_scale=None):
    check_tensor(q, "q", ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor(kv_cache, "kv_cache", ndim=3, dtypes=KV_CACHE_DTYPES, device=q.device)
    if kv_scale is not None and not (isinstance(kv_scale, (int, float)) and math.isfinite(kv_scale) and kv_scale > 0):
        raise ValueError(f"kv_scale must be a finite float > 0 or None, got {kv_scale!r}")
    dim = kv_cache.shape[-1]
    check_tensor(q, "q", shape=[None, None, dim])
    if not 0 < kv_lora_rank < dim:
        raise ValueError(f"kv_lora_rank must be in (0, {dim}) for kv_cache width {dim}, got {kv_lora_rank}")
    check_tensor(block_table, "block_table", ndim=2, dtypes=[torch.int32], device=q.device)
    check_tensor(seq_lens, "seq_lens", shape=[block_table.shape[0]], dtypes=[torch.int32], device=q.device)
    page_size = kv_cache.shape[1]
    if seq_lens.numel() and int(seq_lens.max()) > block_table.shape[1] * page_size:
        raise ValueError(f"seq_lens max {int(seq_lens.max())} exceeds block_table capacity "
                         f"{block_table.shape[1]} pages x page_size {page_size}")
    if seq_lens.numel() and int(seq_lens.min()) < 0:
        raise ValueError(f"seq_lens must be >= 0, got min {int(seq_lens.min())}")


# ---------------------------------------------------------------------------------------------
# torch.library ops: the resolved backend is an argument, ``out`` is mutated in place and lse
# returned, so torch.compile traces through one opaque op per call (fake impls give the shapes).


@torch.library.custom_op("kvtier::mla_decode", mutates_args=("out",))
def _mla_decode_op(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                   sm_scale: float, kv_lora_rank: int, kv_scale: float, backend: str, out: torch.Tensor) -> torch.Tensor:
    if backend == "triton":
        from kvtier.ops import _triton_mla

        return _triton_mla.mla_decode(q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank, kv_scale, out)
    if backend == "aiter":
        from kvtier.ops import _aiter

        return _aiter.mla_decode(q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank, kv_scale, out)
    if backend == "hip":
        from kvtier.ops import _native

        return _native.mla_decode(_native.gpu_kernels(), q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank,
                                  kv_scale, out)
    return reference.mla_decode(q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank, out=out,
                                kv_scale=kv_scale)[1]


@_mla_decode_op.register_fake
def _(q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank, kv_scale, backend, out):
    return q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32)


@torch.library.custom_op("kvtier::mla_extend", mutates_args=("out",))
def _mla_extend_op(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   seq_lens: torch.Tensor, sm_scale: float, kv_lora_rank: int, kv_scale: float, max_new_tokens: int,
                   backend: str, out: torch.Tensor) -> torch.Tensor:
    if backend == "triton":
        from kvtier.ops import _triton_mla

        return _triton_mla.mla_extend(q, kv_cache, block_table, cu_seqlens_q, seq_lens, sm_scale, kv_lora_rank,
                                      kv_scale, out, max_new_tokens)
    return reference.mla_extend(q, kv_cache, block_table, cu_seqlens_q, seq_lens, sm_scale, kv_lora_rank, out=out,
                                kv_scale=kv_scale)[1]


@_mla_extend_op.register_fake
def _(q, kv_cache, block_table, cu_seqlens_q, seq_lens, sm_scale, kv_lora_rank, kv_scale, max_new_tokens, backend,
      out):
    return q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32)


def mla_decode(q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank, *, kv_scale=None, out=None,
               backend="auto"):
    """Paged MLA decode: one query token per sequence over its whole cached context.

    Args:
        q: [batch, num_heads, kv_lora_rank + qk_rope_head_dim] fp32/bf16/fp16; weight-absorbed
            query (``q_nope @ W_UK`` then the rotated rope part).
        kv_cache: [num_pages, page_size, kv_lora_rank + qk_rope_head_dim], same device as q;
            fp32/bf16/fp16, or fp8 e4m3 (``float8_e4m3fn``, ``float8_e4m3fnuz``) holding ``kv / kv_scale``.
        block_table: [batch, max_pages] int32 page ids; entries past ``ceil(seq_lens[b] /
            page_size)`` are never read (may hold any value).
        seq_lens: [batch] int32, cached tokens per sequence including the query token (0 allowed).
        sm_scale: softmax scale (pass the model's; K2 with YaRN 32 uses 0.130861, not 576**-0.5).
        kv_lora_rank: latent width; the value vectors are ``kv_cache[..., :kv_lora_rank]``.
        kv_scale: optional per-tensor dequantisation scale (float > 0): keys and values are
            ``kv_cache * kv_scale``; None means 1 (the usual value for non-fp8 caches).
        out: optional [batch, num_heads, kv_lora_rank] tensor of q's dtype to write into.
        backend: "auto" | "torch" | "triton" | "hip" | "aiter".

    Returns:
        (out [batch, num_heads, kv_lora_rank] q.dtype, lse [batch, num_heads] fp32 natural-log
        sum-exp of the scaled scores; ``+inf`` and ``out = 0`` for a zero-length sequence).

    Raises:
        ValueError/TypeError: a misshaped, mistyped or misplaced argument (named in the message).
        BackendUnavailableError: the requested backend is not available, or cannot take these
            inputs (``aiter``: bf16 q and cache, 576-wide rows, at most 128 heads).

    Note:
        ``backend="aiter"`` runs aiter's MLA decode (ROCm) through :mod:`kvtier.ops._aiter`:
        heads padded to 16 or 128 (a one-time ``RuntimeWarning`` says so), pages expanded to
        token indices.
        ``backend="hip"`` (``kvtier._hip``, hip/kernels/mla_decode.hip): (q, kv_cache) dtypes
        (fp32, fp32), (fp16, fp16), (bf16, bf16) or (bf16, fp8 e4m3fn/e4m3fnuz), widths up to
        512 + 64, ``kv_cache.stride(-1) == 1``; a ValueError names anything else.
    """
    with record_function("kvtier::mla_decode"):
        _check_paged(q, kv_cache, block_table, seq_lens, kv_lora_rank, kv_scale)
        check_tensor(q, "q", shape=[block_table.shape[0], None, None])
        check_out(out, "out", (q.shape[0], q.shape[1], kv_lora_rank), q.dtype, q.device)
        resolved = resolve_backend("mla_decode", backend, q.device, q.dtype)
        if resolved == "aiter":
            from kvtier.ops import _aiter

            _aiter.check_mla_decode(q, kv_cache, kv_lora_rank)
        if out is None:
            out = q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)
        lse = torch.ops.kvtier.mla_decode(q, kv_cache, block_table, seq_lens, float(sm_scale), int(kv_lora_rank),
                                          1.0 if kv_scale is None else float(kv_scale), resolved, out)
        return out, lse


def mla_extend(q, kv_cache, block_table, cu_seqlens_q, seq_lens, sm_scale, kv_lora_rank, *, kv_scale=None, out=None,
               backend="auto"):
    """Paged MLA for new tokens already written to the cache (prefill chunks, ragged batch).

    Args:
        q: [total_q, num_heads, kv_lora_rank + qk_rope_head_dim], weight-absorbed queries of all
            sequences, concatenated.
        kv_cache, block_table, sm_scale, kv_lora_rank, kv_scale, out, backend: as in :func:`mla_decode`.
        cu_seqlens_q: [batch + 1] int32 prefix sums of new tokens per sequence.
        seq_lens: [batch] int32 total cached tokens per sequence, new ones included; the new
            tokens are the last ``n_q`` and attend causally (to the prefix and to each other).

    Returns:
        (out [total_q, num_heads, kv_lora_rank] q.dtype, lse [total_q, num_heads] fp32).

    Raises:
        ValueError/TypeError: as in :func:`mla_decode`, or a sequence with more new tokens than
        ``seq_lens`` holds.
    """
    with record_function("kvtier::mla_extend"):
        _check_paged(q, kv_cache, block_table, seq_lens, kv_lora_rank, kv_scale)
        check_tensor(cu_seqlens_q, "cu_seqlens_q", shape=[block_table.shape[0] + 1], dtypes=[torch.int32],
                     device=q.device)
        n_q = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
        if int(cu_seqlens_q[0]) != 0 or int(cu_seqlens_q[-1]) != q.shape[0] or bool((n_q < 0).any()):
            raise ValueError(f"cu_seqlens_q must start at 0, be non-decreasing and end at total_q={q.shape[0]}, "
                             f"got {cu_seqlens_q.tolist()}")
        if bool((n_q > seq_lens).any()):
            raise ValueError("each sequence's new tokens (from cu_seqlens_q) must be <= its seq_lens")
        check_out(out, "out", (q.shape[0], q.shape[1], kv_lora_rank), q.dtype, q.device)
        resolved = resolve_backend("mla_extend", backend, q.device, q.dtype)
        if out is None:
            out = q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)
        max_new_tokens = int(n_q.max()) if n_q.numel() else 0
        lse = torch.ops.kvtier.mla_extend(q, kv_cache, block_table, cu_seqlens_q, seq_lens, float(sm_scale),
                                          int(kv_lora_rank), 1.0 if kv_scale is None else float(kv_scale),
                                          max_new_tokens, resolved, out)
        return out, lse


def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, *, backend="auto"):
    """Write each token's ``[kv_c | k_pe]`` row into the paged cache, in place.

    Args:
        kv_c: [num_tokens, kv_lora_rank] normalised latents.
        k_pe: [num_tokens, qk_rope_head_dim] rotated rope keys.
        kv_cache: [num_pages, page_size, kv_lora_rank + qk_rope_head_dim].
        slot_mapping: [num_tokens] int64 (or int32), ``page_id * page_size + offset``; -1 skips a token.

    Raises:
        ValueError: mismatched widths or token counts, or a slot outside the cache.
    """
    check_tensor(kv_c, "kv_c", ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(kv_cache, "kv_cache", ndim=3, dtypes=FLOAT_DTYPES, device=kv_c.device)
    num_tokens = kv_c.shape[0]
    check_tensor(k_pe, "k_pe", shape=[num_tokens, kv_cache.shape[-1] - kv_c.shape[1]], dtypes=FLOAT_DTYPES,
                 device=kv_c.device)
    check_tensor(slot_mapping, "slot_mapping", shape=[num_tokens], dtypes=[torch.int64, torch.int32],
                 device=kv_c.device)
    num_slots = kv_cache.shape[0] * kv_cache.shape[1]
    if num_tokens and (int(slot_mapping.max()) >= num_slots or int(slot_mapping.min()) < -1):
        raise ValueError(f"slot_mapping entries must be -1 or in [0, {num_slots}), got range "
                         f"[{int(slot_mapping.min())}, {int(slot_mapping.max())}]")
    resolve_backend("concat_and_cache_mla", backend, kv_c.device, kv_c.dtype)
    with record_function("kvtier::concat_and_cache_mla"):
        reference.concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping)
