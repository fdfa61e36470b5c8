"""Quantized-weight ops: INT4-group (W4A16) and FP8-block (W8A8) linears and fused MoE, dequantization.

The kernels read the weights in the layout the checkpoints ship (no repacking); the formats and
the math are in :mod:`kvtier.reference.quant`:

* INT4 group (compressed-tensors ``pack-quantized``, symmetric, ``group_size`` 32 for Kimi K2.x):
  ``weight_packed`` int32 ``[N, K // 8]``, eight K-consecutive signed nibbles per int32, lowest
  nibble first, each holding ``q + 8``; ``weight_scale`` ``[N, K // group_size]`` (bf16, fp16 or
  fp32); ``w = q * scale[n, k // group_size]``.
* FP8 block (DeepSeek-V3 / Kimi K2 base): ``weight`` float8 e4m3 ``[N, K]`` (``float8_e4m3fn``, or
  ``float8_e4m3fnuz`` on gfx942: :func:`fp8_e4m3_dtype`, :func:`fp8_e4m3fn_to_fnuz`),
  ``weight_scale_inv`` fp32 ``[ceil(N / bn), ceil(K / bk)]``; activations quantized per token per
  ``bk`` columns to the weight's fp8 dtype inside the op.

Signatures (every op also takes ``backend="auto"|"torch"|"triton"``; MoE ops take ``validate``)::

    dequantize_int4_group(weight_packed, weight_scale, weight_shape=None, group_size=32) -> fp32 [..., N, K]
    dequantize_fp8_block(weight, weight_scale_inv, block_size=(128, 128)) -> fp32 [..., N, K]
    linear_w4a16(x, weight_packed, weight_scale, group_size=32, bias=None, out_dtype=None) -> [M, N]
    linear_fp8_block(x, weight, weight_scale_inv, block_size=(128, 128), bias=None, out_dtype=None) -> [M, N]
    fused_moe_w4a16(hidden_states, w13_packed, w13_scale, w2_packed, w2_scale, topk_weights, topk_ids,
                    group_size=32, *, validate=True) -> [T, H]
    fused_moe_fp8_block(hidden_states, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids,
                        block_size=(128, 128), *, validate=True) -> [T, H]

The MoE ops follow :func:`kvtier.ops.fused_moe` (w13 = gate rows then up rows, SiLU gating,
``topk_weights`` fp32 and ``topk_ids`` int32 from :func:`kvtier.ops.moe_route`). A checkpoint's
per-expert ``gate_proj`` / ``up_proj`` tensors stack into ``w13`` by concatenating rows: packed
weights and INT4 scales always (packing and groups run along K); FP8 ``weight_scale_inv`` rows
when ``I % bn == 0`` (K2: I = 2048), so that the up rows start on a block boundary.

Registered as ``torch.library`` ops in :mod:`kvtier.ops._quant_library` (no backend in the
schemas).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvtier.ops.checks import FLOAT_DTYPES, check_tensor
from kvtier.ops._quant_library import (
    _linear_fp8_impl,
    _linear_w4a16_impl,
    _moe_fp8_impl,
    _moe_w4a16_impl,
)
from kvtier.ops.dispatch import device_backend, register_backend, resolve_backend
from kvtier.ops.moe import check_expert_ids
from kvtier.reference import quant as ref

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
INT4_PER_INT32 = ref.INT4_PER_INT32

# the ops with a Triton implementation (:mod:`kvtier.ops._triton_quant`)
_TRITON_OPS = ("linear_w4a16", "linear_fp8_block", "fused_moe_w4a16", "fused_moe_fp8_block")
for _op in _TRITON_OPS:
    register_backend(_op, "triton")


# --------------------------------------------------------------------------------------------
# fp8 dtype per arch


def fp8_e4m3_dtype(arch: str) -> torch.dtype:
    """The fp8 e4m3 dtype the matrix cores of ``arch`` take: ``float8_e4m3fnuz`` on gfx942 (MI300),
    ``float8_e4m3fn`` (OCP) elsewhere (gfx950, sm_89+). The Triton name of the same choice is
    :func:`kvtier.triton_kernels.fp8_e4m3_name`. ``arch`` as :func:`kvtier.ops._triton.arch_of` names it."""
    return torch.float8_e4m3fnuz if arch == "gfx942" else torch.float8_e4m3fn


def fp8_e4m3fn_to_fnuz(weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-express an ``float8_e4m3fn`` block-quantized weight in ``float8_e4m3fnuz`` without rounding.

    The same bit pattern means half the value in e4m3fnuz (exponent bias 8 instead of 7), so the bits
    are kept and the scales doubled; the pattern 0x80 (-0 in e4m3fn, NaN in e4m3fnuz) becomes 0.

    Returns (weight ``float8_e4m3fnuz``, same shape; weight_scale_inv * 2 in its dtype).

    Raises:
        ValueError: ``weight`` is not ``float8_e4m3fn``.
    """
    check_tensor(weight, "weight", dtypes=[torch.float8_e4m3fn])
    bits = weight.view(torch.int8)
    bits = torch.where(bits == -128, torch.zeros_like(bits), bits)
    return bits.view(torch.float8_e4m3fnuz), weight_scale_inv * 2


