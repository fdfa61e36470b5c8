"""kvtier: a kernel-first inference toolkit for agentic coding on Kimi K2-class models.

Importing ``kvtier`` registers the kernels as ``torch.library`` ops (``torch.ops.kvtier.*``, see
:mod:`kvtier.ops`), so an engine that only imports the package can call them. The engine names
below load on first use (PEP 562), so ``kvtier.ops`` and the kernels import without the native
extension ``kvtier._C`` that the engine's cache and copy engine need (the kernel benchmarks run
from a source tree where it could not be built).
"""

import importlib.abc
import importlib.util
import sys
from pathlib import Path

_KERNEL_BODIES = Path(__file__).resolve().parents[2] / "triton_kernels"


class _SourceTreeKernels(importlib.abc.MetaPathFinder):
    """Finds ``kvtier.triton_kernels`` in a source checkout put on ``PYTHONPATH`` without installing
    it (a vLLM venv running the connector from this tree): setup.py maps that package to the
    repository's ``triton_kernels/``. Consulted only after the usual finders fail."""

    def find_spec(self, name, path=None, target=None):
        if name != "kvtier.triton_kernels":
            return None
        return importlib.util.spec_from_file_location(name, _KERNEL_BODIES / "__init__.py",
                                                      submodule_search_locations=[str(_KERNEL_BODIES)])


if (_KERNEL_BODIES / "__init__.py").is_file() and not any(isinstance(f, _SourceTreeKernels) for f in sys.meta_path):
    sys.meta_path.append(_SourceTreeKernels())

from kvtier import ops  # noqa: E402, F401  (registers torch.ops.kvtier.*)

__version__ = "0.1.0"

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from kvtier.llm import LLM

        return LLM
    if name in ("EngineConfig", "RequestOutput", "SamplingParams"):
        from kvtier import serve

        return getattr(serve, name)
    raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
