"""Adapters from kvtier's op signatures to AMD aiter's Python API (ROCm only).

aiter is imported only inside the adapters, when ``backend="aiter"`` has been resolved, so this
module imports anywhere. Targeted API: ROCm/aiter tag ``v0.1.20.post1`` (commit de07f3885ee5);
the calls below use keyword arguments only and were checked against the signatures back to
``v0.1.13`` (commit cdcfa833bdf5), the first tag whose non-persistent MLA decode writes the final
lse (earlier tags return an lse buffer the reduce step never fills). The oldest supported version
per op is :data:`MIN_VERSION`; older installations report the backend unavailable.

MLA decode: ``aiter.mla.mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices,
kv_last_page_lens, max_seqlen_q, *, sm_scale, return_lse=True)`` in its non-persistent mode (no
``work_meta_data``: aiter picks the KV split count itself), with

- ``kv_buffer [num_pages * page_size, 1, 1, 576]``: kvtier's cache viewed as pages of one token
  (no copy), with kvtier's page ids expanded to token ids ``page * page_size + slot``. Page size 1
  is the layout every tag's decode takes (the default of aiter's own ``op_tests/test_mla.py``);
  the ``page_size`` argument that v0.1.11 added is left at its default 1, so one code path serves
  every kvtier page size. ``kv_indices`` costs 4 bytes per cached token, against 1152 bytes of
  bf16 cache row;
- ``kv_indptr [batch + 1]`` int32 (prefix sums of the lengths), ``qo_indptr = arange(batch + 1)``
  (one query per sequence), ``kv_last_page_lens = 1``;
- query heads padded with zero rows to 16 or 128, the head counts (gqa ratios, one latent KV
  head) of aiter's non-persistent bf16 decode kernels (``hsa/gfx942|gfx950/mla/mla_asm.csv``);
  K2's 64 heads and a TP8 rank's 8 run as 128 and 16 (the padded heads cost compute, not cache
  reads); a one-time :class:`RuntimeWarning` says so;
- a zero-length sequence is given one in-range dummy token (aiter's reduce divides by the empty
  sum there) and its result is then set to kvtier's convention, ``out = 0``, ``lse = +inf``.

The metadata is a :class:`MlaDecodePlan` (:func:`plan_mla_decode`, then :func:`run_mla_decode`;
``ops.plan_mla_decode(..., backend="aiter")`` builds it once per step into the step's plan, which
``ops.mla_decode_run`` passes to every layer's call; ``ops.mla_decode`` plans on every call). It is
built with device ops from ``block_table`` and ``seq_lens`` (no host sync), so
``kv_indices`` has the static length ``batch * max_pages * page_size`` with only its first
``kv_indptr[-1]`` entries used; aiter reads that length as the total KV only to choose its split
count (a full cache gives the same number as a packed one). The
tests in ``tests/ops/test_aiter.py`` check this conversion on CPU against a stand-in ``aiter``
module that follows the contract above; the real kernels are checked against the torch
reference by ``tests/ops/test_gpu_kernels.py`` on a ROCm GPU with aiter installed.

fused_moe: ``aiter.fused_moe.fused_moe(hidden_states, w1, w2, topk_weight, topk_ids)`` with the
default SiLU activation and no quantisation; aiter's ``w1`` is kvtier's ``w13`` (gate rows then
up rows, as aiter's ``torch_moe`` reference splits it), ``w2`` the same layout; unshuffled
weights (aiter's default path).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import math
import re
import warnings
from dataclasses import dataclass

import torch

from kvtier.ops.checks import BackendUnavailableError

AITER_DISTRIBUTION = "amd-aiter"  # the pip distribution name of ROCm/aiter
MIN_VERSION = {"mla_decode": (0, 1, 13), "fused_moe": (0, 1, 5)}
MLA_HEAD_COUNTS = (16, 128)  # query heads of aiter's non-persistent bf16 MLA decode kernels
MLA_KV_LORA_RANK, MLA_QK_HEAD_DIM = 512, 576  # the row the kernels are built for: 512 latent + 64 rope
MOE_DTYPES = (torch.bfloat16, torch.float16)

_padding_warned: set[tuple[int, int]] = set()


def installed_version() -> str | None:
    """The installed aiter version string (distribution metadata), or None when there is none."""
    try:
        return importlib.metadata.version(AITER_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_problem(op: str) -> str | None:
    """Why the installed aiter is too old (or of unknown version) for ``op``, or None."""
    need = MIN_VERSION.get(op)
    if need is None:
        return None
    want = ".".join(map(str, need))
    found = installed_version()
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", found or "")
    if match is None:
        return (
            f"kvtier's {op} adapter needs {AITER_DISTRIBUTION} >= {want}; cannot read the installed version ({found!r})"
        )
    if tuple(int(g) for g in match.groups()) < need:
        return f"kvtier's {op} adapter needs {AITER_DISTRIBUTION} >= {want}, found {found}"
    return None


def padded_num_heads(num_heads: int) -> int:
    """The head count aiter's MLA decode runs ``num_heads`` query heads as (16 or 128).

    Raises:
        BackendUnavailableError: ``num_heads`` > 128.
    """
    for count in MLA_HEAD_COUNTS:
        if num_heads <= count:
            return count
    raise BackendUnavailableError(
        f"aiter's MLA decode takes at most {MLA_HEAD_COUNTS[-1]} query heads, got {num_heads}"
    )


def token_indices(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int):
    """kvtier's page table as aiter's token-level CSR table (device ops only, no host sync).

    Args:
        block_table: [batch, max_pages] int32 page ids; entries past a sequence's pages are not read.
        seq_lens: [batch] int32 tokens per sequence.
        page_size: tokens per page of the cache.

    Returns:
        (kv_indptr [batch + 1] int32, prefix sums of ``max(seq_lens, 1)``; kv_indices
        [batch * max(max_pages, 1) * page_size] int32, token ids ``page * page_size + slot``, the
        first ``kv_indptr[-1]`` entries used (sequence ``b`` at ``kv_indptr[b]:kv_indptr[b + 1]``)).
        A zero-length sequence gets one dummy token, id 0.
    """
    if block_table.shape[1] == 0:  # only zero-length sequences: room for their dummy tokens
        block_table = block_table.new_zeros(block_table.shape[0], 1)
    batch, max_pages = block_table.shape
    dev = block_table.device
    capacity = max_pages * page_size
    lens = seq_lens.clamp(min=1)
    kv_indptr = torch.zeros(batch + 1, dtype=torch.int32, device=dev)
    kv_indptr[1:] = lens.cumsum(0)
    pos = torch.arange(capacity, dtype=torch.int32, device=dev)
    # page ids read only where a token is (unused entries may hold any value), then token ids
    pages = torch.where(pos < seq_lens[:, None], block_table[:, pos // page_size], 0)
    tokens = pages * page_size + pos % page_size  # [batch, capacity]; the dummy token is 0 * page_size + 0
    dump = batch * capacity  # destination of the slots past each sequence, cut off below
    dest = torch.where(pos < lens[:, None], kv_indptr[:-1, None].long() + pos, dump)
    kv_indices = torch.zeros(dump + 1, dtype=torch.int32, device=dev)
    kv_indices.scatter_(0, dest.flatten(), tokens.flatten())
    return kv_indptr, kv_indices[:dump]


@dataclass(frozen=True)
class MlaDecodePlan:
    """aiter's metadata for one decode step (built once, read by every layer's call).

    Attributes:
        page_size: tokens per page of the kvtier cache the plan was built for.
        qo_indptr: [batch + 1] int32, ``arange``: one query per sequence.
        kv_indptr, kv_indices: the token-level table of :func:`token_indices`.
        kv_last_page_lens: [batch] int32 ones (pages of one token).
        empty: [batch, 1] bool, the zero-length sequences.
    """

    page_size: int
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_lens: torch.Tensor
    empty: torch.Tensor


def plan_mla_decode(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> MlaDecodePlan:
    """The :class:`MlaDecodePlan` of ``block_table`` [batch, max_pages] int32 and ``seq_lens``
    [batch] int32 over a cache of ``page_size``-token pages (device ops, no host sync)."""
    batch, dev = block_table.shape[0], block_table.device
    kv_indptr, kv_indices = token_indices(block_table, seq_lens, page_size)
    return MlaDecodePlan(
        page_size,
        torch.arange(batch + 1, dtype=torch.int32, device=dev),
        kv_indptr,
        kv_indices,
        torch.ones(batch, dtype=torch.int32, device=dev),
        (seq_lens == 0)[:, None],
    )


def check_mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int) -> None:
    """Raise :class:`BackendUnavailableError` when aiter's MLA decode cannot take these inputs.

    aiter's non-persistent kernels take bf16 queries and a bf16 cache of 576-wide rows (512 latent
    + 64 rope, :data:`MLA_QK_HEAD_DIM`), up to 128 query heads, and rows one stride apart (the
    cache's ``[page, slot]`` dims must merge into one without a copy).
    """
    if q.dtype != torch.bfloat16 or kv_cache.dtype != torch.bfloat16:
        raise BackendUnavailableError(
            f"aiter's MLA decode takes bf16 q and a bf16 kv_cache, got q {q.dtype} and kv_cache {kv_cache.dtype}"
        )
    if q.shape[-1] != MLA_QK_HEAD_DIM or kv_lora_rank != MLA_KV_LORA_RANK:
        raise BackendUnavailableError(
            f"aiter's MLA decode takes rows of {MLA_KV_LORA_RANK} latent + "
            f"{MLA_QK_HEAD_DIM - MLA_KV_LORA_RANK} rope, got width {q.shape[-1]} with "
            f"kv_lora_rank {kv_lora_rank}"
        )
    padded_num_heads(q.shape[1])
    if kv_cache.stride(-1) != 1 or kv_cache.stride(0) != kv_cache.shape[1] * kv_cache.stride(1):
        raise BackendUnavailableError(
            f"aiter's MLA decode needs a kv_cache whose rows are one stride apart (unit "
            f"stride inside a row), got strides {tuple(kv_cache.stride())}"
        )
    if kv_cache.shape[0] * kv_cache.shape[1] > torch.iinfo(torch.int32).max:
        raise BackendUnavailableError("aiter's kv_indices are int32: the cache holds more than 2**31 - 1 rows")


def _warn_padding(num_heads: int, padded: int) -> None:
    if num_heads != padded and (num_heads, padded) not in _padding_warned:
        _padding_warned.add((num_heads, padded))
        warnings.warn(
            f"kvtier mla_decode on aiter: {num_heads} query heads padded to {padded} (aiter's MLA decode "
            f"kernels take {' or '.join(map(str, MLA_HEAD_COUNTS))} heads)",
            RuntimeWarning,
            stacklevel=2,
        )


def run_mla_decode(plan: MlaDecodePlan, q, kv_cache, sm_scale, kv_lora_rank, kv_scale, out):
    """Fill ``out`` [B, H, kv_lora_rank] with aiter's MLA decode under ``plan``; return lse [B, H] fp32.

    Arguments as in :func:`kvtier.ops.mla_decode`, checked there and by :func:`check_mla_decode`.
    A ``kv_scale`` != 1 (a bf16 cache holding ``kv / kv_scale``) is applied exactly: scores use
    ``sm_scale * kv_scale`` and ``out`` is multiplied by ``kv_scale``.

    Raises:
        ValueError: ``plan`` was built for another page size or batch.
    """
    batch, num_heads, dim = q.shape
    num_pages, page_size, _ = kv_cache.shape
    if plan.page_size != page_size or plan.empty.shape[0] != batch:
        raise ValueError(
            f"plan is for page_size {plan.page_size} and batch {plan.empty.shape[0]}, got kv_cache "
            f"page_size {page_size} and batch {batch}"
        )
    lse = torch.full((batch, num_heads), math.inf, dtype=torch.float32, device=q.device)
    if batch == 0 or num_heads == 0 or num_pages == 0:  # no cache: every sequence is empty
        out.zero_()
        return lse
    padded = padded_num_heads(num_heads)
    _warn_padding(num_heads, padded)
    if padded == num_heads:
        q_in = q.contiguous()
    else:
        q_in = q.new_zeros(batch, padded, dim)
        q_in[:, :num_heads] = q
    o = q.new_empty(batch, padded, kv_lora_rank)
    mla = importlib.import_module("aiter.mla")
    _, lse_padded = mla.mla_decode_fwd(
        q_in,
        kv_cache.view(num_pages * page_size, 1, 1, dim),
        o,
        plan.qo_indptr,
        plan.kv_indptr,
        plan.kv_indices,
        plan.kv_last_page_lens,
        1,
        sm_scale=float(sm_scale) * float(kv_scale),
        return_lse=True,
    )
    if lse_padded is None:
        raise RuntimeError("aiter.mla.mla_decode_fwd returned no lse although return_lse=True")
    result = o[:, :num_heads] if kv_scale == 1.0 else o[:, :num_heads].float() * kv_scale
    out.copy_(result.masked_fill(plan.empty[..., None], 0))
    return lse.copy_(lse_padded[:, :num_heads].masked_fill(plan.empty, math.inf))


def check_fused_moe(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """Raise :class:`BackendUnavailableError` unless activations and weights share a bf16/fp16 dtype
    (aiter's unquantised fused_moe; its output dtype is bf16 or fp16)."""
    if hidden_states.dtype not in MOE_DTYPES or w13.dtype != hidden_states.dtype or w2.dtype != hidden_states.dtype:
        raise BackendUnavailableError(
            f"aiter's fused_moe takes bf16 or fp16 hidden_states with w13 and w2 of the same "
            f"dtype, got {hidden_states.dtype}, {w13.dtype} and {w2.dtype}"
        )


def fused_moe(hidden_states, w13, w2, topk_weights, topk_ids):
    """aiter's fused_moe on kvtier's arguments (see :func:`kvtier.ops.fused_moe`); [T, hidden] out."""
    if hidden_states.shape[0] == 0:
        return torch.empty_like(hidden_states)
    moe = importlib.import_module("aiter.fused_moe")
    return moe.fused_moe(
        hidden_states.contiguous(), w13.contiguous(), w2.contiguous(), topk_weights.contiguous(), topk_ids.contiguous()
    )
