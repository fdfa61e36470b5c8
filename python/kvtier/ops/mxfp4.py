"""MXFP4 weight ops (Kimi K3's routed experts): dequantization, the W4A16 linear and the fused
(latent) MoE with SiLU or SiTU gating.

Weights in the layout compressed-tensors ``mxfp4-pack-quantized`` checkpoints ship (no
repacking; formats and math in :mod:`kvtier.reference.mxfp4`): ``weight_packed`` uint8
``[N, K // 2]`` (two FP4 E2M1 codes per byte, the even K index in the low nibble),
``weight_scale`` uint8 ``[N, K // 32]`` (E8M0, ``2 ** (s - 127)``); K a multiple of 32.

Signatures (every op also takes ``backend="auto"|"torch"|"triton"``; the MoE takes ``validate``)::

    dequantize_mxfp4(weight_packed, weight_scale) -> fp32 [..., N, K]   (torch only)
    linear_mxfp4(x, weight_packed, weight_scale, bias=None, out_dtype=None) -> [M, N]
    fused_moe_mxfp4(hidden_states, w13_packed, w13_scale, w2_packed, w2_scale, topk_weights, topk_ids, *,
                    activation="silu", situ_beta=1.0, situ_linear_beta=None, validate=True) -> [T, L]

``backend="triton"`` runs one kernel body (:mod:`kvtier.triton_kernels.mxfp4_gemm`) for the
linear and both grouped GEMMs of the MoE: ``tl.dot_scaled`` on gfx950 (bf16 activations), the
E2M1 codes and E8M0 scales decoded in registers elsewhere. Activations are not quantized (W4A16).

Registered ``torch.library`` ops (CPU kernel = the fp32 reference, CUDA kernel = the device
backend; fake implementations for tracing)::

    dequantize_mxfp4(Tensor weight_packed, Tensor weight_scale) -> Tensor
    linear_mxfp4(Tensor x, Tensor weight_packed, Tensor weight_scale, Tensor? bias, ScalarType out_dtype) -> Tensor
    fused_moe_mxfp4(Tensor hidden_states, Tensor w13_packed, Tensor w13_scale, Tensor w2_packed,
                    Tensor w2_scale, Tensor topk_weights, Tensor topk_ids, str activation="silu",
                    float situ_beta=1., float? situ_linear_beta=None) -> Tensor
"""

from __future__ import annotations

import torch

from kvtier.ops.checks import FLOAT_DTYPES, check_tensor
from kvtier.ops.dispatch import device_backend, register_backend, resolve_backend
from kvtier.ops.moe import check_activation
from kvtier.ops.quant import _check_linear_io, _check_routing, _check_w13_rows, _dispatch
from kvtier.reference import mxfp4 as ref

MXFP4_GROUP = ref.MXFP4_GROUP
for _op in ("linear_mxfp4", "fused_moe_mxfp4"):
    register_backend(_op, "triton")