# --------------------------------------------------------------------------------------------
# argument checks (messages name the argument, expected and got)


def _check_int4(packed, scale, name: str, group_size: int, device, lead: Sequence[int | None]) -> tuple[int, int]:
    """Check an INT4-group weight ``{name}_packed`` / ``{name}_scale``; return (N, K)."""
    pname, sname = f"{name}_packed" if name else "weight_packed", f"{name}_scale" if name else "weight_scale"
    check_tensor(packed, pname, ndim=len(lead) + 2, dtypes=[torch.int32], device=device)
    check_tensor(packed, pname, shape=[*lead, None, None])
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    n, k = packed.shape[-2], packed.shape[-1] * INT4_PER_INT32
    if k % group_size:
        raise ValueError(f"group_size={group_size} must divide K = {INT4_PER_INT32} * {pname}.shape[-1] = {k} "
                         f"({pname} of shape {tuple(packed.shape)})")
    check_tensor(scale, sname, shape=[*packed.shape[:-1], k // group_size], dtypes=FLOAT_DTYPES, device=device)
    return n, k


def _check_fp8(weight, scale_inv, name: str, block_size, device, lead: Sequence[int | None],
               dtype=None) -> tuple[int, int]:
    sname = f"{name}_scale_inv"
    check_tensor(weight, name, ndim=len(lead) + 2, dtypes=[dtype] if dtype is not None else FP8_DTYPES,
                 device=device)
    check_tensor(weight, name, shape=[*lead, None, None])
    n, k = weight.shape[-2:]
    bn, bk = block_size
    check_tensor(scale_inv, sname, shape=[*weight.shape[:-2], math.ceil(n / bn), math.ceil(k / bk)],
                 dtypes=FLOAT_DTYPES, device=device)
    return n, k


def _block_size(block_size) -> list[int]:
    if (not isinstance(block_size, (tuple, list)) or len(block_size) != 2
            or not all(isinstance(b, int) and b >= 1 for b in block_size)):
        raise ValueError(f"block_size must be two positive ints (rows, cols), got {block_size!r}")
    return [int(block_size[0]), int(block_size[1])]


def _check_linear_io(x, k: int, n: int, bias, out_dtype, device) -> torch.dtype:
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES, device=device)
    check_tensor(x, "x", shape=[None, k])
    if bias is not None:
        check_tensor(bias, "bias", shape=[n], dtypes=FLOAT_DTYPES, device=device)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be one of {[str(d) for d in FLOAT_DTYPES]}, got {out_dtype}")
    return out_dtype


def _check_routing(hidden_states, topk_weights, topk_ids, num_experts: int, validate: bool) -> None:
    dev = hidden_states.device
    check_tensor(topk_ids, "topk_ids", ndim=2, dtypes=[torch.int32], device=dev)
    check_tensor(topk_weights, "topk_weights", shape=list(topk_ids.shape), dtypes=[torch.float32], device=dev)
    check_tensor(topk_ids, "topk_ids", shape=[hidden_states.shape[0], None])
    if validate:
        check_expert_ids(topk_ids, num_experts)


def _check_w13_rows(two_i: int, name: str) -> int:
    if two_i % 2:
        raise ValueError(f"{name} dim 1 must be 2 * intermediate (gate rows then up rows), got odd {two_i}")
    return two_i // 2


# --------------------------------------------------------------------------------------------
# dispatch


def _dispatch(op: str, backend: str, device, dtype: torch.dtype, impl, *args):
    """Resolve ``backend`` for ``op`` at (``device``, ``dtype``) and run it in a ``kvtier::<op>``
    profiler range: through the registered ``torch.ops.kvtier.<op>`` when the resolved backend is
    the device's default (the op ``torch.compile`` and graph capture see), else ``impl(resolved,
    *args)`` directly. Raises :class:`BackendUnavailableError` as :func:`resolve_backend` does."""
    resolved = resolve_backend(op, backend, device, dtype)
    with torch.profiler.record_function(f"kvtier::{op}"):
        if resolved == device_backend(op, device):
            return getattr(torch.ops.kvtier, op)(*args)
        return impl(resolved, *args)


# --------------------------------------------------------------------------------------------
# public ops


def dequantize_int4_group(weight_packed, weight_scale, weight_shape=None, group_size=32, *, backend="auto"):
    """INT4-group weight -> fp32 (``w[n, k] = q[n, k] * weight_scale[n, k // group_size]``).

    Args:
        weight_packed: [..., N, K // 8] int32, compressed-tensors ``pack-quantized`` nibbles
            (module docstring); leading dims (experts) are kept.
        weight_scale: [..., N, K // group_size] bf16/fp16/fp32.
        weight_shape: None, or the checkpoint's ``weight_shape`` ``(N, K)`` (int tensor or pair),
            checked against ``weight_packed``.
        group_size: K values per scale (32 for Kimi K2.x).
        backend: "auto" | "torch" (the only implementation; the op is a load-time tool).

    Returns:
        [..., N, K] fp32.

    Raises:
        ValueError: wrong dtypes or shapes (named), ``group_size`` not dividing K, ``weight_shape``
            not matching.
    """
    check_tensor(weight_packed, "weight_packed", dtypes=[torch.int32])
    if weight_packed.dim() < 2:
        raise ValueError(f"weight_packed must have >= 2 dims [..., N, K // 8], got shape {tuple(weight_packed.shape)}")
    n, k = _check_int4(weight_packed, weight_scale, "", group_size, weight_packed.device,
                       [None] * (weight_packed.dim() - 2))
    if weight_shape is not None:
        got = tuple(int(v) for v in (weight_shape.tolist() if isinstance(weight_shape, torch.Tensor) else weight_shape))
        if got != (n, k):
            raise ValueError(f"weight_shape must be (N, K) = {(n, k)} for weight_packed of shape "
                             f"{tuple(weight_packed.shape)} (K = 8 * packed columns), got {got}")
    resolve_backend("dequantize_int4_group", backend, weight_packed.device, weight_scale.dtype)
    with torch.profiler.record_function("kvtier::dequantize_int4_group"):
        return torch.ops.kvtier.dequantize_int4_group(weight_packed, weight_scale, group_size)


def dequantize_fp8_block(weight, weight_scale_inv, block_size=(128, 128), *, backend="auto"):
    """FP8-block weight -> fp32 (``w[n, k] = weight[n, k] * weight_scale_inv[n // bn, k // bk]``).

    Args:
        weight: [..., N, K] float8_e4m3fn / float8_e4m3fnuz.
        weight_scale_inv: [..., ceil(N / bn), ceil(K / bk)] fp32 (bf16/fp16 accepted).
        block_size: (bn, bk), the checkpoint's ``weight_block_size`` ((128, 128) for DeepSeek-V3/K2).
        backend: "auto" | "torch" (the only implementation).

    Returns:
        [..., N, K] fp32.

    Raises:
        ValueError: wrong dtypes or shapes (named), a bad ``block_size``.
    """
    bs = _block_size(block_size)
    check_tensor(weight, "weight", dtypes=FP8_DTYPES)
    if weight.dim() < 2:
        raise ValueError(f"weight must have >= 2 dims [..., N, K], got shape {tuple(weight.shape)}")
    _check_fp8(weight, weight_scale_inv, "weight", bs, weight.device, [None] * (weight.dim() - 2))
    resolve_backend("dequantize_fp8_block", backend, weight.device, weight_scale_inv.dtype)
    with torch.profiler.record_function("kvtier::dequantize_fp8_block"):
        return torch.ops.kvtier.dequantize_fp8_block(weight, weight_scale_inv, bs)


def linear_w4a16(x, weight_packed, weight_scale, group_size=32, bias=None, out_dtype=None, *, backend="auto"):
    """``x @ w^T (+ bias)`` with INT4-group weights (W4A16), dequantized inside the kernel.

    Args:
        x: [M, K] fp32/bf16/fp16.
        weight_packed: [N, K // 8] int32 (module docstring).
        weight_scale: [N, K // group_size] bf16/fp16/fp32.
        group_size: K values per scale; must divide K.
        bias: None or [N] float.
        out_dtype: output dtype (default ``x.dtype``).
        backend: "auto" | "torch" | "triton".

    Returns:
        [M, N] in ``out_dtype``; fp32 accumulation.

    Raises:
        ValueError: wrong dtypes/shapes (named), ``group_size`` not dividing K.
        BackendUnavailableError: the backend cannot run here.

    Note:
        ``backend="triton"`` dequantizes each [BLOCK_K, BLOCK_N] weight tile in registers
        (``q * scale`` in fp32, then the dot dtype: ``x.dtype`` on a GPU, fp32 for fp32 ``x``).
    """
    dev = x.device if isinstance(x, torch.Tensor) else None
    n, k = _check_int4(weight_packed, weight_scale, "", group_size, dev, [])
    out_dtype = _check_linear_io(x, k, n, bias, out_dtype, dev)
    return _dispatch("linear_w4a16", backend, dev, x.dtype, _linear_w4a16_impl, x, weight_packed, weight_scale,
                     group_size, bias, out_dtype)


def linear_fp8_block(x, weight, weight_scale_inv, block_size=(128, 128), bias=None, out_dtype=None, *,
                     backend="auto"):
    """W8A8 block-scaled ``x @ w^T (+ bias)`` for the dense and attention projections.

    ``x`` is quantized per token per ``bk`` columns to ``weight.dtype`` (scale = group amax /
    fp8 max, :func:`kvtier.reference.quant.per_token_group_quant_fp8`), each K block's fp8 product
    is scaled by ``x_scale[m] * weight_scale_inv[n // bn, k // bk]`` and accumulated in fp32.

    Args:
        x: [M, K] fp32/bf16/fp16.
        weight: [N, K] float8_e4m3fn / float8_e4m3fnuz.
        weight_scale_inv: [ceil(N / bn), ceil(K / bk)] fp32.
        block_size: (bn, bk) = the checkpoint's ``weight_block_size``.
        bias: None or [N] float.
        out_dtype: output dtype (default ``x.dtype``).
        backend: "auto" | "torch" | "triton".

    Returns:
        [M, N] in ``out_dtype``.

    Raises:
        ValueError: wrong dtypes/shapes (named), a bad ``block_size``.
        BackendUnavailableError: the backend cannot run here or take these inputs (``triton``:
            ``bk`` a power of two >= 16).
    """
    bs = _block_size(block_size)
    dev = x.device if isinstance(x, torch.Tensor) else None
    n, k = _check_fp8(weight, weight_scale_inv, "weight", bs, dev, [])
    out_dtype = _check_linear_io(x, k, n, bias, out_dtype, dev)
    return _dispatch("linear_fp8_block", backend, dev, x.dtype, _linear_fp8_impl, x, weight, weight_scale_inv,
                     tuple(bs), bias, out_dtype)


def fused_moe_w4a16(hidden_states, w13_packed, w13_scale, w2_packed, w2_scale, topk_weights, topk_ids, group_size=32,
                    *, validate=True, backend="auto"):
    """SiLU-gated mixture of the routed experts (:func:`kvtier.ops.fused_moe`) on INT4-group weights.

    Args:
        hidden_states: [T, H] fp32/bf16/fp16.
        w13_packed: [E, 2 * I, H // 8] int32, gate rows then up rows (module docstring layout).
        w13_scale: [E, 2 * I, H // group_size] bf16/fp16/fp32.
        w2_packed: [E, H, I // 8] int32.
        w2_scale: [E, H, I // group_size].
        topk_weights: [T, top_k] fp32.
        topk_ids: [T, top_k] int32 in [0, E).
        group_size: K values per scale (32); must divide H and I.
        validate: check the id values (one host read); False for a router's ids.
        backend: "auto" | "torch" | "triton".

    Returns:
        [T, H] in ``hidden_states.dtype``.

    Raises:
        ValueError: misshaped weights (named), ``group_size`` not dividing H or I, ids out of range.
        BackendUnavailableError: the backend cannot run here.

    Note:
        ``backend="triton"``: as :func:`kvtier.ops.fused_moe` (``moe_align_block_size``, two grouped
        GEMMs, the gated activation stored in ``hidden_states.dtype``, fp32 sums over the k choices)
        with each weight tile unpacked and scaled in registers.
    """
    check_tensor(hidden_states, "hidden_states", ndim=2, dtypes=FLOAT_DTYPES)
    dev = hidden_states.device
    two_i, hidden = _check_int4(w13_packed, w13_scale, "w13", group_size, dev, [None])
    if hidden != hidden_states.shape[1]:
        raise ValueError(f"w13_packed must have shape (E, 2I, H // 8) with H = {hidden_states.shape[1]}, got "
                         f"{tuple(w13_packed.shape)}")
    num_experts, inter = w13_packed.shape[0], _check_w13_rows(two_i, "w13_packed")
    if inter % INT4_PER_INT32:
        raise ValueError(f"intermediate size {inter} (w13_packed dim 1 / 2) must be a multiple of {INT4_PER_INT32} "
                         "for w2_packed's packing")
    n2, k2 = _check_int4(w2_packed, w2_scale, "w2", group_size, dev, [num_experts])
    if (n2, k2) != (hidden, inter):
        raise ValueError(f"w2_packed must have shape ({num_experts}, {hidden}, {inter // INT4_PER_INT32}) = "
                         f"(E, H, I // 8), got {tuple(w2_packed.shape)}")
    _check_routing(hidden_states, topk_weights, topk_ids, num_experts, validate)
    return _dispatch("fused_moe_w4a16", backend, dev, hidden_states.dtype, _moe_w4a16_impl, hidden_states, w13_packed,
                     w13_scale, w2_packed, w2_scale, topk_weights, topk_ids, group_size)


def fused_moe_fp8_block(hidden_states, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids,
                        block_size=(128, 128), *, validate=True, backend="auto"):
    """SiLU-gated mixture of the routed experts on FP8-block weights, W8A8 (activations quantized
    per token per ``bk`` columns inside, as :func:`linear_fp8_block`).

    Args:
        hidden_states: [T, H] fp32/bf16/fp16.
        w13: [E, 2 * I, H] float8_e4m3fn / float8_e4m3fnuz, gate rows then up rows.
        w13_scale_inv: [E, ceil(2 I / bn), ceil(H / bk)] fp32.
        w2: [E, H, I], the dtype of ``w13``.
        w2_scale_inv: [E, ceil(H / bn), ceil(I / bk)] fp32.
        topk_weights: [T, top_k] fp32.
        topk_ids: [T, top_k] int32 in [0, E).
        block_size: (bn, bk) (128, 128).
        validate: check the id values (one host read); False for a router's ids.
        backend: "auto" | "torch" | "triton".

    Returns:
        [T, H] in ``hidden_states.dtype``. The gated activation is rounded to
        ``hidden_states.dtype`` before its quantization (where the kernel stores it).

    Raises:
        ValueError: misshaped weights (named), mixed fp8 dtypes, ids out of range.
        BackendUnavailableError: the backend cannot run here or take these inputs (``triton``:
            ``bk`` a power of two >= 16).
    """
    bs = _block_size(block_size)
    check_tensor(hidden_states, "hidden_states", ndim=2, dtypes=FLOAT_DTYPES)
    dev = hidden_states.device
    two_i, hidden = _check_fp8(w13, w13_scale_inv, "w13", bs, dev, [None])
    check_tensor(w13, "w13", shape=[None, None, hidden_states.shape[1]])
    num_experts, inter = w13.shape[0], _check_w13_rows(two_i, "w13")
    _check_fp8(w2, w2_scale_inv, "w2", bs, dev, [num_experts], dtype=w13.dtype)
    check_tensor(w2, "w2", shape=[num_experts, hidden, inter])
    _check_routing(hidden_states, topk_weights, topk_ids, num_experts, validate)
    return _dispatch("fused_moe_fp8_block", backend, dev, hidden_states.dtype, _moe_fp8_impl, hidden_states, w13,
                     w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids, tuple(bs))
