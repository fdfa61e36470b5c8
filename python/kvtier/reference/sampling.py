"""Sampling reference: greedy / temperature / top-p with an optional packed token bitmask.

Bytes: ``B*V`` logits read (+ ``B*V/32`` bitmask words); a sort over V per row for top-p.
"""

import torch


def apply_token_bitmask(logits: torch.Tensor, token_bitmask: torch.Tensor) -> torch.Tensor:
    """Set disallowed tokens to -inf. Bit ``j % 32`` of word ``j // 32`` set = token j allowed."""
    vocab = logits.shape[-1]
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((token_bitmask[:, :, None] >> bits) & 1).bool().flatten(1)[:, :vocab]
    return logits.masked_fill(~allowed, float("-inf"))


def sample(logits, temperature, top_p, token_bitmask=None, generator=None):
    """Sample one token per row (see ops.sample). Returns [B] int64 token ids."""
    logits = logits.float()
    if token_bitmask is not None:
        logits = apply_token_bitmask(logits, token_bitmask)
    out = logits.argmax(dim=-1)
    rows = torch.nonzero(temperature > 0, as_tuple=True)[0]
    if rows.numel() == 0:
        return out
    temp = temperature[rows].float()[:, None]
    probs = torch.softmax(logits[rows] / temp, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # Mass strictly above each candidate, accumulated in fp64 so that top_p = 1 keeps every token.
    before = (sorted_probs.double().cumsum(-1) - sorted_probs.double())
    cut = (before >= top_p[rows].double()[:, None]) & (top_p[rows] < 1)[:, None]
    sorted_probs = sorted_probs.masked_fill(cut, 0.0)
    choice = torch.multinomial(sorted_probs, 1, generator=generator).squeeze(-1)
    out[rows] = order.gather(1, choice[:, None]).squeeze(-1)
    return out
