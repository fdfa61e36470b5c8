"""Backend resolution: one pure function decides what ``backend="auto"`` means.

Only the ``torch`` backend (the fp32 reference) exists yet; ``triton``, ``hip`` and ``aiter``
are named so callers get a clear "unavailable" error instead of a silent fallback.
"""

from __future__ import annotations

import torch

BACKENDS = ("auto", "torch", "triton", "hip", "aiter")
_AVAILABLE = {"torch"}


class BackendUnavailableError(RuntimeError):
    """The requested backend is not built or not supported for these inputs."""


def is_backend_supported(op: str, backend: str, device: torch.device | str = "cpu") -> bool:
    """Whether ``op`` can run on ``backend`` for ``device`` in this installation."""
    return backend in _AVAILABLE


def resolve_backend(op: str, backend: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """Return the concrete backend name for ``op`` (pure function of its arguments).

    Raises:
        ValueError: ``backend`` is not one of :data:`BACKENDS`.
        BackendUnavailableError: ``backend`` is known but not available here.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "torch"
    if not is_backend_supported(op, backend, device):
        raise BackendUnavailableError(f"{op}: backend {backend!r} is not available in this build (available: "
                                      f"{sorted(_AVAILABLE)})")
    return backend