def _check_mxfp4(packed, scale, name: str, device, lead) -> tuple[int, int]:
    """Check an MXFP4 weight ``{name}_packed`` / ``{name}_scale``; return (N, K)."""
    pname = f"{name}_packed" if name else "weight_packed"
    sname = f"{name}_scale" if name else "weight_scale"
    check_tensor(packed, pname, ndim=len(lead) + 2, dtypes=[torch.uint8], device=device)
    check_tensor(packed, pname, shape=[*lead, None, None])
    n, k = packed.shape[-2], packed.shape[-1] * 2
    if k % MXFP4_GROUP:
        raise ValueError(f"{pname} must hold K = 2 * {pname}.shape[-1] a multiple of {MXFP4_GROUP} (one E8M0 scale "
                         f"per {MXFP4_GROUP}), got K = {k} ({pname} of shape {tuple(packed.shape)})")
    check_tensor(scale, sname, shape=[*packed.shape[:-1], k // MXFP4_GROUP], dtypes=[torch.uint8], device=device)
    return n, k


def _triton():
    from kvtier.ops import _triton_mxfp4

    return _triton_mxfp4


def _linear_impl(backend, x, weight_packed, weight_scale, bias, out_dtype):
    if backend == "triton":
        return _triton().linear_mxfp4(x, weight_packed, weight_scale, bias, out_dtype)
    return ref.linear_mxfp4(x, weight_packed, weight_scale, bias, out_dtype)


def _moe_impl(backend, *args):
    return _triton().fused_moe_mxfp4(*args) if backend == "triton" else ref.fused_moe_mxfp4(*args)


# --------------------------------------------------------------------------------------------
# torch.library ops


@torch.library.custom_op("kvtier::dequantize_mxfp4", mutates_args=(), device_types=("cpu", "cuda"))
def _dequantize_op(weight_packed: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    return ref.dequantize_mxfp4(weight_packed, weight_scale)


@_dequantize_op.register_fake
def _(weight_packed, weight_scale):
    return weight_packed.new_empty(*weight_packed.shape[:-1], weight_packed.shape[-1] * 2, dtype=torch.float32)


@torch.library.custom_op("kvtier::linear_mxfp4", mutates_args=(), device_types="cpu")
def _linear_cpu(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
    return ref.linear_mxfp4(x, weight_packed, weight_scale, bias, out_dtype)


@_linear_cpu.register_kernel("cuda")
def _(x, weight_packed, weight_scale, bias, out_dtype):
    return _linear_impl(device_backend("linear_mxfp4", x.device), x, weight_packed, weight_scale, bias, out_dtype)


@_linear_cpu.register_fake
def _(x, weight_packed, weight_scale, bias, out_dtype):
    return x.new_empty(x.shape[0], weight_packed.shape[0], dtype=out_dtype)


@torch.library.custom_op("kvtier::fused_moe_mxfp4", mutates_args=(), device_types="cpu")
def _moe_cpu(hidden_states: torch.Tensor, w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor,
             w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "silu",
             situ_beta: float = 1.0, situ_linear_beta: float | None = None) -> torch.Tensor:
    return ref.fused_moe_mxfp4(hidden_states, w13_packed, w13_scale, w2_packed, w2_scale, topk_weights, topk_ids,
                               activation, situ_beta, situ_linear_beta)


@_moe_cpu.register_kernel("cuda")
def _(hidden_states, w13_packed, w13_scale, w2_packed, w2_scale, topk_weights, topk_ids, activation="silu",
      situ_beta=1.0, situ_linear_beta=None):
    return _moe_impl(device_backend("fused_moe_mxfp4", hidden_states.device), hidden_states, w13_packed, w13_scale,
                     w2_packed, w2_scale, topk_weights, topk_ids, activation, situ_beta, situ_linear_beta)


@_moe_cpu.register_fake
def _(hidden_states, w13_packed, w13_scale, w2_packed, w2_scale, topk_weights, topk_ids, activation="silu",
      situ_beta=1.0, situ_linear_beta=None):
    return torch.empty_like(hidden_states)


# --------------------------------------------------------------------------------------------
# public ops


def dequantize_mxfp4(weight_packed, weight_scale, *, backend="auto"):
    """MXFP4 weight -> fp32 (``w[n, k] = e2m1(code[n, k]) * 2 ** (weight_scale[n, k // 32] - 127)``).

    Args:
        weight_packed: [..., N, K // 2] uint8, two E2M1 codes per byte (module docstring); leading
            dims (experts) are kept.
        weight_scale: [..., N, K // 32] uint8 E8M0 exponents.
        backend: "auto" | "torch" (the only implementation; the op is a load-time tool).

    Returns:
        [..., N, K] fp32 (NaN where a scale is 255).

    Raises:
        ValueError: wrong dtypes or shapes, naming the argument.
    """
    check_tensor(weight_packed, "weight_packed", dtypes=[torch.uint8])
    if weight_packed.dim() < 2:
        raise ValueError(f"weight_packed must have >= 2 dims [..., N, K // 2], got shape {tuple(weight_packed.shape)}")
    _check_mxfp4(weight_packed, weight_scale, "", weight_packed.device, [None] * (weight_packed.dim() - 2))
    resolve_backend("dequantize_mxfp4", backend, weight_packed.device, torch.float32)
    with torch.profiler.record_function("kvtier::dequantize_mxfp4"):
        return torch.ops.kvtier.dequantize_mxfp4(weight_packed, weight_scale)


def linear_mxfp4(x, weight_packed, weight_scale, bias=None, out_dtype=None, *, backend="auto"):
    """``x @ w^T (+ bias)`` with MXFP4 weights (W4A16), dequantized inside the kernel.

    Args:
        x: [M, K] fp32/bf16/fp16.
        weight_packed: [N, K // 2] uint8 (module docstring).
        weight_scale: [N, K // 32] uint8 E8M0.
        bias: None or [N] float.
        out_dtype: output dtype (default ``x.dtype``).
        backend: "auto" | "torch" | "triton".

    Returns:
        [M, N] in ``out_dtype``; fp32 accumulation.

    Raises:
        ValueError: wrong dtypes/shapes (named), K not a multiple of 32.
        BackendUnavailableError: the backend cannot run here.
    """
    dev = x.device if isinstance(x, torch.Tensor) else None
    n, k = _check_mxfp4(weight_packed, weight_scale, "", dev, [])
    out_dtype = _check_linear_io(x, k, n, bias, out_dtype, dev)
    return _dispatch("linear_mxfp4", backend, dev, x.dtype, _linear_impl, x, weight_packed, weight_scale, bias,
                     out_dtype)


def fused_moe_mxfp4(hidden_states, w13_packed, w13_scale, w2_packed, w2_scale, topk_weights, topk_ids, *,
                    activation="silu", situ_beta=1.0, situ_linear_beta=None, validate=True, backend="auto"):
    """Gated mixture of the routed experts (:func:`kvtier.ops.fused_moe`) on MXFP4 weights.

    For a latent MoE (K3) ``hidden_states`` is the latent activations (width L = 3584 for K3) and
    the experts work at that width.

    Args:
        hidden_states: [T, L] fp32/bf16/fp16.
        w13_packed: [E, 2 * I, L // 2] uint8, gate rows then up rows.
        w13_scale: [E, 2 * I, L // 32] uint8.
        w2_packed: [E, L, I // 2] uint8.
        w2_scale: [E, L, I // 32] uint8.
        topk_weights: [T, top_k] fp32.
        topk_ids: [T, top_k] int32 in [0, E).
        activation, situ_beta, situ_linear_beta: as :func:`kvtier.ops.fused_moe` (``"situ"`` with
            4.0 and 25.0 for K3).
        validate: check the id values (one host read); False for a router's ids.
        backend: "auto" | "torch" | "triton".

    Returns:
        [T, L] in ``hidden_states.dtype``.

    Raises:
        ValueError: misshaped weights (named), L or I not a multiple of 32, ids out of range, an
            unknown activation.
        BackendUnavailableError: the backend cannot run here.

    Note:
        ``backend="triton"``: ``moe_align_block_size``, two grouped GEMMs of one kernel body, the
        gated activation stored in ``hidden_states.dtype`` between them, fp32 sums over the k choices.
    """
    act = check_activation(activation, situ_beta, situ_linear_beta)
    check_tensor(hidden_states, "hidden_states", ndim=2, dtypes=FLOAT_DTYPES)
    dev = hidden_states.device
    two_i, hidden = _check_mxfp4(w13_packed, w13_scale, "w13", dev, [None])
    if hidden != hidden_states.shape[1]:
        raise ValueError(f"w13_packed must have shape (E, 2I, L // 2) with L = {hidden_states.shape[1]} "
                         f"(hidden_states.shape[1]), got {tuple(w13_packed.shape)}")
    num_experts, inter = w13_packed.shape[0], _check_w13_rows(two_i, "w13_packed")
    if inter % MXFP4_GROUP:
        raise ValueError(f"intermediate size {inter} (w13_packed dim 1 / 2) must be a multiple of {MXFP4_GROUP} "
                         "(w2's E8M0 groups)")
    n2, k2 = _check_mxfp4(w2_packed, w2_scale, "w2", dev, [num_experts])
    if (n2, k2) != (hidden, inter):
        raise ValueError(f"w2_packed must have shape ({num_experts}, {hidden}, {inter // 2}) = (E, L, I // 2), got "
                         f"{tuple(w2_packed.shape)}")
    _check_routing(hidden_states, topk_weights, topk_ids, num_experts, validate)
    return _dispatch("fused_moe_mxfp4", backend, dev, hidden_states.dtype, _moe_impl, hidden_states, w13_packed,
                     w13_scale, w2_packed, w2_scale, topk_weights, topk_ids, *act)
