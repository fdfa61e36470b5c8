"""Named comparison metrics for op tests (docs/kernels.md, "Named comparisons"): fail loudly, print the worst index.

``assert_close`` checks, in order: shape; equality of the NaN / +inf / -inf patterns; an
elementwise ``|a - e| <= atol + rtol * |e|`` bound over the finite entries (the message names
the mismatch count, the worst index and both values there); and optionally the cosine diff
``1 - 2 <a, e> / (|a|^2 + |e|^2)`` (FlashMLA's ``check_is_allclose`` metric), which catches a
small systematic error spread over many entries that a loose atol would let through.
"""

from __future__ import annotations

import torch


def cos_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``1 - 2 <a, e> / (|a|^2 + |e|^2)`` in float64 over the finite entries of ``expected``."""
    a, e = actual.double(), expected.double()
    finite = torch.isfinite(e)
    a, e = a[finite], e[finite]
    denom = float((a * a + e * e).sum())
    if denom == 0.0:
        return 0.0
    return 1.0 - 2.0 * float((a * e).sum()) / denom


def _first_index(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in torch.nonzero(mask)[0])


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float, name: str,
                 max_cos_diff: float | None = None) -> None:
    """Raise AssertionError naming ``name``, the worst index and the values there."""
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    for label, pattern in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        pa, pe = pattern(a), pattern(e)
        if not torch.equal(pa, pe):
            idx = _first_index(pa != pe)
            raise AssertionError(f"{name}: {label} pattern differs ({int((pa != pe).sum())} entries); first at "
                                 f"{idx}: actual {a[idx].item()}, expected {e[idx].item()}")
    finite = torch.isfinite(e)
    err = torch.where(finite, (a - e).abs(), torch.zeros_like(a))
    excess = err - (atol + rtol * e.abs().where(finite, torch.zeros_like(e)))
    if bool((excess > 0).any()):
        flat = int(excess.flatten().argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(a.shape)))
        raise AssertionError(
            f"{name}: {int((excess > 0).sum())}/{a.numel()} entries exceed atol={atol}, rtol={rtol}; worst at "
            f"{idx}: actual {a[idx].item():.8g}, expected {e[idx].item():.8g}, |diff| {err[idx].item():.3g}; "
            f"max |diff| {err.max().item():.3g}")
    if max_cos_diff is not None:
        cd = cos_diff(a, e)
        assert cd <= max_cos_diff, f"{name}: cos diff {cd:.3g} > {max_cos_diff:.3g}"
