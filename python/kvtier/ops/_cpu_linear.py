"""Dense bf16 GEMMs on the CPU with weights held in oneDNN's blocked layout, and the per-module
store of such derived weights.

``F.linear`` on bf16 CPU tensors reorders the weight into oneDNN's blocked layout on every call;
at decode sizes that reorder is most of the call. :func:`pack_weight` makes the blocked copy once
(``torch.ops.mkldnn._reorder_linear_weight``, what torch.compile's CPU freezing pass uses) and
:func:`linear` runs the product on it (``torch.ops.mkldnn._linear_pointwise``): the same oneDNN
kernel, so the result equals ``F.linear(x, weight)`` bit for bit. Measured with torch 2.13 on one
core of the 2-core CPU machine (docs/benchmarks.md): 8 rows x 576 x 256, 53 against 29 µs;
8 x 1024 x 256, 67 against 34 µs; 384 rows, the same as ``F.linear`` within noise.

:class:`DerivedWeights` keeps such copies (and fp32 upcasts) per module, made on first use and
remade when the weight they come from changes (another storage, or an in-place write that bumps
its version counter), so a module loaded, reloaded or moved never runs on a stale copy.

Bytes: a packed copy holds the weight's bytes again (K2's dense projections, not the experts or
the LM head). FLOPs: ``2*T*N*K`` as ``F.linear``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_REORDER = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
_LINEAR_POINTWISE = getattr(torch.ops.mkldnn, "_linear_pointwise", None)


def available() -> bool:
    """Whether this torch build has oneDNN's prepacked linear (else :func:`pack_weight` returns None)."""
    return _REORDER is not None and _LINEAR_POINTWISE is not None and torch.backends.mkldnn.is_available()


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of ``weight`` [N, K] bf16 on the CPU, or None when it is not that (or
    this torch lacks the op): the caller then runs ``F.linear``."""
    if not available() or weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return None
    return _REORDER(weight.detach(), None)


def linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` [..., K] bf16 on the CPU and ``packed`` from :func:`pack_weight`;
    returns [..., N] bf16, equal to ``F.linear(x, weight)``.

    Raises:
        RuntimeError: ``x`` is not bf16 or its last dim is not K (oneDNN's message).
    """
    return _LINEAR_POINTWISE(x, packed, None, "none", [], "")


class DerivedWeights:
    """Copies derived from a module's weights (a packed layout, an fp32 upcast), made on first use
    and remade when the source weight changes.

    Example::

        held = DerivedWeights()
        w32 = held.get("w_fp32", weight, lambda w: w.float())  # made once
        w32 = held.get("w_fp32", weight, lambda w: w.float())  # the same tensor
    """

    def __init__(self) -> None:
        self._held: dict[str, tuple[tuple[int, int | None], object]] = {}

    def get(self, name: str, source: torch.Tensor, make: Callable[[torch.Tensor], object]) -> object:
        """``make(source)``, kept under ``name`` while ``source``'s storage and version are unchanged
        (an inference tensor, made under ``torch.inference_mode``, has no version counter: only its
        storage is compared)."""
        key = (source.data_ptr(), None if source.is_inference() else source._version)
        held = self._held.get(name)
        if held is None or held[0] != key:
            with torch.no_grad():
                held = (key, make(source))
            self._held[name] = held
        return held[1]

    def clear(self) -> None:
        """Drop every copy (they are remade on next use)."""
        self._held.clear()
