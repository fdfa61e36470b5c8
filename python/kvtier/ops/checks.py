"""Argument checks shared by the op wrappers; messages name the argument, expected and got."""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class BackendUnavailableError(RuntimeError):
    """The requested backend is not built or not supported for these inputs (raised by
    :func:`kvtier.ops.dispatch.resolve_backend` and by the backends' own input checks)."""


def check_tensor(t: object, name: str, *, ndim: int | None = None, dtypes: Sequence[torch.dtype] | None = None,
                 shape: Sequence[int | None] | None = None, device: torch.device | None = None) -> None:
    """Raise TypeError/ValueError when ``t`` is not a tensor of the expected rank, dtype, shape, device.

    ``shape`` entries of None match any size.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if shape is not None:
        if len(shape) != t.dim() or any(s is not None and s != g for s, g in zip(shape, t.shape)):
            want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
            raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def check_out(out: torch.Tensor | None, name: str, shape: Sequence[int], dtype: torch.dtype,
              device: torch.device) -> None:
    if out is not None:
        check_tensor(out, name, shape=list(shape), dtypes=[dtype], device=device)
