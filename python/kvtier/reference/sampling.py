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
    greedy = logits.argmax(dim=-1)
    temp = temperature.float().clamp(min=1e-6)[:, None]
    probs = torch.softmax(logits / temp, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each candidate
    sorted_probs = sorted_probs.masked_fill(before >= top_p.float()[:, None], 0.0)
    choice = torch.multinomial(sorted_probs, 1, generator=generator).squeeze(-1)
    sampled = order.gather(1, choice[:, None]).squeeze(-1)
    return torch.where(temperature <= 0, greedy, sampled)
