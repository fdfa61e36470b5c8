"""MoE references: noaux_tc routing and the gated (SiLU or SiTU) expert mixture.

Routing bytes: ``T*E`` logits read, ``2*T*k`` written; FLOPs ~ ``T*E*log(E)``.
fused_moe bytes: the weights of every hit expert (``3*I*H`` each) + ``2*T*H`` activations;
FLOPs ``6*T*k*H*I``.
moe_align_block_size bytes: ``T*k`` ids read, ``max_padded + max_padded / block_m`` int32 written
(times 4); FLOPs: 0.
"""

import torch
import torch.nn.functional as F

from kvtier.reference.activation import gated_act


def moe_route(router_logits, e_score_correction_bias, top_k, n_group, topk_group, routed_scaling_factor,
              renormalize=True):
    """DeepSeek-V3 ``noaux_tc`` routing with sigmoid scores (see ops.moe_route).

    Returns ``(topk_weights fp32 [T, top_k], topk_ids int32 [T, top_k])``; the order of the k
    choices is unspecified (sort by id to compare).
    """
    num_tokens, num_experts = router_logits.shape
    scores = router_logits.float().sigmoid()
    biased = scores + e_score_correction_bias.float()
    per_group = num_experts // n_group
    group_scores = biased.view(num_tokens, n_group, per_group).topk(2, dim=-1).values.sum(-1)
    group_idx = group_scores.topk(topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()
    expert_mask = group_mask[:, :, None].expand(-1, -1, per_group).reshape(num_tokens, num_experts)
    topk_ids = biased.masked_fill(~expert_mask, float("-inf")).topk(top_k, dim=-1).indices
    weights = scores.gather(1, topk_ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, topk_ids.to(torch.int32)


def fused_moe(hidden_states, w13, w2, topk_weights, topk_ids, activation="silu", situ_beta=1.0,
              situ_linear_beta=None):
    """``sum_j topk_weights[t, j] * w2[e] @ act(gate_e x, up_e x)`` with ``e = topk_ids[t, j]``.

    hidden_states [T, H]; w13 [E, 2*I, H] (gate rows then up rows); w2 [E, H, I]. ``act`` is
    ``silu(gate) * up`` (``activation="silu"``) or SiTU-GLU with ``situ_beta`` / ``situ_linear_beta``
    (``"situ"``, :func:`kvtier.reference.activation.gated_act`). fp32 math, output [T, H] in
    ``hidden_states.dtype``.
    """
    x = hidden_states.float()
    out = torch.zeros_like(x)
    flat_ids = topk_ids.long()
    for e in torch.unique(flat_ids).tolist():
        token_idx, slot = torch.nonzero(flat_ids == e, as_tuple=True)
        h = x[token_idx]
        gate, up = F.linear(h, w13[e].float()).chunk(2, dim=-1)
        y = F.linear(gated_act(gate, up, activation, situ_beta, situ_linear_beta), w2[e].float())
        out.index_add_(0, token_idx, y * topk_weights[token_idx, slot, None].float())
    return out.to(hidden_states.dtype)


def moe_align_block_size(topk_ids, num_experts, block_m):
    """The layout of :func:`kvtier.ops.moe_align_block_size` (see there), in torch ops without a host
    sync (no ``bincount``, which reads its input's max): every size derives from the static bound
    ``max_padded``. ``topk_ids`` [T, k] int32 in
    ``[0, num_experts)``; returns ``(sorted_ids, expert_ids, num_padded)``."""
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    max_padded = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.sort(flat, stable=True).indices
    expert_of = flat[order]
    rank = torch.arange(num_pairs, device=dev) - (torch.cumsum(counts, 0) - counts)[expert_of]
    sorted_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=dev)
    sorted_ids[starts[expert_of] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, max_padded, block_m, device=dev)
    expert_ids = torch.searchsorted(ends, block_start, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)
