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


def row_uniforms(temperature: torch.Tensor, generators, device) -> torch.Tensor:
    """One uniform in [0, 1) per row for :func:`sample_from_uniforms` from per-row generators.

    Args:
        temperature: [B]; only rows with ``temperature > 0`` draw (the others get 0, and their
            generators are not advanced).
        generators: B entries, each a ``torch.Generator`` or None (torch's default generator).
            The rows drawing from one generator object take ``torch.rand(k, generator=g)`` in row
            order, so a generator used by a single row gives it its next uniform whatever the
            rest of the batch is (on CPU, ``torch.rand(k)`` equals k successive ``torch.rand(1)``).
        device: where the result lives.

    Returns:
        [B] fp32 on ``device`` (one host read of ``temperature``; one ``torch.rand`` per
        distinct generator of a sampled row).
    """
    out = torch.zeros(len(generators), dtype=torch.float32, device=device)
    groups: dict[int, tuple[torch.Generator | None, list[int]]] = {}
    for row, (gen, sampled) in enumerate(zip(generators, (temperature > 0).tolist())):
        if sampled:
            groups.setdefault(id(gen), (gen, []))[1].append(row)
    for gen, rows in groups.values():
        where = device if gen is None else gen.device
        draws = torch.rand(len(rows), generator=gen, device=where, dtype=torch.float32)
        out[torch.tensor(rows, device=device)] = draws.to(device)
    return out


def is_per_row(generator) -> bool:
    """True for a sequence of per-row generators (not one ``torch.Generator``, not None)."""
    return generator is not None and not isinstance(generator, torch.Generator)


def sample(logits, temperature, top_p, token_bitmask=None, generator=None):
    """Sample one token per row (see ops.sample). Returns [B] int64 token ids.

    One ``torch.Generator`` (or None): ``torch.multinomial`` over the top-p-cut softmax. A
    sequence of per-row generators: :func:`row_uniforms` then :func:`sample_from_uniforms`.
    """
    if is_per_row(generator):
        return _sample_rows_from_uniforms(logits, temperature, top_p,
                                          row_uniforms(temperature, generator, logits.device), token_bitmask)
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


def _sample_rows_from_uniforms(logits, temperature, top_p, uniforms, token_bitmask=None):
    """:func:`sample_from_uniforms` run on the sampled rows only (one host read of
    ``temperature``): greedy rows take the argmax of their allowed logits without the sort and
    cumulative sums over the vocabulary that a sampled row needs. Every row's computation is
    its own, so the tokens equal :func:`sample_from_uniforms` on the whole batch."""
    rows = torch.nonzero(temperature > 0, as_tuple=True)[0]
    if rows.numel() == logits.shape[0]:
        return sample_from_uniforms(logits, temperature, top_p, uniforms, token_bitmask)
    x = logits.float()
    if token_bitmask is not None:
        x = apply_token_bitmask(x, token_bitmask)
    out = x.argmax(dim=-1)
    if rows.numel():
        out[rows] = sample_from_uniforms(x[rows], temperature[rows], top_p[rows], uniforms[rows])
    return out


def sample_from_uniforms(logits, temperature, top_p, uniforms, token_bitmask=None):
    """The inverse-CDF contract of the ``sample`` kernels (``triton_kernels/sampling.py``), one
    uniform per row: greedy rows (``temperature <= 0``) take the argmax of the allowed logits;
    the others keep the allowed tokens whose ``p_j = exp(s_j - max s)`` (``s = logit / temperature``)
    is at least the largest threshold whose kept mass reaches ``top_p`` of the total (ties to it
    all kept), then take the first token in id order whose running kept mass exceeds
    ``uniforms[b]`` times the kept mass (else the last kept token). Reads no device value on the
    host. Returns [B] int64.
    """
    x = logits.float()
    if token_bitmask is not None:
        x = apply_token_bitmask(x, token_bitmask)
    greedy = x.argmax(dim=-1)
    if x.shape[0] == 0 or x.shape[1] == 0:
        return greedy
    sampled = temperature > 0
    s = x / torch.where(sampled, temperature.float(), 1.0)[:, None]
    p = torch.exp(s - s.max(dim=-1, keepdim=True).values)
    sorted_p = p.sort(dim=-1, descending=True).values
    mass = sorted_p.cumsum(-1)
    reach = torch.searchsorted(mass, (top_p.float() * mass[:, -1])[:, None].contiguous())
    thr = sorted_p.gather(1, reach.clamp(max=p.shape[1] - 1))
    thr = torch.where((top_p < 1)[:, None], thr, 0.0)
    kept = torch.where(p >= thr, p, 0.0)
    running = kept.cumsum(-1)
    goal = uniforms.float()[:, None] * running[:, -1:]
    first = (running <= goal).sum(-1)
    last_kept = kept.shape[1] - 1 - torch.argmax((kept.flip(-1) > 0).to(torch.int32), dim=-1)
    token = torch.where(first < kept.shape[1], first, last_kept)
    return torch.where(sampled, token, greedy)
