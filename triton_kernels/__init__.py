"""Triton kernel bodies (``@triton.jit`` only), installed as ``kvtier.triton_kernels``.

Public wrappers live in :mod:`kvtier.ops`; callers never import these bodies directly. Nothing
here imports torch.

Every kernel module registers its kernels with :func:`register_kernel`, giving the shapes and
dtypes at which the ahead-of-time compile gate (``perf/compile_gate.py``) must build it for each
target. The gate imports every module of this package (:func:`load_all`) and compiles what
registered, so a new kernel joins the gate by registering.

The launchers run a kernel's body under the interpreter (``TRITON_INTERPRET=1``) by wrapping
``kernel.fn`` at launch time; a ``@triton.jit`` helper the body calls (``moe.tile_rows``) is not
rewrapped, so it runs interpreted only if its module was imported with the interpreter on. The
kernel modules are imported lazily by their launchers, at the first launch, when the dispatcher
has already checked the interpreter (it must be on before triton's import) for CPU tensors.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CompileCase:
    """One ahead-of-time build of a kernel.

    Attributes:
        label: short shape/dtype tag, e.g. ``"h64-bf16"``.
        signature: argument name -> Triton type string (``"*bf16"``, ``"i32"``, ``"fp32"``,
            ``"constexpr"``); every argument of the kernel appears.
        constexprs: values of the ``constexpr`` arguments.
        num_warps, num_stages: launch options, as the launcher uses them.
        attrs: extra Triton attributes by argument index (rarely needed; see ``values``).
        values: the runtime values of integer arguments at this shape (strides, sizes). The gate
            specialises the build as Triton's JIT does at launch: a value of 1 becomes a
            constexpr, a multiple of 16 gets ``tt.divisibility`` 16; every pointer argument is
            taken as 16-byte aligned (torch allocations are). Without them the gate would build a
            variant that never runs (no vectorised loads, no pipelining) and report its resources.
    """

    label: str
    signature: dict[str, str]
    constexprs: dict[str, object]
    num_warps: int = 4
    num_stages: int = 2
    attrs: dict = field(default_factory=dict)
    values: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class KernelEntry:
    """A registered kernel: ``cases(arch)`` lists its builds for a target arch (``"gfx942"``,
    ``"gfx950"``, ``"sm_90"``); arch matters for arch-resolved dtypes (fp8 e4m3fnuz on gfx942)."""

    name: str
    fn: object
    cases: Callable[[str], list[CompileCase]]


KERNELS: dict[str, KernelEntry] = {}


def register_kernel(name: str, fn, cases: Callable[[str], list[CompileCase]]) -> None:
    """Add ``fn`` (a ``@triton.jit`` function) to the compile gate under ``name``."""
    if name in KERNELS and KERNELS[name].fn is not fn:
        raise ValueError(f"kernel {name!r} registered twice")
    KERNELS[name] = KernelEntry(name, fn, cases)


def load_all() -> tuple[dict[str, KernelEntry], list[str]]:
    """Import every kernel module of this package.

    Returns (the registry, one ``"module: error"`` line per module that failed to import); a
    broken module does not hide the others' kernels, and the gate reports it as a failure.
    """
    errors = []
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            try:
                importlib.import_module(f"{__name__}.{info.name}")
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                errors.append(f"{info.name}: {type(exc).__name__}: {exc}")
    return KERNELS, errors


def fp8_e4m3_name(arch: str) -> str:
    """Triton's name of the fp8 e4m3 KV dtype on ``arch``: ``fp8e4b8`` (e4m3fnuz) on gfx942, else
    ``fp8e4nv`` (OCP e4m3fn: gfx950, sm_89+)."""
    return "fp8e4b8" if arch == "gfx942" else "fp8e4nv"
