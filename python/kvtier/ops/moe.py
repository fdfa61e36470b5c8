"""Mixture-of-experts ops: noaux_tc routing and the gated (SiLU or SiTU) expert mixture."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import torch

from kvtier import reference
from kvtier.ops import _cpu_moe
from kvtier.ops.checks import FLOAT_DTYPES, check_tensor
from kvtier.ops.dispatch import (calls_registered_op, device_backend, register_backend, resolve_backend,
                                 triton_interpreting)
from kvtier.reference.activation import ACTIVATIONS

register_backend("moe_route", "triton")
register_backend("fused_moe", "triton", "aiter")
register_backend("moe_align_block_size", "hip")

CONFIG_FILE = Path(importlib.util.find_spec("kvtier.triton_kernels").origin).parent / "configs" / "fused_moe.json"
_INTERPRETER_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1}


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _config_table(path: str = "") -> dict:
    return json.loads(Path(path or CONFIG_FILE).read_text())


def fused_moe_config(num_experts: int, n: int, k: int, dtype: torch.dtype, arch: str, num_tokens: int,
                     table: dict | None = None) -> dict:
    """Tile config of one grouped GEMM from the data file (:data:`CONFIG_FILE`).

    Key ``(E, N, K, dtype, arch)`` (N = weight rows of the projection, K = reduction), then the
    smallest token bucket >= ``num_tokens`` (else the largest); unknown keys use ``"default"``.
    Returns a dict with BLOCK_M/N/K, num_warps, num_stages.
    """
    table = table if table is not None else _config_table()
    key = f"E={num_experts},N={n},K={k},dtype={str(dtype).removeprefix('torch.')},arch={arch}"
    return config_bucket(table["configs"].get(key, table["default"]), num_tokens)


def config_bucket(buckets: dict, num_tokens: int) -> dict:
    """The config of the smallest token bucket >= ``num_tokens`` in ``{"<max tokens>": config}``
    (the largest bucket beyond them); a copy."""
    sizes = sorted(int(m) for m in buckets)
    pick = next((m for m in sizes if m >= num_tokens), sizes[-1])
    return dict(buckets[str(pick)])


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int, *, validate: bool = True,
                         backend: str = "auto"):
    """Sort the (token, choice) pairs by expert and pad each expert's rows to ``block_m``: the row
    layout of the grouped MoE GEMM.

    Args:
        topk_ids: [num_tokens, top_k] int32 expert ids in ``[0, num_experts)``.
        num_experts: E (1 .. 8192 for ``backend="hip"``).
        block_m: rows per tile of the grouped GEMM (>= 1).
        validate: check the id values (one host read); False for ids a router produced.
        backend: "auto" | "torch" | "hip" ("auto" is torch: the torch version needs no host sync).

    Returns:
        sorted_ids [max_padded] int32: flat pair index ``t * top_k + j`` grouped by expert (experts
        in id order, ascending pair order within an expert), ``num_tokens * top_k`` in padding rows,
        with ``max_padded = ceil((num_tokens * top_k + E * (block_m - 1)) / block_m) * block_m``;
        expert_ids [max_padded // block_m] int32: expert of each row block, -1 past the used ones;
        num_padded [1] int32: used length of sorted_ids (a multiple of block_m).

    Raises:
        ValueError/TypeError: a misshaped ``topk_ids``, ids out of range (checked on the host, one
        sync), ``num_experts`` or ``block_m`` < 1.
    """
    check_tensor(topk_ids, "topk_ids", ndim=2, dtypes=[torch.int32])
    if num_experts < 1 or block_m < 1:
        raise ValueError(f"num_experts and block_m must be >= 1, got {num_experts} and {block_m}")
    if validate:
        check_expert_ids(topk_ids, num_experts)
    resolved = resolve_backend("moe_align_block_size", backend, topk_ids.device, topk_ids.dtype)
    with torch.profiler.record_function("kvtier::moe_align_block_size"):
        if resolved == device_backend("moe_align_block_size", topk_ids.device):
            return torch.ops.kvtier.moe_align_block_size(topk_ids, num_experts, block_m)
        return _moe_align_impl(resolved, topk_ids, num_experts, block_m)


def check_expert_ids(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Raise ValueError unless every id is in ``[0, num_experts)`` (one host read of ``topk_ids``)."""
    if topk_ids.numel():
        lo, hi = torch.stack([topk_ids.min(), topk_ids.max()]).tolist()
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"topk_ids must be in [0, {num_experts}), got range [{lo}, {hi}]")


