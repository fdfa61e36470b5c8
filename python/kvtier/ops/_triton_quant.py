"""Launchers of the quantized-weight Triton GEMMs (:mod:`kvtier.triton_kernels.quant_gemm`).

Called by :mod:`kvtier.ops.quant` after its checks; each allocates and launches, nothing else.
Tiles come from the data file :data:`CONFIG_FILE` (sections ``w4a16`` and ``fp8_block``, keyed by
(E, N, K, arch), then a token bucket; E = 1 for a dense linear), or a small fixed tile under the
interpreter. The MoE launchers follow :func:`kvtier.ops.moe._fused_moe_triton`: the
``moe_align_block_size`` row layout, gate/up GEMM with SiLU gating into an activation buffer in
``hidden_states.dtype``, down GEMM weighted by ``topk_weights`` into fp32 per-choice rows, then
a deterministic fp32 sum over the k choices.
"""

from __future__ import annotations

import functools
import json

import torch

from kvtier import reference
from kvtier.ops.dispatch import BackendUnavailableError, triton_interpreting
from kvtier.ops.moe import CONFIG_FILE as _MOE_CONFIG_FILE
from kvtier.ops.moe import config_bucket
from kvtier.reference.quant import fp8_max

CONFIG_FILE = _MOE_CONFIG_FILE.parent / "quant_gemm.json"
_INTERPRETER_TILE = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}


@functools.cache
def _table(section: str) -> dict:
    return json.loads(CONFIG_FILE.read_text())[section]


def quant_gemm_config(section: str, num_experts: int, n: int, k: int, arch: str, num_tokens: int) -> dict:
    """Tile config of one quantized GEMM from :data:`CONFIG_FILE`: ``section`` "w4a16" or
    "fp8_block", key ``E=<num_experts>,N=<n>,K=<k>,arch=<arch>`` (E = 1 for a dense linear; unknown
    keys use the section's ``default``), then the token bucket. Returns BLOCK_M/N/K, num_warps,
    num_stages."""
    table = _table(section)
    return config_bucket(table["configs"].get(f"E={num_experts},N={n},K={k},arch={arch}", table["default"]),
                         num_tokens)


def _config(section: str, num_experts: int, n: int, k: int, device: torch.device, num_tokens: int) -> dict:
    if triton_interpreting() and device.type == "cpu":
        return dict(_INTERPRETER_TILE)
    from kvtier.ops._triton import arch_of

    return quant_gemm_config(section, num_experts, n, k, arch_of(device), num_tokens)


def _launch(kernel, grid, *args, **kwargs) -> None:
    from kvtier.ops._triton import launchable

    launchable(kernel, args[0].device)[grid](*args, **kwargs)


def _check_block_k(block_k: int) -> None:
    if block_k < 16 or block_k & (block_k - 1):
        raise BackendUnavailableError(f"backend='triton' needs block_size[1] a power of two >= 16 (the K tile is "
                                      f"the quantization block), got {block_k}")


def _fp8_consts(weight: torch.Tensor) -> dict:
    return {"FP8_MAX": fp8_max(weight.dtype), "FNUZ": weight.dtype == torch.float8_e4m3fnuz}


