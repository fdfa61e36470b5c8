"""Backend resolution: one pure function decides what ``backend="auto"`` means.

Two facts decide whether ``op`` can run on ``backend``:

1. the op *implements* it: a per-op registry, filled by the op modules at import
   (``register_backend("fused_moe", "triton")``); every op implements ``torch`` (the fp32
   reference in :mod:`kvtier.reference`; on CPU tensors, paged MLA runs the blocked
   :mod:`kvtier.ops._cpu_mla`, tested against it);
2. the backend is *available* for the device in this installation: ``triton`` needs the
   ``triton`` package and a CUDA/HIP device, or ``TRITON_INTERPRET=1`` for CPU tensors (the
   interpreter, for tests at small shapes); ``hip`` needs the ``kvtier._hip`` extension (built
   only where a GPU compiler and a GPU driver are present) and a GPU tensor; ``aiter`` needs a
   ROCm build of torch, the ``aiter`` package at the version the op's adapter targets
   (:data:`kvtier.ops._aiter.MIN_VERSION`) and a GPU tensor. Input-dependent limits of a backend
   (aiter's MLA decode takes bf16 and at most 128 heads) are checked by the op itself and raise
   the same error.

``"auto"`` picks ``triton`` for a GPU tensor when both hold, else ``torch``; it never picks the
interpreter. Explicitly requested backends that cannot run raise
:class:`BackendUnavailableError` with the reason; nothing falls back silently.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

import torch

from kvtier.ops.checks import BackendUnavailableError

BACKENDS = ("auto", "torch", "triton", "hip", "aiter")

_IMPLEMENTED: dict[str, set[str]] = {}


def register_backend(op: str, *backends: str) -> None:
    """Declare that ``op`` has an implementation on each of ``backends`` (besides ``torch``)."""
    for backend in backends:
        if backend not in BACKENDS or backend == "auto":
            raise ValueError(f"backend must be one of {BACKENDS[1:]}, got {backend!r}")
    _IMPLEMENTED.setdefault(op, {"torch"}).update(backends)


def implemented_backends(op: str) -> frozenset[str]:
    """The backends ``op`` has code for (available here or not)."""
    return frozenset(_IMPLEMENTED.get(op, {"torch"}))


@functools.cache
def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def _hip_unbuilt() -> str | None:
    """Why ``kvtier._hip`` cannot be used in this installation, or None."""
    if not _has_module("kvtier._hip"):
        return ("hip kernels are not built (no kvtier._hip extension: the build makes it when hipcc with an AMD "
                "GPU driver, or nvcc with the NVIDIA driver, is present; KVTIER_BUILD_HIP=on forces it)")
    try:
        importlib.import_module("kvtier._hip")
    except ImportError as exc:
        return f"kvtier._hip is built but does not load: {exc}"
    return None


def triton_interpreting() -> bool:
    """``TRITON_INTERPRET`` is set to a true value: Triton kernels run on CPU tensors (slowly)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _interpreter_unready() -> str | None:
    """Why Triton cannot interpret kernels in this process now, or None."""
    if not triton_interpreting():
        return "triton on CPU tensors needs the interpreter (TRITON_INTERPRET=1)"
    standard = sys.modules.get("triton.language.standard")
    if standard is not None and type(standard.cdiv).__name__ != "InterpretedFunction":
        return ("TRITON_INTERPRET=1 was set after triton was imported; set it before the first import "
                "(triton's own library functions are compiled-only otherwise)")
    return None


def _device_type(device: torch.device | str) -> str:
    return torch.device(device).type


def unavailable_reason(op: str, backend: str, device: torch.device | str = "cpu") -> str | None:
    """Why ``op`` cannot run on ``backend`` for ``device`` here, or None when it can."""
    if backend not in implemented_backends(op):
        return f"{op} has no {backend!r} implementation (implemented: {sorted(implemented_backends(op))})"
    dev = _device_type(device)
    if backend == "torch":
        return None
    if backend == "triton":
        if not _has_module("triton"):
            return "triton not installed"
        if dev == "cuda":
            return None
        if dev == "cpu":
            return _interpreter_unready()
        return f"triton does not support device type {dev!r}"
    if backend == "hip":
        reason = _hip_unbuilt()
        if reason is not None:
            return reason
        return None if dev == "cuda" else f"hip kernels need a GPU tensor, got device type {dev!r}"
    if backend == "aiter":
        if torch.version.hip is None:
            return "aiter needs ROCm (this torch is built without HIP)"
        if not _has_module("aiter"):
            return "aiter not installed"
        if dev != "cuda":
            return f"aiter needs a GPU tensor, got device type {dev!r}"
        from kvtier.ops import _aiter

        return _aiter.version_problem(op)
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def is_backend_supported(op: str, backend: str, device: torch.device | str = "cpu") -> bool:
    """Whether ``op`` can run on ``backend`` for ``device`` in this installation."""
    return unavailable_reason(op, backend, device) is None


@torch.compiler.assume_constant_result
def resolve_backend(op: str, backend: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """Return the concrete backend name for ``op`` (pure function of its arguments and the build).

    ``torch.compile`` evaluates it while tracing and keeps the answer as a constant (it reads only
    the build and the arguments), so ops called with ``backend=`` trace without a graph break.

    Raises:
        ValueError: ``backend`` is not one of :data:`BACKENDS`.
        BackendUnavailableError: ``backend`` is known but cannot run here (the message says why).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        on_gpu = _device_type(device) == "cuda"
        return "triton" if on_gpu and is_backend_supported(op, "triton", device) else "torch"
    reason = unavailable_reason(op, backend, device)
    if reason is not None:
        raise BackendUnavailableError(f"{op}: backend {backend!r} is unavailable: {reason}")
    return backend


@torch.compiler.assume_constant_result
def device_backend(op: str, device: torch.device | str) -> str:
    """The backend that the ``torch.ops.kvtier.<op>`` kernel registered for ``device``'s type runs.

    ``torch`` (the reference) on CPU; on a GPU ``triton`` where available, else ``hip`` where
    ``kvtier._hip`` is built and implements ``op``, else ``torch``. The public op functions call the
    registered op when their resolved backend is this one, and the backend's code directly
    otherwise (``backend="triton"`` on CPU under the interpreter, ``"hip"`` next to Triton, ``"aiter"``).
    """
    if _device_type(device) != "cuda":
        return "torch"
    for backend in ("triton", "hip"):
        if is_backend_supported(op, backend, device):
            return backend
    return "torch"


def calls_registered_op(device: torch.device | str) -> bool:
    """Whether a public op runs its ``torch.ops.kvtier.<op>`` registration (True) or calls its CPU
    kernel as a plain function (False).

    On a GPU the registration picks the device's kernel, and under ``torch.compile`` it is the
    one opaque node the graph keeps; on the CPU in eager mode the same kernel is called directly,
    which skips torch.library's Python dispatch of a mutating custom op (about 80 µs a call with
    torch 2.13 on one core, a sixth of a small layer's decode: docs/benchmarks.md).
    """
    return _device_type(device) != "cpu" or torch.compiler.is_compiling()