def _moe_align_impl(backend: str, topk_ids, num_experts: int, block_m: int):
    if backend == "hip":
        from kvtier.ops import _native

        lib = _native.gpu_kernels()
        if num_experts > lib.MOE_ALIGN_MAX_EXPERTS:
            raise ValueError(f"backend='hip' needs num_experts <= {lib.MOE_ALIGN_MAX_EXPERTS}, got {num_experts}")
        return _native.moe_align_block_size(lib, topk_ids, num_experts, block_m)
    return reference.moe_align_block_size(topk_ids, num_experts, block_m)


@torch.library.custom_op("kvtier::moe_align_block_size", mutates_args=(), device_types="cpu")
def _moe_align_cpu(topk_ids: torch.Tensor, num_experts: int,
                   block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return reference.moe_align_block_size(topk_ids, num_experts, block_m)


@_moe_align_cpu.register_kernel("cuda")
def _(topk_ids, num_experts, block_m):
    backend = device_backend("moe_align_block_size", topk_ids.device)
    return _moe_align_impl(backend, topk_ids, num_experts, block_m)


@_moe_align_cpu.register_fake
def _(topk_ids, num_experts, block_m):
    max_padded = -(-(topk_ids.numel() + num_experts * (block_m - 1)) // block_m) * block_m
    return (topk_ids.new_empty(max_padded), topk_ids.new_empty(max_padded // block_m), topk_ids.new_empty(1))


def _launch(kernel, grid, *args, **kwargs) -> None:
    from kvtier.ops._triton import launchable

    launchable(kernel, args[0].device)[grid](*args, **kwargs)


def _moe_route_triton(router_logits, e_score_correction_bias, top_k, n_group, topk_group, routed_scaling_factor,
                      renormalize):
    from kvtier.triton_kernels.moe import moe_route_kernel

    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    e_score_correction_bias = e_score_correction_bias.contiguous()
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens:
        _launch(moe_route_kernel, (num_tokens,), router_logits, router_logits.stride(0), e_score_correction_bias,
               weights, ids, num_experts, num_experts // n_group, n_group, topk_group, top_k,
               float(routed_scaling_factor), RENORMALIZE=bool(renormalize), BLOCK_E=_pow2(num_experts),
               BLOCK_G=_pow2(n_group), num_warps=4)
    return weights, ids


def _moe_route_impl(backend, *args):
    return _moe_route_triton(*args) if backend == "triton" else reference.moe_route(*args)


@torch.library.custom_op("kvtier::moe_route", mutates_args=(), device_types="cpu")
def _moe_route_cpu(router_logits: torch.Tensor, e_score_correction_bias: torch.Tensor, top_k: int, n_group: int,
                   topk_group: int, routed_scaling_factor: float,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.moe_route(router_logits, e_score_correction_bias, top_k, n_group, topk_group,
                               routed_scaling_factor, renormalize)


@_moe_route_cpu.register_kernel("cuda")
def _(router_logits, e_score_correction_bias, top_k, n_group, topk_group, routed_scaling_factor, renormalize):
    return _moe_route_impl(device_backend("moe_route", router_logits.device), router_logits, e_score_correction_bias,
                           top_k, n_group, topk_group, routed_scaling_factor, renormalize)


@_moe_route_cpu.register_fake
def _(router_logits, e_score_correction_bias, top_k, n_group, topk_group, routed_scaling_factor, renormalize):
    t = router_logits.shape[0]
    return (router_logits.new_empty(t, top_k, dtype=torch.float32),
            router_logits.new_empty(t, top_k, dtype=torch.int32))


def activation_consts(activation: str, situ_beta: float, situ_linear_beta: float | None) -> dict:
    """The gated-activation arguments of the MoE kernels (``triton_kernels.moe.gated_act``):
    ``ACT`` (0 SiLU, 1 SiTU), ``CLIP_UP`` and the two runtime betas."""
    situ = activation == "situ"
    return {"act_beta": float(situ_beta), "act_linear_beta": float(situ_linear_beta or 1.0),
            "ACT": int(situ), "CLIP_UP": situ and situ_linear_beta is not None}


def check_activation(activation, situ_beta, situ_linear_beta) -> tuple[str, float, float | None]:
    """Check the MoE ops' activation arguments; returns them normalised (floats).

    Raises:
        ValueError: ``activation`` not in :data:`ACTIVATIONS`, or a beta that is not a finite
            positive number (``situ_linear_beta`` may be None).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    for name, value in (("situ_beta", situ_beta), ("situ_linear_beta", situ_linear_beta)):
        if value is None and name == "situ_linear_beta":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < float(value) < float("inf"):
            raise ValueError(f"{name} must be a finite positive number{' or None' if 'linear' in name else ''}, "
                             f"got {value!r}")
    return activation, float(situ_beta), None if situ_linear_beta is None else float(situ_linear_beta)


def _fused_moe_triton(hidden_states, w13, w2, topk_weights, topk_ids, activation="silu", situ_beta=1.0,
                      situ_linear_beta=None):
    from kvtier.triton_kernels.moe import fused_moe_kernel

    if w13.dtype != hidden_states.dtype or w2.dtype != hidden_states.dtype:
        raise ValueError(f"backend='triton' needs w13 and w2 in hidden_states.dtype {hidden_states.dtype}, got "
                         f"{w13.dtype} and {w2.dtype}")
    hidden_states, w13, w2 = hidden_states.contiguous(), w13.contiguous(), w2.contiguous()
    topk_weights, topk_ids = topk_weights.contiguous(), topk_ids.contiguous()
    num_tokens, hidden = hidden_states.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    dev, dtype = hidden_states.device, hidden_states.dtype
    if num_tokens == 0:
        return torch.empty_like(hidden_states)
    interpret = triton_interpreting()
    if interpret:
        cfg1 = cfg2 = dict(_INTERPRETER_CONFIG)
    else:
        from kvtier.ops._triton import arch_of

        arch = arch_of(dev)
        cfg1 = fused_moe_config(num_experts, two_i, hidden, dtype, arch, num_tokens)
        cfg2 = fused_moe_config(num_experts, hidden, inter, dtype, arch, num_tokens)
    block_m = cfg1["BLOCK_M"]
    sorted_ids, expert_ids, num_padded = reference.moe_align_block_size(topk_ids, num_experts, block_m)
    num_pairs = topk_ids.numel()
    act = torch.empty(num_pairs, inter, dtype=dtype, device=dev)
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=dev)
    flat_w = topk_weights.reshape(-1).contiguous()
    act_args = activation_consts(activation, situ_beta, situ_linear_beta)
    for cfg, a, w, out, n, k, gated in ((cfg1, hidden_states, w13, act, inter, hidden, True),
                                         (cfg2, act, w2, y, hidden, inter, False)):
        grid = (expert_ids.numel(), -(-n // cfg["BLOCK_N"]))
        _launch(fused_moe_kernel, grid, a, w, out, flat_w, sorted_ids, expert_ids, num_padded, num_pairs, top_k,
               n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0), inter if gated else 0,
               act_args["act_beta"], act_args["act_linear_beta"], ACT=act_args["ACT"], CLIP_UP=act_args["CLIP_UP"],
               GATED=gated, A_PER_TOKEN=gated, UPCAST=interpret, BLOCK_M=block_m,
               BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"],
               num_stages=cfg["num_stages"])
    return y.view(num_tokens, top_k, hidden).sum(1).to(dtype)


def _fused_moe_impl(backend, *args):
    return _fused_moe_triton(*args) if backend == "triton" else reference.fused_moe(*args)


@torch.library.custom_op("kvtier::fused_moe", mutates_args=(), device_types="cpu")
def _fused_moe_cpu(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, activation: str = "silu", situ_beta: float = 1.0,
                   situ_linear_beta: float | None = None) -> torch.Tensor:
    return _cpu_moe.fused_moe(hidden_states, w13, w2, topk_weights, topk_ids, activation, situ_beta,
                              situ_linear_beta)


@_fused_moe_cpu.register_kernel("cuda")
def _(hidden_states, w13, w2, topk_weights, topk_ids, activation="silu", situ_beta=1.0, situ_linear_beta=None):
    return _fused_moe_impl(device_backend("fused_moe", hidden_states.device), hidden_states, w13, w2, topk_weights,
                           topk_ids, activation, situ_beta, situ_linear_beta)


@_fused_moe_cpu.register_fake
def _(hidden_states, w13, w2, topk_weights, topk_ids, activation="silu", situ_beta=1.0, situ_linear_beta=None):
    return torch.empty_like(hidden_states)


def moe_route(router_logits, e_score_correction_bias, top_k, n_group, topk_group, routed_scaling_factor,
              renormalize=True, *, backend="auto"):
    """DeepSeek-V3 ``noaux_tc`` routing (sigmoid scores, group-limited top-k).

    Args:
        router_logits: [num_tokens, num_experts] float (computed in fp32 by the model).
        e_score_correction_bias: [num_experts] fp32, added to the scores for selection only.
        top_k: experts per token (<= ``topk_group * num_experts / n_group``).
        n_group: expert groups; ``num_experts % n_group == 0`` and >= 2 experts per group.
        topk_group: groups kept per token (group score = sum of its two best biased scores).
        routed_scaling_factor: multiplies the final weights (2.827 for K2).
        renormalize: divide the chosen unbiased scores by their sum (``norm_topk_prob``).

    Returns:
        (topk_weights [num_tokens, top_k] fp32, topk_ids [num_tokens, top_k] int32); the order of
        the k choices per token is unspecified.

    Raises:
        ValueError: inconsistent sizes (named in the message).

    Note:
        ``backend="triton"`` breaks ties (equal biased scores, equal group scores) towards the
        lower expert / group id and returns the choices in descending biased-score order.
    """
    with torch.profiler.record_function("kvtier::moe_route"):
        return _moe_route(router_logits, e_score_correction_bias, top_k, n_group, topk_group,
                          routed_scaling_factor, renormalize, backend)


def _moe_route(router_logits, e_score_correction_bias, top_k, n_group, topk_group, routed_scaling_factor,
               renormalize, backend):
    check_tensor(router_logits, "router_logits", ndim=2, dtypes=FLOAT_DTYPES)
    num_experts = router_logits.shape[1]
    check_tensor(e_score_correction_bias, "e_score_correction_bias", shape=[num_experts], dtypes=FLOAT_DTYPES,
                 device=router_logits.device)
    if n_group <= 0 or num_experts % n_group or num_experts // n_group < 2:
        raise ValueError(f"n_group must divide num_experts={num_experts} into groups of >= 2, got {n_group}")
    if not 0 < topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
    if not 0 < top_k <= topk_group * (num_experts // n_group):
        raise ValueError(f"top_k must be in [1, {topk_group * (num_experts // n_group)}], got {top_k}")
    resolved = resolve_backend("moe_route", backend, router_logits.device, router_logits.dtype)
    args = (router_logits, e_score_correction_bias, top_k, n_group, topk_group, float(routed_scaling_factor),
            bool(renormalize))
    if resolved == device_backend("moe_route", router_logits.device):
        kernel = torch.ops.kvtier.moe_route if calls_registered_op(router_logits.device) else reference.moe_route
        return kernel(*args)
    return _moe_route_impl(resolved, *args)


def fused_moe(hidden_states, w13, w2, topk_weights, topk_ids, *, activation="silu", situ_beta=1.0,
              situ_linear_beta=None, validate=True, backend="auto"):
    """Gated mixture of the routed experts of each token (SiLU-GLU, or Kimi K3's SiTU-GLU).

    Args:
        hidden_states: [num_tokens, hidden_size] fp32/bf16/fp16.
        w13: [num_experts, 2 * intermediate, hidden_size], gate rows then up rows.
        w2: [num_experts, hidden_size, intermediate].
        topk_weights: [num_tokens, top_k] fp32 routing weights.
        topk_ids: [num_tokens, top_k] int32 expert ids in [0, num_experts).
        activation: ``"silu"`` (``silu(gate) * up``) or ``"situ"`` (SiTU-GLU: ``situ_beta *
            tanh(gate / situ_beta) * sigmoid(gate) * up'``, ``up' = situ_linear_beta * tanh(up /
            situ_linear_beta)`` or ``up`` when it is None; K3: 4.0 and 25.0;
            :mod:`kvtier.reference.activation` names the source).
        situ_beta, situ_linear_beta: SiTU's betas (ignored for SiLU).
        validate: check the id values (one host read); a model passing its router's ids passes
            False (no host synchronisation per layer).

    Returns:
        [num_tokens, hidden_size] in ``hidden_states.dtype``.

    Raises:
        ValueError: misshaped weights, ids out of range, an unknown activation or a bad beta.
        BackendUnavailableError: the backend is not available, or cannot take these inputs
            (``aiter``: bf16 or fp16 activations and weights of one dtype, SiLU only).

    Note:
        ``backend="triton"``: ``moe_align_block_size`` then two grouped-GEMM launches (gate/up with
        the gated activation (SiLU or SiTU) fused, then down weighted by ``topk_weights``); tiles from the data file
        :data:`CONFIG_FILE` keyed by (E, N, K, dtype, arch). The gated activation is stored in
        ``hidden_states.dtype`` between the two (as peers do); the per-choice outputs are fp32 and
        summed over the k choices in fp32, deterministically (no atomics). ``backend="aiter"``:
        aiter's ``fused_moe`` (ROCm) on the same arguments, see :mod:`kvtier.ops._aiter`.
    """
    act = check_activation(activation, situ_beta, situ_linear_beta)
    with torch.profiler.record_function("kvtier::fused_moe"):
        return _fused_moe(hidden_states, w13, w2, topk_weights, topk_ids, validate, backend, act)


def _fused_moe(hidden_states, w13, w2, topk_weights, topk_ids, validate, backend, act):
    check_tensor(hidden_states, "hidden_states", ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, hidden = hidden_states.shape
    dev = hidden_states.device
    check_tensor(w13, "w13", ndim=3, dtypes=FLOAT_DTYPES, device=dev)
    num_experts, two_i, _ = w13.shape
    if two_i % 2:
        raise ValueError(f"w13 dim 1 must be 2 * intermediate (gate rows then up rows), got odd {two_i}")
    check_tensor(w13, "w13", shape=[num_experts, two_i, hidden])
    check_tensor(w2, "w2", shape=[num_experts, hidden, two_i // 2], dtypes=FLOAT_DTYPES, device=dev)
    check_tensor(topk_ids, "topk_ids", ndim=2, dtypes=[torch.int32], device=dev)
    check_tensor(topk_weights, "topk_weights", shape=list(topk_ids.shape), dtypes=[torch.float32], device=dev)
    check_tensor(topk_ids, "topk_ids", shape=[num_tokens, None])
    if validate:
        check_expert_ids(topk_ids, num_experts)
    resolved = resolve_backend("fused_moe", backend, hidden_states.device, hidden_states.dtype)
    if resolved == "aiter":
        from kvtier.ops import _aiter
        from kvtier.ops.dispatch import BackendUnavailableError

        if act[0] != "silu":
            raise BackendUnavailableError(f"backend='aiter' runs fused_moe with activation='silu' only, got {act[0]!r}")
        _aiter.check_fused_moe(hidden_states, w13, w2)
        return _aiter.fused_moe(hidden_states, w13, w2, topk_weights, topk_ids)
    if resolved == device_backend("fused_moe", dev):
        kernel = torch.ops.kvtier.fused_moe if calls_registered_op(dev) else _cpu_moe.fused_moe
        return kernel(hidden_states, w13, w2, topk_weights, topk_ids, *act)
    return _fused_moe_impl(resolved, hidden_states, w13, w2, topk_weights, topk_ids, *act)