def _gemm(kernel, a, w, w_scale, out, bias, cfg, *, rows: int, n: int, k: int, param: int,
          moe=None, gated=False, fp8=False):
    """Launch one dense (``moe`` None) or grouped GEMM: ``moe`` = (topk_weights, sorted_ids, expert_ids,
    num_padded, top_k)."""
    interpret = a.device.type == "cpu"
    dummy = out
    if moe is None:
        topk_weights, sorted_ids, expert_ids, num_padded, top_k = dummy, dummy, dummy, dummy, 1
        grid_m = -(-rows // cfg["BLOCK_M"])
    else:
        topk_weights, sorted_ids, expert_ids, num_padded, top_k = moe
        grid_m = expert_ids.numel()
    gate_offset = w.shape[-2] // 2 if gated else 0
    consts = dict(GROUPED=moe is not None, GATED=gated, A_PER_TOKEN=gated, HAS_BIAS=bias is not None,
                  UPCAST=interpret, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"])
    if fp8:
        consts.update(_fp8_consts(w))
    w3, s3 = (w, w_scale) if w.dim() == 3 else (w[None], w_scale[None])
    grid = (grid_m, -(-n // cfg["BLOCK_N"]))
    _launch(kernel, grid, a, w3, s3, out, bias if bias is not None else dummy, topk_weights, sorted_ids, expert_ids,
            num_padded, rows, top_k, n, k, param, a.stride(0), w3.stride(0), w3.stride(1), s3.stride(0),
            s3.stride(1), out.stride(0), gate_offset, **consts, num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"])


def _out(m, n, out_dtype, device):
    """The output buffer; fp32 under the interpreter for bf16 outputs (its fp32 -> bf16 store
    truncates; compiled kernels round to nearest even, as torch does afterwards: :func:`_finish`)."""
    return torch.empty(m, n, dtype=torch.float32 if _truncates(device, out_dtype) else out_dtype, device=device)


def _truncates(device, dtype) -> bool:
    return device.type == "cpu" and dtype == torch.bfloat16


def _finish(out, out_dtype):
    return out.to(out_dtype)


def linear_w4a16(x, weight_packed, weight_scale, group_size, bias, out_dtype):
    from kvtier.triton_kernels.quant_gemm import w4a16_gemm_kernel

    x, weight_packed, weight_scale = x.contiguous(), weight_packed.contiguous(), weight_scale.contiguous()
    m, k = x.shape
    n = weight_packed.shape[0]
    out = _out(m, n, out_dtype, x.device)
    if m:
        cfg = _config("w4a16", 1, n, k, x.device, m)
        _gemm(w4a16_gemm_kernel, x, weight_packed, weight_scale, out, bias, cfg, rows=m, n=n, k=k,
              param=group_size)
    return _finish(out, out_dtype)


def linear_fp8_block(x, weight, weight_scale_inv, block_size, bias, out_dtype):
    from kvtier.triton_kernels.quant_gemm import fp8_block_gemm_kernel

    _check_block_k(block_size[1])
    x, weight, weight_scale_inv = x.contiguous(), weight.contiguous(), weight_scale_inv.float().contiguous()
    m, k = x.shape
    n = weight.shape[0]
    out = _out(m, n, out_dtype, x.device)
    if m:
        cfg = dict(_config("fp8_block", 1, n, k, x.device, m), BLOCK_K=block_size[1])
        _gemm(fp8_block_gemm_kernel, x, weight, weight_scale_inv, out, bias, cfg, rows=m, n=n, k=k,
              param=block_size[0], fp8=True)
    return _finish(out, out_dtype)


def _moe(kernel, section, hidden_states, w13, s13, w2, s2, topk_weights, topk_ids, param, fp8, block_k=None):
    hidden_states, topk_weights, topk_ids = hidden_states.contiguous(), topk_weights.contiguous(), topk_ids.contiguous()
    w13, s13, w2, s2 = w13.contiguous(), s13.contiguous(), w2.contiguous(), s2.contiguous()
    num_tokens, hidden = hidden_states.shape
    num_experts, two_i = w13.shape[:2]
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    dev, dtype = hidden_states.device, hidden_states.dtype
    if num_tokens == 0:
        return torch.empty_like(hidden_states)
    cfg1 = _config(section, num_experts, two_i, hidden, dev, num_tokens)
    cfg2 = _config(section, num_experts, hidden, inter, dev, num_tokens)
    if block_k is not None:
        cfg1["BLOCK_K"] = cfg2["BLOCK_K"] = block_k
    cfg2["BLOCK_M"] = cfg1["BLOCK_M"]  # one row padding for both GEMMs
    sorted_ids, expert_ids, num_padded = reference.moe_align_block_size(topk_ids, num_experts, cfg1["BLOCK_M"])
    num_pairs = topk_ids.numel()
    # the interpreter's fp32 -> bf16 store truncates (compiled kernels round to nearest even): under
    # it the gated activation is stored in fp32 and rounded by torch, as the GPU rounds it
    truncates = _truncates(dev, dtype)
    act = torch.empty(num_pairs, inter, dtype=torch.float32 if truncates else dtype, device=dev)
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=dev)
    moe = (topk_weights.reshape(-1), sorted_ids, expert_ids, num_padded, top_k)
    _gemm(kernel, hidden_states, w13, s13, act, None, cfg1, rows=num_pairs, n=inter, k=hidden, param=param,
          moe=moe, gated=True, fp8=fp8)
    if truncates:
        act = act.to(dtype)
    _gemm(kernel, act, w2, s2, y, None, cfg2, rows=num_pairs, n=hidden, k=inter, param=param, moe=moe,
          fp8=fp8)
    return y.view(num_tokens, top_k, hidden).sum(1).to(dtype)


def fused_moe_w4a16(hidden_states, w13_packed, w13_scale, w2_packed, w2_scale, topk_weights, topk_ids, group_size):
    from kvtier.triton_kernels.quant_gemm import w4a16_gemm_kernel

    return _moe(w4a16_gemm_kernel, "w4a16", hidden_states, w13_packed, w13_scale, w2_packed, w2_scale, topk_weights,
                topk_ids, group_size, fp8=False)


def fused_moe_fp8_block(hidden_states, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids, block_size):
    from kvtier.triton_kernels.quant_gemm import fp8_block_gemm_kernel

    _check_block_k(block_size[1])
    return _moe(fp8_block_gemm_kernel, "fp8_block", hidden_states, w13, w13_scale_inv.float(), w2,
                w2_scale_inv.float(), topk_weights, topk_ids, block_size[0], fp8=True, block_k=block_size[1])
