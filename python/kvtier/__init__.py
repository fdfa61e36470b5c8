"""kvtier: a kernel-first inference toolkit for agentic coding on Kimi K2-class models.

Importing ``kvtier`` registers the kernels as ``torch.library`` ops (``torch.ops.kvtier.*``, see
:mod:`kvtier.ops`), so an engine that only imports the package can call them. The engine names
below load on first use (PEP 562), so ``kvtier.ops`` and the kernels import without the native
extension ``kvtier._C`` that the engine's cache and copy engine need (the kernel benchmarks run
from a source tree where it could not be built).
"""

from kvtier import ops  # noqa: F401  (registers torch.ops.kvtier.*)

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
