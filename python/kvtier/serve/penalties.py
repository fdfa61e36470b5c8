"""Presence and frequency penalties (OpenAI's definition) over a request's generated tokens,
applied to the logits a step samples from."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def apply_penalties(logits: torch.Tensor, rows: Sequence[tuple[Sequence[int], float, float]]) -> torch.Tensor:
    """``logits[i, t] - presence_i * (count_i[t] > 0) - frequency_i * count_i[t]``, where
    ``count_i[t]`` is how many times token ``t`` occurs in row ``i``'s generated tokens.

    Args:
        logits: [rows, vocab] float; not modified (the logprobs a request asks for are read from
            the model's own distribution, as vLLM reports them by default).
        rows: per row of ``logits``, ``(generated_token_ids, presence_penalty,
            frequency_penalty)``; ids in ``[0, vocab)``, penalties finite (checked by
            :class:`kvtier.serve.params.SamplingParams`, in ``[-2, 2]``).

    Returns:
        ``logits`` itself when no row has a penalty and a generated token; else a penalised
        copy, same shape, dtype and device.

    Raises:
        ValueError: ``rows`` does not have one entry per row of ``logits``.

    Example:
        >>> apply_penalties(torch.zeros(1, 4), [([2, 2, 3], 0.5, 0.25)]).tolist()
        [[0.0, 0.0, -1.0, -0.75]]
    """
    if logits.ndim != 2 or len(rows) != logits.shape[0]:
        raise ValueError(f"rows must have one entry per row of logits [rows, vocab] {tuple(logits.shape)}, "
                         f"got {len(rows)}")
    todo = [(i, ids, p, f) for i, (ids, p, f) in enumerate(rows) if (p or f) and len(ids)]
    if not todo:
        return logits
    out = logits.clone()
    for i, ids, presence, frequency in todo:
        tokens, counts = torch.unique(torch.as_tensor(ids, dtype=torch.int64, device=logits.device),
                                      return_counts=True)
        out[i, tokens] -= (presence + frequency * counts).to(out.dtype)
    return out
