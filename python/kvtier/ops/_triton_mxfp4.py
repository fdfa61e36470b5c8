"""Launchers of the MXFP4 x bf16 Triton GEMM (:mod:`kvtier.triton_kernels.mxfp4_gemm`).

Called by :mod:`kvtier.ops.mxfp4` after its checks; each allocates and launches, nothing else.
Tiles come from the ``mxfp4`` section of :data:`kvtier.ops._triton_quant.CONFIG_FILE` (keyed by
(E, N, K, arch), then a token bucket), or a small fixed tile under the interpreter. The variant
(``SCALED_DOT``: ``tl.dot_scaled`` on gfx950 for bf16 activations, registers elsewhere) is a pure
function of the architecture and dtype (:func:`use_scaled_dot`). The MoE follows
:func:`kvtier.ops._triton_quant._moe`: ``moe_align_block_size`` rows, gate/up GEMM with the gated
activation into a buffer in ``hidden_states.dtype``, down GEMM weighted by ``topk_weights`` into
fp32 per-choice rows, a deterministic fp32 sum over the k choices.
"""

from __future__ import annotations

import torch

from kvtier import reference
from kvtier.ops._triton_quant import _launch, _truncates, quant_gemm_config
from kvtier.ops.dispatch import triton_interpreting
from kvtier.ops.moe import activation_consts

_INTERPRETER_TILE = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}


def use_scaled_dot(arch: str, dtype: torch.dtype) -> bool:
    """Whether the kernel multiplies with ``tl.dot_scaled`` (gfx950's scaled MFMA, bf16 activations)."""
    from kvtier.triton_kernels.mxfp4_gemm import scaled_dot_arch

    return scaled_dot_arch(arch) and dtype == torch.bfloat16


def _config(num_experts: int, n: int, k: int, device: torch.device, num_tokens: int) -> tuple[dict, bool]:
    if triton_interpreting() and device.type == "cpu":
        return dict(_INTERPRETER_TILE), False
    from kvtier.ops._triton import arch_of

    arch = arch_of(device)
    return quant_gemm_config("mxfp4", num_experts, n, k, arch, num_tokens), arch


def _gemm(a, w, w_scale, out, bias, cfg, scaled_dot, *, rows, n, k, moe=None, gated=False, act=None):
    from kvtier.triton_kernels.mxfp4_gemm import mxfp4_gemm_kernel

    interpret = a.device.type == "cpu"
    dummy = out
    if moe is None:
        topk_weights, sorted_ids, expert_ids, num_padded, top_k = dummy, dummy, dummy, dummy, 1
        grid_m = -(-rows // cfg["BLOCK_M"])
    else:
        topk_weights, sorted_ids, expert_ids, num_padded, top_k = moe
        grid_m = expert_ids.numel()
    act = act or activation_consts("silu", 1.0, None)
    w3, s3 = (w, w_scale) if w.dim() == 3 else (w[None], w_scale[None])
    grid = (grid_m, -(-n // cfg["BLOCK_N"]))
    _launch(mxfp4_gemm_kernel, grid, a, w3, s3, out, bias if bias is not None else dummy, topk_weights, sorted_ids,
            expert_ids, num_padded, rows, top_k, n, k, a.stride(0), w3.stride(0), w3.stride(1), s3.stride(0),
            s3.stride(1), out.stride(0), w.shape[-2] // 2 if gated else 0, act["act_beta"], act["act_linear_beta"],
            GROUPED=moe is not None, GATED=gated, A_PER_TOKEN=gated, HAS_BIAS=bias is not None, ACT=act["ACT"],
            CLIP_UP=act["CLIP_UP"], SCALED_DOT=scaled_dot, UPCAST=interpret and not scaled_dot,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"])


def linear_mxfp4(x, weight_packed, weight_scale, bias, out_dtype, *, scaled_dot=None):
    """``scaled_dot`` None: :func:`use_scaled_dot` of the device (tests force it under the interpreter)."""
    x, weight_packed, weight_scale = x.contiguous(), weight_packed.contiguous(), weight_scale.contiguous()
    m, k = x.shape
    n = weight_packed.shape[0]
    truncates = _truncates(x.device, out_dtype)
    out = torch.empty(m, n, dtype=torch.float32 if truncates else out_dtype, device=x.device)
    if m:
        cfg, arch = _config(1, n, k, x.device, m)
        sd = use_scaled_dot(arch, x.dtype) if scaled_dot is None and arch else bool(scaled_dot)
        _gemm(x, weight_packed, weight_scale, out, bias, cfg, sd, rows=m, n=n, k=k)
    return out.to(out_dtype)


def fused_moe_mxfp4(hidden_states, w13_packed, w13_scale, w2_packed, w2_scale, topk_weights, topk_ids, activation,
                    situ_beta, situ_linear_beta, *, scaled_dot=None):
    hidden_states, topk_weights, topk_ids = hidden_states.contiguous(), topk_weights.contiguous(), topk_ids.contiguous()
    w13, s13, w2, s2 = (t.contiguous() for t in (w13_packed, w13_scale, w2_packed, w2_scale))
    num_tokens, hidden = hidden_states.shape
    num_experts, two_i = w13.shape[:2]
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    dev, dtype = hidden_states.device, hidden_states.dtype
    if num_tokens == 0:
        return torch.empty_like(hidden_states)
    cfg1, arch = _config(num_experts, two_i, hidden, dev, num_tokens)
    cfg2, _ = _config(num_experts, hidden, inter, dev, num_tokens)
    cfg2["BLOCK_M"] = cfg1["BLOCK_M"]  # one row padding for both GEMMs
    sd = use_scaled_dot(arch, dtype) if scaled_dot is None and arch else bool(scaled_dot)
    sorted_ids, expert_ids, num_padded = reference.moe_align_block_size(topk_ids, num_experts, cfg1["BLOCK_M"])
    num_pairs = topk_ids.numel()
    truncates = _truncates(dev, dtype)  # the interpreter's fp32 -> bf16 store truncates: round in torch
    act = torch.empty(num_pairs, inter, dtype=torch.float32 if truncates else dtype, device=dev)
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=dev)
    moe = (topk_weights.reshape(-1), sorted_ids, expert_ids, num_padded, top_k)
    act_args = activation_consts(activation, situ_beta, situ_linear_beta)
    _gemm(hidden_states, w13, s13, act, None, cfg1, sd, rows=num_pairs, n=inter, k=hidden, moe=moe, gated=True,
          act=act_args)
    if truncates:
        act = act.to(dtype)
    _gemm(act, w2, s2, y, None, cfg2, sd, rows=num_pairs, n=hidden, k=inter, moe=moe)
    return y.view(num_tokens, top_k, hidden).sum(1).to(dtype)
