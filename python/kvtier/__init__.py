"""kvtier: a kernel-first inference toolkit for agentic coding on Kimi K2-class models."""

__version__ = "0.1.0"

from kvtier.llm import LLM  # noqa: E402
from kvtier.serve import EngineConfig, RequestOutput, SamplingParams  # noqa: E402

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams", "__version__"]
