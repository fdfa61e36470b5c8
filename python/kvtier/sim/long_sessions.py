"""Long-context coding-agent sessions of a fixed shape: every session starts from a prompt of
``prefix_tokens`` tokens and each later turn's prompt is ``increment_tokens`` longer than the one
before (the previous output plus new text), as an agent deep into a large repository works.

Everything else comes from the built-in generator's distributions
(:mod:`kvtier.bench.workload.generator`, docs/workload.md): turns per session, output tokens per
turn (capped below the increment), tool-use vs end-turn stops and the think time after each. The
first ``SHARED_PREFIX_TOKENS`` tokens (the tool + system prompt) are the same in every session;
the rest of each prompt is the session's own.
"""

from __future__ import annotations

import numpy as np
from kvtier.bench.workload.generator import (
    GEN_BLOCK_SIZE,
    OUTPUT_TOKENS_Q,
    P_TOOL_USE,
    REQUESTS_PER_SESSION_Q,
    SHARED_PREFIX_TOKENS,
    THINK_AFTER_END_TURN_Q,
    THINK_AFTER_TOOL_USE_Q,
    _split_lognormal,
)
from kvtier.bench.workload.scaling import _assemble, _RawSession, _RawTurn
from kvtier.bench.workload.types import BUILTIN, Workload
from kvtier.options import check_int

_SESSION_ID_BITS = 24  # local ids: (session + 1) << 24 | counter; shared prefix ids below 2**24


def long_session_workload(*, num_sessions: int, prefix_tokens: int, increment_tokens: int, max_input_tokens: int,
                          seed: int = 0, time_scale: float = 1.0, max_think_s: float = float("inf"),
                          max_turns: int | None = None) -> Workload:
    """``num_sessions`` sessions of the shape in the module docstring, in 64-token blocks.

    Args:
        num_sessions: sessions returned.
        prefix_tokens: every session's first prompt, tokens (> ``SHARED_PREFIX_TOKENS``).
        increment_tokens: growth of the prompt per turn, tokens (>= 2: at least one output and one
            new token).
        max_input_tokens: a session ends before a prompt longer than this (the model's context).
        seed: session ``i`` draws from ``numpy.random.default_rng([seed, i])``.
        time_scale, max_think_s, max_turns: as :func:`kvtier.bench.workload.generate_workload`.

    Raises:
        ValueError: a size out of range, naming it.

    Example:
        >>> wl = long_session_workload(num_sessions=2, prefix_tokens=409_600, increment_tokens=4096,
        ...                            max_input_tokens=1_048_576, max_turns=3)
        >>> [t.input_tokens for t in wl.sessions[0].turns]
        [409600, 413696, 417792]
    """
    check_int("num_sessions", num_sessions, min_value=1)
    check_int("seed", seed, min_value=0)
    check_int("prefix_tokens", prefix_tokens, min_value=SHARED_PREFIX_TOKENS + 1)
    check_int("increment_tokens", increment_tokens, min_value=2)
    check_int("max_input_tokens", max_input_tokens, min_value=prefix_tokens)
    shared = list(range(SHARED_PREFIX_TOKENS // GEN_BLOCK_SIZE))
    raw = []
    for i in range(num_sessions):
        rng = np.random.default_rng([seed, i])
        n = max(1, round(_split_lognormal(rng, REQUESTS_PER_SESSION_Q, 1)[0]))
        out = np.clip(np.rint(_split_lognormal(rng, OUTPUT_TOKENS_Q, n)), 1, increment_tokens - 1).astype(np.int64)
        tool_use = rng.random(n) < P_TOOL_USE
        think_tool = _split_lognormal(rng, THINK_AFTER_TOOL_USE_Q, n)
        think_end = _split_lognormal(rng, THINK_AFTER_END_TURN_Q, n)
        fresh = iter(range((i + 1) << _SESSION_ID_BITS, (i + 2) << _SESSION_ID_BITS))
        session = _RawSession(f"long_{seed}_{i:05d}", 0, GEN_BLOCK_SIZE, [])
        ids: list[int] = shared
        for k in range(n if max_turns is None else min(n, max_turns)):
            length = prefix_tokens + k * increment_tokens
            if length > max_input_tokens:
                break
            kept = ids[: session.turns[-1].in_tokens // GEN_BLOCK_SIZE] if session.turns else shared
            ids = kept + [next(fresh) for _ in range(-(-length // GEN_BLOCK_SIZE) - len(kept))]
            think = 0.0 if k == 0 else float(think_tool[k] if tool_use[k - 1] else think_end[k])
            session.turns.append(_RawTurn(length, int(out[k]), ids, None, think,
                                          "tool_use" if tool_use[k] else "end_turn"))
        raw.append(session)
    return _assemble(raw, name=f"long-{prefix_tokens}+{increment_tokens}-seed{seed}", source=BUILTIN, fmt=BUILTIN,
                     token_scale=1.0, time_scale=time_scale, max_think_s=max_think_s, max_sessions=None,
                     max_turns=None, max_input_tokens=None)


__all__ = ["long_session_workload"]
