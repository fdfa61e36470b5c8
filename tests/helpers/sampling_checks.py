"""The sampler tests' frequency check and packed token bitmask."""

from __future__ import annotations

import math

import torch


def _assert_frequencies(tokens, probs, n):
    """Each token's count is Binomial(n, p), so its frequency has std sqrt(p(1-p)/n) (<= 0.0036 for
    n = 20000). We allow 5 std per token plus 1e-3 slack: a correct sampler fails one token with
    probability ~6e-7, all four together < 3e-6, while a wrong temperature (e.g. T vs 1/T) or a
    wrong top-p renormalisation moves some frequency by > 0.05, i.e. > 14 std."""
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    freq = counts / n
    for tok, p in enumerate(probs.tolist()):
        bound = 5.0 * math.sqrt(p * (1.0 - p) / n) + 1e-3
        assert abs(freq[tok].item() - p) <= bound, (
            f"token {tok}: empirical {freq[tok].item():.4f} vs expected {p:.4f} (bound {bound:.4f}); "
            f"all freqs {freq.tolist()}")


def _pack_bitmask(allowed: list[int], vocab: int) -> torch.Tensor:
    """[ceil(vocab / 32)] int32, bit j % 32 of word j // 32 set for each allowed token (two's complement)."""
    words = [0] * ((vocab + 31) // 32)
    for tok in allowed:
        words[tok // 32] |= 1 << (tok % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)
