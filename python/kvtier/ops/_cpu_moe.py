"""The expert mixture on the CPU: the reference's fp32 math (:func:`kvtier.reference.fused_moe`)
with the (token, choice) pairs sorted by expert, the CPU kernel of :func:`kvtier.ops.fused_moe`.

The reference finds each hit expert's tokens with a mask and a ``nonzero`` and gathers and
scatters per expert; at decode sizes (a few tokens per expert) those per-expert ops cost more than
the products. Here the pairs are sorted by expert once (one ``argsort`` and one ``bincount``, the
only host read), the tokens gathered once in fp32, and each hit expert runs its two fp32 GEMMs on a
contiguous run of rows; one ``index_add_`` sums the weighted products. The arithmetic is the
reference's (fp32 GEMMs on the weights upcast per expert, the gated activation in fp32, the sum in
fp32, one rounding to ``hidden_states.dtype``); only the order of the per-token sum may differ.
Measured with torch 2.13 on one core of the 2-core CPU machine, both alternated in one process
(16 experts, top 4, hidden 256, inter 128, bf16 weights; docs/benchmarks.md): 1.1 against 1.7 ms
a call at 8 tokens, 6.2 against 7.6 ms at 384.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvtier.reference.activation import gated_act


def fused_moe(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu", situ_beta: float = 1.0,
              situ_linear_beta: float | None = None) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * w2[e] @ act(gate_e x, up_e x)`` with ``e = topk_ids[t, j]``.

    hidden_states [T, H] float; w13 [E, 2*I, H] (gate rows then up rows); w2 [E, H, I];
    topk_weights [T, k] float; topk_ids [T, k] int in ``[0, E)`` (checked by the caller,
    :func:`kvtier.ops.fused_moe`). Returns [T, H] in ``hidden_states.dtype``. An expert no token
    chose is never read.
    """
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, hidden_states.shape[1], dtype=torch.float32, device=hidden_states.device)
    if num_tokens == 0:
        return out.to(hidden_states.dtype)
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    token = order // top_k
    x = hidden_states[token].float()  # [pairs, H], grouped by expert
    y = torch.empty_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = slice(start, start + n)
        gate, up = F.linear(x[rows], w13[e].float()).chunk(2, dim=-1)
        y[rows] = F.linear(gated_act(gate, up, activation, situ_beta, situ_linear_beta), w2[e].float())
        start += n
    out.index_add_(0, token, y * topk_weights.reshape(-1)[order, None].float())
    return out.to(hidden_states.dtype)
