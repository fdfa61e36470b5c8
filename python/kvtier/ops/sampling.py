"""Token sampling op.

``torch.ops.kvtier.sample(logits, temperature, top_p, uniforms, token_bitmask=None)`` samples by
inverse CDF from one uniform per row (CPU: :func:`kvtier.reference.sample_from_uniforms`; GPU:
the Triton kernel). :func:`sample` with ``backend="torch"`` keeps the reference that draws with
``torch.multinomial`` and a generator; given per-row generators (a whole engine step, each
request with its own seed) it draws each row's uniform from its generator and takes the inverse
CDF on every backend.
"""

from __future__ import annotations

import torch

from kvtier import reference
from kvtier.ops.checks import FLOAT_DTYPES, check_tensor
from kvtier.ops.dispatch import device_backend, register_backend, resolve_backend, triton_interpreting

register_backend("sample", "triton")

_BLOCK = 1024  # vocab entries per chunk of the row loop
_INTERPRETER_ROWS = 64  # rows per program under the interpreter (its cost is per op, not per element)


def _launch(kernel, grid, *args, **kwargs) -> None:
    from kvtier.ops._triton import launchable

    launchable(kernel, args[0].device)[grid](*args, **kwargs)


def _sample_triton(logits, temperature, top_p, uniforms, token_bitmask):
    from kvtier.triton_kernels.sampling import sample_kernel

    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    temperature, top_p = temperature.contiguous(), top_p.contiguous()
    token_bitmask = None if token_bitmask is None else token_bitmask.contiguous()
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    has_mask = token_bitmask is not None
    mask = token_bitmask if has_mask else torch.zeros(1, dtype=torch.int32, device=logits.device)
    rows = _INTERPRETER_ROWS if triton_interpreting() else 1
    block = min(_BLOCK, 1 << max(4, (vocab - 1).bit_length()))
    _launch(sample_kernel, (-(-batch // rows),), logits, logits.stride(0), temperature, top_p, uniforms, mask,
           mask.stride(0) if has_mask else 0, out, batch, vocab, HAS_MASK=has_mask, ROWS=rows, BLOCK=block,
           num_warps=8)
    return out


def _sample_impl(backend, *args):
    return _sample_triton(*args) if backend == "triton" else reference.sample_from_uniforms(*args)


@torch.library.custom_op("kvtier::sample", mutates_args=(), device_types="cpu")
def _sample_cpu(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor,
                token_bitmask: torch.Tensor | None = None) -> torch.Tensor:
    return reference.sample_from_uniforms(logits, temperature, top_p, uniforms, token_bitmask)


@_sample_cpu.register_kernel("cuda")
def _(logits, temperature, top_p, uniforms, token_bitmask=None):
    return _sample_impl(device_backend("sample", logits.device), logits, temperature, top_p, uniforms, token_bitmask)


@_sample_cpu.register_fake
def _(logits, temperature, top_p, uniforms, token_bitmask=None):
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


def sample(logits, temperature, top_p, token_bitmask=None, generator=None, *, backend="auto"):
    """Greedy / temperature / top-p sampling with an optional packed allowed-token bitmask.

    Args:
        logits: [batch, vocab] float.
        temperature: [batch] fp32; ``<= 0`` means greedy (argmax).
        top_p: [batch] fp32 in (0, 1]; keeps the smallest set of tokens whose mass reaches top_p.
        token_bitmask: optional [batch, ceil(vocab / 32)] int32; bit ``j % 32`` of word ``j // 32``
            set means token j is allowed (the layout grammar engines produce).
        generator: optional ``torch.Generator`` (on logits' device) for reproducible draws.
            ``backend="torch"`` draws with ``torch.multinomial``; ``backend="triton"`` draws one
            uniform per row with ``torch.rand(batch, generator=generator)`` outside the kernel and
            samples by inverse CDF, so a given generator state gives the same tokens on every run
            (but not the same tokens as the torch backend). A batch of greedy rows only draws
            nothing. Or a sequence of ``batch`` per-row generators (each a ``torch.Generator``
            or None for torch's default one): every row with ``temperature > 0`` takes one
            uniform from its own generator (:func:`kvtier.reference.sampling.row_uniforms`:
            rows sharing a generator draw from it in row order), greedy rows draw nothing, and
            every backend samples by inverse CDF (``backend="torch"``:
            :func:`kvtier.reference.sample_from_uniforms`). So a row whose generator no other row
            uses gets the same token whatever the rest of the batch is, and the same token as a
            one-row call with that generator on the triton backend.
        backend: "auto" | "torch" | "triton". The triton kernel applies temperature, top-p and
            the bitmask in one pass per row; greedy rows equal ``argmax`` of the masked logits
            exactly (ties -> lowest id). With top-p, tokens tied in probability with the last
            kept one are all kept (the torch backend keeps a sort-order prefix of them).

    Returns:
        [batch] int64 token ids; never a token the bitmask disallows (a row whose allowed logits
        are all -inf or NaN is undefined).

    Raises:
        ValueError: misshaped arguments, top_p outside (0, 1], a bitmask row allowing no token, or
            a per-row ``generator`` sequence of the wrong length or holding a non-generator.

    Example:
        >>> sample(torch.tensor([[0.0, 3.0, 1.0]]), torch.zeros(1), torch.ones(1)).tolist()
        [1]
    """
    with torch.profiler.record_function("kvtier::sample"):
        return _sample(logits, temperature, top_p, token_bitmask, generator, backend)


def _sample(logits, temperature, top_p, token_bitmask, generator, backend):
    check_tensor(logits, "logits", ndim=2, dtypes=FLOAT_DTYPES)
    batch, vocab = logits.shape
    check_tensor(temperature, "temperature", shape=[batch], dtypes=[torch.float32])
    check_tensor(top_p, "top_p", shape=[batch], dtypes=[torch.float32])
    if batch and not bool(((top_p > 0) & (top_p <= 1)).all()):
        raise ValueError(f"top_p must be in (0, 1], got {top_p.tolist()}")
    if token_bitmask is not None:
        check_tensor(token_bitmask, "token_bitmask", shape=[batch, (vocab + 31) // 32], dtypes=[torch.int32])
        tail = vocab % 32
        usable = token_bitmask.clone()
        if tail:
            usable[:, -1] &= (1 << tail) - 1
        empty = torch.nonzero((usable != 0).sum(-1) == 0).flatten().tolist()
        if empty:
            raise ValueError(f"token_bitmask allows no token in row(s) {empty}")
    per_row = reference.sampling.is_per_row(generator)
    if per_row:
        generator = _check_generators(generator, batch)
    resolved = resolve_backend("sample", backend, logits.device, logits.dtype)
    if resolved != "triton":
        return reference.sample(logits, temperature, top_p, token_bitmask, generator)
    check_tensor(temperature, "temperature", device=logits.device)
    check_tensor(top_p, "top_p", device=logits.device)
    if token_bitmask is not None:
        check_tensor(token_bitmask, "token_bitmask", device=logits.device)
    if per_row:
        uniforms = reference.sampling.row_uniforms(temperature, generator, logits.device)
    elif batch and bool((temperature > 0).any()):
        uniforms = torch.rand(batch, generator=generator, device=logits.device, dtype=torch.float32)
    else:
        uniforms = torch.zeros(batch, device=logits.device, dtype=torch.float32)
    if resolved == device_backend("sample", logits.device):
        return torch.ops.kvtier.sample(logits, temperature, top_p, uniforms, token_bitmask)
    return _sample_impl(resolved, logits, temperature, top_p, uniforms, token_bitmask)


def _check_generators(generators, batch: int) -> list:
    try:
        generators = list(generators)
    except TypeError:
        raise ValueError(f"generator must be a torch.Generator, None or a sequence of {batch} of them, "
                         f"got {type(generators).__name__}") from None
    if len(generators) != batch:
        raise ValueError(f"generator: expected {batch} per-row generators (one per logits row), got {len(generators)}")
    bad = [i for i, g in enumerate(generators) if g is not None and not isinstance(g, torch.Generator)]
    if bad:
        raise ValueError(f"generator[{bad[0]}] must be a torch.Generator or None, got {type(generators[bad[0]]).__name__}")
    return generators
