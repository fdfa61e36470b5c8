"""MoE references: noaux_tc routing and the SiLU-gated expert mixture.

Routing bytes: ``T*E`` logits read, ``2*T*k`` written; FLOPs ~ ``T*E*log(E)``.
fused_moe bytes: the weights of every hit expert (``3*I*H`` each) + ``2*T*H`` activations;
FLOPs ``6*T*k*H*I``.
"""

import torch
import torch.nn.functional as F


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


def fused_moe(hidden_states, w13, w2, topk_weights, topk_ids):
    """``sum_j topk_weights[t, j] * w2[e] @ (silu(gate_e x) * (up_e x))`` with ``e = topk_ids[t, j]``.

    hidden_states [T, H]; w13 [E, 2*I, H] (gate rows then up rows); w2 [E, H, I]. fp32 math,
    output [T, H] in ``hidden_states.dtype``.
    """
    x = hidden_states.float()
    out = torch.zeros_like(x)
    flat_ids = topk_ids.long()
    for e in torch.unique(flat_ids).tolist():
        token_idx, slot = torch.nonzero(flat_ids == e, as_tuple=True)
        h = x[token_idx]
        gate, up = F.linear(h, w13[e].float()).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e].float())
        out.index_add_(0, token_idx, y * topk_weights[token_idx, slot, None].float())
    return out.to(hidden_states.dtype)
