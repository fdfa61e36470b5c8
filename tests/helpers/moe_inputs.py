"""MoE routing inputs and the float64 routing and dense-MoE oracles of the MoE op tests."""

from __future__ import annotations

import math

import torch


def _route_oracle(logits, bias, top_k, n_group, topk_group, scale, renormalize):
    """Per-token loop: sigmoid, + bias, group score = sum of its 2 best biased scores, keep
    ``topk_group`` groups, take the ``top_k`` best biased experts among them; weights are the
    unbiased scores (renormalised) times ``scale``. Returns (weights, ids), sorted by expert id."""
    num_tokens, num_experts = logits.shape
    per_group = num_experts // n_group
    all_ids, all_w = [], []
    for t in range(num_tokens):
        score = [1.0 / (1.0 + math.exp(-float(x))) for x in logits[t].double()]
        biased = [score[e] + float(bias[e]) for e in range(num_experts)]
        group_score = [sum(sorted(biased[g * per_group:(g + 1) * per_group], reverse=True)[:2])
                       for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
        candidates = [e for g in groups for e in range(g * per_group, (g + 1) * per_group)]
        chosen = sorted(sorted(candidates, key=lambda e: -biased[e])[:top_k])
        weights = [score[e] for e in chosen]
        if renormalize:
            total = sum(weights)
            weights = [w / total for w in weights]
        all_ids.append(chosen)
        all_w.append([w * scale for w in weights])
    return torch.tensor(all_w, dtype=torch.float64), torch.tensor(all_ids, dtype=torch.int64)


def _sorted_by_id(weights, ids):
    order = ids.long().argsort(dim=-1)
    return weights.gather(1, order), ids.long().gather(1, order)


def _routing_inputs(num_tokens, num_experts, n_group, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(num_tokens, num_experts, generator=gen) * 2.0).to(dtype)
    # a per-group offset makes group selection matter; some biased scores go negative
    group_shift = torch.randn(n_group, generator=gen).repeat_interleave(num_experts // n_group) * 0.3
    bias = (0.1 * torch.randn(num_experts, generator=gen) + group_shift).float()
    return logits, bias


def _dense_moe(x, w13, w2, topk_weights, topk_ids):
    """float64: out[t] = sum_j w[t, j] * w2[e] @ (silu(gate_e . x[t]) * (up_e . x[t])), e = ids[t, j]."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate = w13[e, :inter] @ x[t]
            up = w13[e, inter:] @ x[t]
            act = gate / (1.0 + torch.exp(-gate)) * up
            out[t] += float(topk_weights[t, j]) * (w2[e] @ act)
    return out
