"""Coding-agent workloads for replay: load recorded traces or generate a seeded synthetic one.

Modules: ``types`` (:class:`Workload`, :class:`Session`, :class:`Turn`), ``traces`` (the
kv-cache-tester and Mooncake loaders, :func:`load_trace`), ``generator``
(:func:`generate_workload`), ``scaling`` (token and time scaling, limits and truncation shared
by both), ``tokens`` (:func:`prompt_token_ids`).
"""

from kvtier.bench.workload.generator import (
    FIRST_EXTRA_TOKENS_Q,
    GEN_BLOCK_SIZE,
    MAX_PROMPT_TOKENS,
    NEW_TOKENS_Q,
    OUTPUT_TOKENS_Q,
    P_TOOL_USE,
    REQUESTS_PER_SESSION_Q,
    SHARED_PREFIX_TOKENS,
    THINK_AFTER_END_TURN_Q,
    THINK_AFTER_TOOL_USE_Q,
    generate_workload,
)
from kvtier.bench.workload.scaling import check_replay_options
from kvtier.bench.workload.tokens import prompt_token_ids
from kvtier.bench.workload.traces import load_trace
from kvtier.bench.workload.types import (
    BUILTIN,
    KV_CACHE_TESTER,
    MIXED,
    MOONCAKE,
    STOPS,
    Session,
    TraceError,
    Turn,
    Workload,
)

__all__ = [
    "BUILTIN", "FIRST_EXTRA_TOKENS_Q", "GEN_BLOCK_SIZE", "KV_CACHE_TESTER", "MAX_PROMPT_TOKENS", "MIXED",
    "MOONCAKE", "NEW_TOKENS_Q", "OUTPUT_TOKENS_Q", "P_TOOL_USE", "REQUESTS_PER_SESSION_Q", "SHARED_PREFIX_TOKENS",
    "STOPS", "THINK_AFTER_END_TURN_Q", "THINK_AFTER_TOOL_USE_Q", "Session", "TraceError", "Turn", "Workload",
    "check_replay_options", "generate_workload", "load_trace", "prompt_token_ids",
]
