"""Thin serving loop in five nouns: request, block manager, scheduler, runner, engine."""

from kvtier.serve.config import EngineConfig
from kvtier.serve.engine import Engine
from kvtier.serve.params import RequestMetrics, RequestOutput, SamplingParams

__all__ = ["Engine", "EngineConfig", "RequestMetrics", "RequestOutput", "SamplingParams"]
