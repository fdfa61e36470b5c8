"""Mixture-of-experts ops: noaux_tc routing and the SiLU-gated expert mixture."""

from __future__ import annotations

import torch

from kvtier import reference
from kvtier.ops.checks import FLOAT_DTYPES, check_tensor
from kvtier.ops.dispatch import resolve_backend


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
    """
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
    resolve_backend("moe_route", backend, router_logits.device, router_logits.dtype)
    return reference.moe_route(router_logits, e_score_correction_bias, top_k, n_group, topk_group,
                               routed_scaling_factor, renormalize)


def fused_moe(hidden_states, w13, w2, topk_weights, topk_ids, *, backend="auto"):
    """SiLU-gated mixture of the routed experts of each token.

    Args:
        hidden_states: [num_tokens, hidden_size] fp32/bf16/fp16.
        w13: [num_experts, 2 * intermediate, hidden_size], gate rows then up rows.
        w2: [num_experts, hidden_size, intermediate].
        topk_weights: [num_tokens, top_k] fp32 routing weights.
        topk_ids: [num_tokens, top_k] int32 expert ids in [0, num_experts).

    Returns:
        [num_tokens, hidden_size] in ``hidden_states.dtype``.

    Raises:
        ValueError: misshaped weights or ids out of range.
    """
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
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= num_experts):
        raise ValueError(f"topk_ids must be in [0, {num_experts}), got range "
                         f"[{int(topk_ids.min())}, {int(topk_ids.max())}]")
    resolve_backend("fused_moe", backend, hidden_states.device, hidden_states.dtype)
    return reference.fused_moe(hidden_states, w13, w2, topk_weights, topk_ids)
