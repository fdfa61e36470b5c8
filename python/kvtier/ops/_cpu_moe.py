"""The expert mixture on the CPU: the reference's fp32 math (:func:`kvtier.reference.fused_moe`)
with the (token, choice) pairs sorted by expert, the CPU kernel of :func:`kvtier.ops.fused_moe`.

The reference finds each hit expert's tokens with a mask and a ``nonzero`` and gathers and
scatters per expert; at decode sizes (a few tokens per expert) those per-expert ops cost more than
the products. Here the pairs are sorted by expert once (one ``argsort`` and one ``bincount``, the
only host read) and the products run in one of two layouts:

* padded (few pairs, a spread choice): every expert's rows padded to the busiest expert's count
  ``m`` (a padding row reads token 0 and is never summed), both products one ``bmm`` each over
  all experts (``[E, m, H] x [E, H, 2I]``, ``[E, m, I] x [E, I, H]``): 2 batched GEMMs instead of
  2 per hit expert. Every expert's weights are read, an unchosen expert's included; its rows are
  padding, so whatever they hold (NaN) never reaches the output;
* sorted (else): each hit expert runs its two fp32 GEMMs on a contiguous run of rows.

Either way one ``index_add_`` sums the weighted products. The arithmetic is the reference's (fp32
GEMMs on the weights upcast, the gated activation in fp32, the sum in fp32, one rounding to
``hidden_states.dtype``); only the order of the per-token sum may differ. fp32 weights are read as
they are (a model on the CPU passes fp32 copies it made once, :class:`kvtier.model.kimi_k2.MoE`);
bf16 ones are upcast per call.

Measured with torch 2.13 on one core of the 2-core CPU machine, in one process (16 experts, top 4,
hidden 256, inter 128, fp32 weights; docs/benchmarks.md): padded against sorted 0.67 against
0.87 ms a call at 8 tokens, 0.90 against 1.30 at 32, 1.68 against 2.29 at 128; at 384 tokens the
padded ``bmm`` is slower (6.5 against 4.3 ms), hence :data:`PADDED_MAX_PAIRS`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvtier.reference.activation import gated_act

PADDED_MAX_PAIRS = 512
"""The padded layout runs for at most this many (token, choice) pairs ..."""
PADDED_MAX_WASTE = 4
"""... and when its ``E * m`` rows are at most this many times the pairs (else the sorted loop)."""


def fused_moe(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu", situ_beta: float = 1.0,
              situ_linear_beta: float | None = None) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * w2[e] @ act(gate_e x, up_e x)`` with ``e = topk_ids[t, j]``.

    hidden_states [T, H] float; w13 [E, 2*I, H] (gate rows then up rows); w2 [E, H, I], fp32 (read
    as they are) or another float dtype (upcast); topk_weights [T, k] float; topk_ids [T, k] int in
    ``[0, E)`` (checked by the caller, :func:`kvtier.ops.fused_moe`). Returns [T, H] in
    ``hidden_states.dtype``. An expert no token chose contributes nothing, whatever its weights hold.
    """
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, hidden_states.shape[1], dtype=torch.float32, device=hidden_states.device)
    if num_tokens == 0:
        return out.to(hidden_states.dtype)
    num_experts = w13.shape[0]
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    token = order // top_k
    act = (activation, situ_beta, situ_linear_beta)
    pairs, busiest = flat.numel(), int(counts.max())
    if pairs <= PADDED_MAX_PAIRS and num_experts * busiest <= PADDED_MAX_WASTE * pairs:
        y = _padded(hidden_states, w13, w2, flat[order], counts, busiest, token, act)
    else:
        y = _sorted(hidden_states[token].float(), w13, w2, counts.tolist(), act)
    out.index_add_(0, token, y * topk_weights.reshape(-1)[order, None].float())
    return out.to(hidden_states.dtype)


def _sorted(x, w13, w2, counts: list[int], act) -> torch.Tensor:
    """x [pairs, H] fp32 grouped by expert (``counts[e]`` rows each) -> [pairs, H] fp32 products."""
    y = torch.empty_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = slice(start, start + n)
        gate, up = F.linear(x[rows], w13[e].float()).chunk(2, dim=-1)
        y[rows] = F.linear(gated_act(gate, up, *act), w2[e].float())
        start += n
    return y


def _padded(hidden_states, w13, w2, experts, counts, busiest: int, token, act) -> torch.Tensor:
    """The sorted pairs (``experts`` [pairs] ascending, ``token`` [pairs]) in ``[E, busiest]`` rows
    per expert, both products one ``bmm``; returns [pairs, H] fp32 in the sorted order."""
    num_experts = w13.shape[0]
    dev = hidden_states.device
    starts = torch.cumsum(counts, 0) - counts
    row = experts * busiest + torch.arange(experts.numel(), device=dev) - starts[experts]  # [pairs] in E * busiest
    source = torch.zeros(num_experts * busiest, dtype=torch.long, device=dev).index_copy_(0, row, token)
    x = hidden_states.index_select(0, source).float().view(num_experts, busiest, -1)
    gate, up = torch.bmm(x, w13.float().transpose(1, 2)).chunk(2, dim=-1)  # [E, busiest, I] each
    y = torch.bmm(gated_act(gate, up, *act), w2.float().transpose(1, 2))  # [E, busiest, H]
    return y.view(num_experts * busiest, -1).index_select(0, row)
