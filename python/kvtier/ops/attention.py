"""Paged MLA attention ops (weight-absorbed: one latent KV head shared by all query heads).

Cache layout per layer (docs/architecture.md): ``kv_cache [num_pages, page_size, kv_lora_rank + qk_rope_head_dim]``;
row ``[0:kv_lora_rank]`` is the normalised latent ``c_kv``, ``[kv_lora_rank:]`` the rotated rope key.

Plan once per step, run once per layer (as FlashInfer's ``plan``/``run``):
:func:`plan_mla_decode` / :func:`plan_mla_extend` read the step's ``seq_lens`` (and
``cu_seqlens_q``) on the host once, check them, resolve the backend and choose the split count;
:func:`mla_decode_run` / :func:`mla_extend_run` compare their arguments' shapes with the plan and
launch, reading no device value on the host (no synchronisation, CUDA-graph safe, and
``torch.compile(fullgraph=True)`` traces them). :func:`mla_decode` and :func:`mla_extend` are
plan-then-run in one call. The kernels are the ``torch.ops.kvtier.*`` ops of
:mod:`kvtier.ops._mla_library`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from kvtier.ops import _cpu_mla, _mla_library, split_kv
from kvtier.ops.checks import FLOAT_DTYPES, check_out, check_tensor
from kvtier.ops.dispatch import calls_registered_op, device_backend, register_backend, resolve_backend

# fp8 e4m3 caches (with a per-tensor kv_scale): e4m3fn (OCP: gfx950, NVIDIA) and e4m3fnuz (gfx942).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
KV_CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES

register_backend("mla_decode", "triton", "hip", "aiter")
register_backend("mla_extend", "triton")


@dataclass(frozen=True, eq=False)  # holds tensors: compared by identity
class MLADecodePlan:
    """What one decode step's layers share: metadata, checked once, and the host-side choices.

    Attributes:
        block_table: [batch, max_pages] int32 page ids (entries past a sequence's pages unread).
        seq_lens: [batch] int32 cached tokens per sequence, the query token included.
        page_size: tokens per page of the caches the plan runs on.
        num_heads: query heads.
        kv_lora_rank: latent width of the caches' rows.
        num_pages: the caches' page count the page ids were checked against (None: unchecked).
        max_seq_len: the longest sequence the plan admits (the step's longest, or the bound it
            was planned for); the split count is chosen for it.
        num_splits: key slices per sequence of the split-KV kernels (0: the backend does not split).
        backend: the resolved backend ("torch", "triton", "hip" or "aiter").
        aiter_plan: aiter's token-level page table (``backend="aiter"``, else None), built once here.
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    page_size: int
    num_heads: int
    kv_lora_rank: int
    num_pages: int | None
    max_seq_len: int
    num_splits: int
    backend: str
    aiter_plan: object | None = None

    @property
    def batch(self) -> int:
        return self.block_table.shape[0]


@dataclass(frozen=True, eq=False)  # holds tensors: compared by identity
class MLAExtendPlan:
    """What one extend (prefill-chunk) step's layers share; see :class:`MLADecodePlan`.

    Attributes:
        block_table, seq_lens, page_size, num_heads, kv_lora_rank, num_pages, backend: as there.
        cu_seqlens_q: [batch + 1] int32 prefix sums of new tokens per sequence.
        total_q: ``cu_seqlens_q[-1]``, the query tokens of the step.
        max_new_tokens: the most new tokens of one sequence (the kernel's grid size).
    """

    block_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    page_size: int
    num_heads: int
    kv_lora_rank: int
    num_pages: int | None
    total_q: int
    max_new_tokens: int
    backend: str


def _check_metadata(block_table, seq_lens, page_size, num_heads, kv_lora_rank, num_pages=None,
                    max_seq_len=None) -> int:
    """Check the step's paged metadata (one host read); returns the admitted max length."""
    check_tensor(block_table, "block_table", ndim=2, dtypes=[torch.int32])
    check_tensor(seq_lens, "seq_lens", shape=[block_table.shape[0]], dtypes=[torch.int32], device=block_table.device)
    for name, value in (("page_size", page_size), ("num_heads", num_heads), ("kv_lora_rank", kv_lora_rank)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if num_pages is not None and (not isinstance(num_pages, int) or num_pages < 0):
        raise ValueError(f"num_pages must be an int >= 0 or None, got {num_pages!r}")
    lo = hi = bad = 0
    if seq_lens.numel():
        stats = [seq_lens.min(), seq_lens.max()]
        if num_pages is not None:  # ids of the pages each sequence reads
            used = torch.arange(block_table.shape[1], device=block_table.device) * page_size < seq_lens[:, None]
            stats.append((((block_table < 0) | (block_table >= num_pages)) & used).sum())
        lo, hi, *rest = torch.stack(stats).tolist()
        bad = rest[0] if rest else 0
    capacity = block_table.shape[1] * page_size
    if hi > capacity:
        raise ValueError(f"seq_lens max {hi} exceeds block_table capacity {block_table.shape[1]} pages x page_size "
                         f"{page_size}")
    if lo < 0:
        raise ValueError(f"seq_lens must be >= 0, got min {lo}")
    if bad:
        raise ValueError(f"block_table has {bad} page id(s) outside [0, num_pages={num_pages}) among the pages that "
                         f"seq_lens reads")
    if max_seq_len is None:
        return hi
    if not isinstance(max_seq_len, int) or not hi <= max_seq_len <= capacity:
        raise ValueError(f"max_seq_len must be an int in [seq_lens max {hi}, block_table capacity {capacity}], "
                         f"got {max_seq_len!r}")
    return max_seq_len


def _decode_num_splits(backend: str, batch: int, num_heads: int, max_seq_len: int, device: torch.device) -> int:
    if backend == "triton":
        from kvtier.triton_kernels.mla_decode import DECODE_BLOCK_H

        heads_per_block = DECODE_BLOCK_H
    elif backend == "hip":
        from kvtier.ops import _native

        if device.type != "cuda":
            return 1
        heads_per_block = _native.gpu_kernels().MLA_HEADS_PER_BLOCK
    else:
        return 0
    return split_kv.decode_num_splits(batch, num_heads, max_seq_len, split_kv.num_compute_units(device),
                                      heads_per_block)


def plan_mla_decode(block_table, seq_lens, page_size, num_heads, kv_lora_rank, *, num_pages=None, max_seq_len=None,
                    backend="auto") -> MLADecodePlan:
    """Plan one paged MLA decode step for all layers (host work: one read of ``seq_lens``).

    Args:
        block_table: [batch, max_pages] int32 page ids, on the caches' device.
        seq_lens: [batch] int32, cached tokens per sequence including the query token (0 allowed).
        page_size: tokens per page of the caches (``kv_cache.shape[1]``).
        num_heads: query heads per token.
        kv_lora_rank: latent width (the value vectors are ``kv_cache[..., :kv_lora_rank]``).
        num_pages: optional page count of the caches (``kv_cache.shape[0]``): the page ids each
            sequence reads are checked to lie in ``[0, num_pages)`` and runs on caches with fewer
            pages are refused (a stray id would be a device fault). None skips both.
        max_seq_len: optional bound to plan for instead of the step's longest sequence (a CUDA
            graph captured once replays with any lengths up to it); between ``seq_lens.max()`` and
            the block_table capacity.
        backend: "auto" | "torch" | "triton" | "hip" | "aiter".

    Returns:
        :class:`MLADecodePlan`, holding ``block_table`` and ``seq_lens`` (not copies: a caller that
        refills them in place must keep the values within the plan's checks).

    Raises:
        ValueError/TypeError: misshaped or mistyped metadata, a negative length, a length beyond
            the block_table capacity (or ``max_seq_len``).
        BackendUnavailableError: ``backend`` cannot run on the metadata's device.
    """
    limit = _check_metadata(block_table, seq_lens, page_size, num_heads, kv_lora_rank, num_pages, max_seq_len)
    resolved = resolve_backend("mla_decode", backend, block_table.device, None)
    splits = _decode_num_splits(resolved, block_table.shape[0], num_heads, limit, block_table.device)
    aiter_plan = None
    if resolved == "aiter":
        from kvtier.ops import _aiter

        aiter_plan = _aiter.plan_mla_decode(block_table, seq_lens, page_size)
    return MLADecodePlan(block_table, seq_lens, page_size, num_heads, kv_lora_rank, num_pages, limit, splits,
                         resolved, aiter_plan)


def plan_mla_extend(block_table, cu_seqlens_q, seq_lens, page_size, num_heads, kv_lora_rank, *, num_pages=None,
                    backend="auto") -> MLAExtendPlan:
    """Plan one paged MLA extend step for all layers (host work: one read of the lengths).

    Args:
        block_table, seq_lens, page_size, num_heads, kv_lora_rank, num_pages, backend: as in :func:`plan_mla_decode`
            (``seq_lens`` counts the new tokens too).
        cu_seqlens_q: [batch + 1] int32 prefix sums of new tokens per sequence, from 0.

    Returns:
        :class:`MLAExtendPlan`.

    Raises:
        ValueError/TypeError: as in :func:`plan_mla_decode`; ``cu_seqlens_q`` not starting at 0 or
        decreasing; a sequence with more new tokens than its ``seq_lens``.
    """
    _check_metadata(block_table, seq_lens, page_size, num_heads, kv_lora_rank, num_pages)
    check_tensor(cu_seqlens_q, "cu_seqlens_q", shape=[block_table.shape[0] + 1], dtypes=[torch.int32],
                 device=block_table.device)
    cu = cu_seqlens_q.tolist()
    n_q = [b - a for a, b in zip(cu, cu[1:])]
    if cu[0] != 0 or any(n < 0 for n in n_q):
        raise ValueError(f"cu_seqlens_q must start at 0 and be non-decreasing, got {cu}")
    if any(n > length for n, length in zip(n_q, seq_lens.tolist())):
        raise ValueError("each sequence's new tokens (from cu_seqlens_q) must be <= its seq_lens")
    resolved = resolve_backend("mla_extend", backend, block_table.device, None)
    return MLAExtendPlan(block_table, cu_seqlens_q, seq_lens, page_size, num_heads, kv_lora_rank, num_pages, cu[-1],
                         max(n_q, default=0), resolved)


def _check_run(q, kv_cache, plan, num_q: int, kv_scale, out) -> None:
    """Shapes, dtypes and devices of a run against its plan (no device value is read)."""
    check_tensor(q, "q", ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor(kv_cache, "kv_cache", ndim=3, dtypes=KV_CACHE_DTYPES, device=q.device)
    if kv_scale is not None and not (isinstance(kv_scale, (int, float)) and math.isfinite(kv_scale) and kv_scale > 0):
        raise ValueError(f"kv_scale must be a finite float > 0 or None, got {kv_scale!r}")
    dim = kv_cache.shape[-1]
    check_tensor(q, "q", shape=[num_q, plan.num_heads, dim])
    if not 0 < plan.kv_lora_rank < dim:
        raise ValueError(f"kv_lora_rank must be in (0, {dim}) for kv_cache width {dim}, got {plan.kv_lora_rank}")
    if kv_cache.shape[1] != plan.page_size:
        raise ValueError(f"kv_cache must have the plan's page_size {plan.page_size} (dim 1), got shape "
                         f"{tuple(kv_cache.shape)}")
    if plan.num_pages is not None and kv_cache.shape[0] < plan.num_pages:
        raise ValueError(f"kv_cache must have at least the plan's num_pages {plan.num_pages} pages (dim 0), got "
                         f"shape {tuple(kv_cache.shape)}")
    if q.device != plan.block_table.device:
        raise ValueError(f"q must be on the plan's device {plan.block_table.device}, got {q.device}")
    check_out(out, "out", (num_q, plan.num_heads, plan.kv_lora_rank), q.dtype, q.device)


def mla_decode_run(q, kv_cache, plan: MLADecodePlan, sm_scale, *, kv_scale=None, out=None):
    """One layer's paged MLA decode with a :class:`MLADecodePlan`: no host synchronisation.

    Args:
        q: [plan.batch, plan.num_heads, kv_lora_rank + qk_rope_head_dim], as in :func:`mla_decode`.
        kv_cache: [num_pages, plan.page_size, kv_lora_rank + qk_rope_head_dim], q's device.
        plan: from :func:`plan_mla_decode` for this step.
        sm_scale, kv_scale, out: as in :func:`mla_decode`.

    Returns:
        (out [batch, num_heads, kv_lora_rank] q.dtype, lse [batch, num_heads] fp32).

    Raises:
        ValueError/TypeError: an argument whose shape, dtype or device does not fit the plan (a
            host-side check of metadata, before any launch).
    """
    with record_function("kvtier::mla_decode"):
        _check_run(q, kv_cache, plan, plan.batch, kv_scale, out)
        if out is None:
            out = q.new_empty(q.shape[0], q.shape[1], plan.kv_lora_rank)
        kv_scale = 1.0 if kv_scale is None else float(kv_scale)
        if plan.backend == "aiter":
            from kvtier.ops import _aiter

            _aiter.check_mla_decode(q, kv_cache, plan.kv_lora_rank)
            return out, _aiter.run_mla_decode(plan.aiter_plan, q, kv_cache, float(sm_scale), plan.kv_lora_rank,
                                              kv_scale, out)
        args = (q, kv_cache, plan.block_table, plan.seq_lens, float(sm_scale), plan.kv_lora_rank, kv_scale, out,
                plan.num_splits)
        if plan.backend == device_backend("mla_decode", q.device):
            kernel = torch.ops.kvtier.mla_decode if calls_registered_op(q.device) else _mla_library.decode_cpu
            lse = kernel(*args)
        else:
            lse = _mla_library.decode_impl(plan.backend, *args)
        return out, lse


def mla_extend_run(q, kv_cache, plan: MLAExtendPlan, sm_scale, *, kv_scale=None, out=None):
    """One layer's paged MLA extend with a :class:`MLAExtendPlan`: no host synchronisation.

    Args:
        q: [plan.total_q, plan.num_heads, kv_lora_rank + qk_rope_head_dim].
        kv_cache, sm_scale, kv_scale, out: as in :func:`mla_decode_run`.

    Returns:
        (out [total_q, num_heads, kv_lora_rank] q.dtype, lse [total_q, num_heads] fp32).

    Raises:
        ValueError/TypeError: as in :func:`mla_decode_run`.
    """
    with record_function("kvtier::mla_extend"):
        _check_run(q, kv_cache, plan, plan.total_q, kv_scale, out)
        if out is None:
            out = q.new_empty(q.shape[0], q.shape[1], plan.kv_lora_rank)
        args = (q, kv_cache, plan.block_table, plan.cu_seqlens_q, plan.seq_lens, float(sm_scale), plan.kv_lora_rank,
                1.0 if kv_scale is None else float(kv_scale), plan.max_new_tokens, out)
        if plan.backend == device_backend("mla_extend", q.device):
            kernel = torch.ops.kvtier.mla_extend if calls_registered_op(q.device) else _mla_library.extend_cpu
            lse = kernel(*args)
        else:
            lse = _mla_library.extend_impl(plan.backend, *args)
        return out, lse


def _check_inputs(q, kv_cache, block_table) -> None:
    check_tensor(q, "q", ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor(kv_cache, "kv_cache", ndim=3, dtypes=KV_CACHE_DTYPES, device=q.device)
    check_tensor(block_table, "block_table", ndim=2, dtypes=[torch.int32], device=q.device)


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
            The lengths are read on the host (one synchronisation); per-layer callers plan once per
            step with :func:`plan_mla_decode` and call :func:`mla_decode_run`.
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
    _check_inputs(q, kv_cache, block_table)
    plan = plan_mla_decode(block_table, seq_lens, kv_cache.shape[1], q.shape[1], kv_lora_rank,
                           num_pages=kv_cache.shape[0], backend=backend)
    return mla_decode_run(q, kv_cache, plan, sm_scale, kv_scale=kv_scale, out=out)


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
    _check_inputs(q, kv_cache, block_table)
    plan = plan_mla_extend(block_table, cu_seqlens_q, seq_lens, kv_cache.shape[1], q.shape[1], kv_lora_rank,
                           num_pages=kv_cache.shape[0], backend=backend)
    if plan.total_q != q.shape[0]:
        raise ValueError(f"cu_seqlens_q must end at total_q={q.shape[0]} (q.shape[0]), got {plan.total_q}")
    return mla_extend_run(q, kv_cache, plan, sm_scale, kv_scale=kv_scale, out=out)


def check_slot_mapping(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Raise ValueError unless every entry is -1 or in ``[0, num_slots)`` (one host read)."""
    if slot_mapping.numel():
        lo, hi = torch.stack([slot_mapping.min(), slot_mapping.max()]).tolist()
        if hi >= num_slots or lo < -1:
            raise ValueError(f"slot_mapping entries must be -1 or in [0, {num_slots}), got range [{lo}, {hi}]")


def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, *, validate=True, backend="auto"):
    """Write each token's ``[kv_c | k_pe]`` row into the paged cache, in place (vLLM's
    ``concat_and_cache_mla``; ``torch.ops.kvtier.concat_and_cache_mla``).

    Args:
        kv_c: [num_tokens, kv_lora_rank] normalised latents.
        k_pe: [num_tokens, qk_rope_head_dim] rotated rope keys.
        kv_cache: [num_pages, page_size, kv_lora_rank + qk_rope_head_dim].
        slot_mapping: [num_tokens] int64 (or int32), ``page_id * page_size + offset``; -1 skips a token.
        validate: check the slot values (one host read of ``slot_mapping``); a caller that checked
            the step's slot_mapping once (:func:`check_slot_mapping`) passes False in its layers.
            Shapes, dtypes and devices are always checked.

    Raises:
        ValueError: mismatched widths or token counts, or (``validate``) a slot outside the cache.
    """
    check_tensor(kv_c, "kv_c", ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(kv_cache, "kv_cache", ndim=3, dtypes=FLOAT_DTYPES, device=kv_c.device)
    num_tokens = kv_c.shape[0]
    check_tensor(k_pe, "k_pe", shape=[num_tokens, kv_cache.shape[-1] - kv_c.shape[1]], dtypes=FLOAT_DTYPES,
                 device=kv_c.device)
    check_tensor(slot_mapping, "slot_mapping", shape=[num_tokens], dtypes=[torch.int64, torch.int32],
                 device=kv_c.device)
    if validate:
        check_slot_mapping(slot_mapping, kv_cache.shape[0] * kv_cache.shape[1])
    resolve_backend("concat_and_cache_mla", backend, kv_c.device, kv_c.dtype)
    with record_function("kvtier::concat_and_cache_mla"):
        if calls_registered_op(kv_c.device):
            torch.ops.kvtier.concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping)
        else:
            _cpu_mla.concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping)
