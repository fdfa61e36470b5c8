"""The seeded synthetic workload: coding-agent sessions drawn from docs/workload.md's distributions."""

from __future__ import annotations

import math

import numpy as np
from kvtier.bench.workload.scaling import (
    _assemble,
    _block_size_after_scale,
    _check_limits,
    _RawSession,
    _RawTurn,
    _scaled_lengths,
    check_replay_options,
)
from kvtier.bench.workload.types import BUILTIN, Workload

# ---------------------------------------------------------------------------------------------
# Synthetic workload
#
# Quantiles (p10, p50, p90) of a split lognormal: below the median log-spread from p10/p50,
# above it from p50/p90, so all three quantiles are met exactly. Sources: docs/workload.md's table
# (710 sessions) unless marked "local" (measured on the 194 kv-cache-tester files in
# shared/traces, parent requests only).

GEN_BLOCK_SIZE = 64  # source tokens per block, as kv-cache-tester
# docs/workload.md: requests per session p10/p50/p90.
REQUESTS_PER_SESSION_Q = (7, 45, 155)
# local: median tool_tokens 12,439 + median system_tokens 2,774. docs/workload.md: ~12K + ~2.8K
# tokens "repeat across sessions", so every session starts with the same 15,213 tokens
# (237 full 64-token blocks with the same ids in every session).
SHARED_PREFIX_TOKENS = 15_213
# local: first request `in` p10/p50/p90 = 16,008 / 22,452 / 204,560, minus the shared prefix.
FIRST_EXTRA_TOKENS_Q = (795, 7_239, 189_347)
# docs/workload.md: new tokens per turn (in_k - in_{k-1} - out_{k-1}) p50 284, p90 3.0K. Its p10
# is -3 (shrinking contexts, compaction): not modelled; the lower half is spread so p10 = 1.
NEW_TOKENS_Q = (1, 284, 3_000)
# docs/workload.md: output tokens per request p10/p50/p90.
OUTPUT_TOKENS_Q = (105, 216, 898)
# docs/workload.md: think_time (s) after a tool_use stop, and after an end_turn stop.
THINK_AFTER_TOOL_USE_Q = (4.0, 9.0, 71.0)
THINK_AFTER_END_TURN_Q = (16.0, 132.0, 1_900.0)
# local: 11,447 tool_use / (11,447 tool_use + 725 end_turn) requests; the 1,466 with stop ""
# are left out.
P_TOOL_USE = 0.94
# local: the largest `in` of any request (894,371). First prompts are clipped to it and a
# session ends before a turn would exceed it.
MAX_PROMPT_TOKENS = 894_371
_Z90 = 1.2815515655446004  # standard normal 90th percentile
_SESSION_ID_BITS = 20  # local ids: (draw + 1) << 20 | counter; shared prefix ids < 2**20


def _split_lognormal(rng: np.random.Generator, q: tuple, size: int) -> np.ndarray:
    p10, p50, p90 = q
    z = rng.standard_normal(size)
    sigma = np.where(z < 0, math.log(p50 / p10) / _Z90, math.log(p90 / p50) / _Z90)
    return p50 * np.exp(sigma * z)


def _draw_session(seed: int, draw: int, max_turns: int | None, too_long,
                  stop=lambda turn: False) -> _RawSession | None:
    """Session number ``draw`` of ``seed`` (its own Generator): None once ``too_long(turn)``,
    or if ``stop`` holds for its first turn; it ends before a later turn for which it holds."""
    rng = np.random.default_rng([seed, draw])
    n = max(1, round(_split_lognormal(rng, REQUESTS_PER_SESSION_Q, 1)[0]))
    first = SHARED_PREFIX_TOKENS + max(1, round(_split_lognormal(rng, FIRST_EXTRA_TOKENS_Q, 1)[0]))
    new = np.maximum(1, np.rint(_split_lognormal(rng, NEW_TOKENS_Q, n))).astype(np.int64)
    out = np.maximum(1, np.rint(_split_lognormal(rng, OUTPUT_TOKENS_Q, n))).astype(np.int64)
    tool_use = rng.random(n) < P_TOOL_USE
    think_tool = _split_lognormal(rng, THINK_AFTER_TOOL_USE_Q, n)
    think_end = _split_lognormal(rng, THINK_AFTER_END_TURN_Q, n)
    fresh = iter(range((draw + 1) << _SESSION_ID_BITS, (draw + 2) << _SESSION_ID_BITS))
    shared = list(range(SHARED_PREFIX_TOKENS // GEN_BLOCK_SIZE))
    session = _RawSession(f"builtin_{seed}_{draw:05d}", 0, GEN_BLOCK_SIZE, [])
    length, ids = min(first, MAX_PROMPT_TOKENS), shared
    for k in range(n if max_turns is None else min(n, max_turns)):
        if k > 0:
            length = length + int(out[k - 1]) + int(new[k])
            if length > MAX_PROMPT_TOKENS:
                break
        prev = session.turns[-1] if session.turns else None
        kept = ids[: prev.in_tokens // GEN_BLOCK_SIZE] if prev else shared
        ids = kept + [next(fresh) for _ in range(-(-length // GEN_BLOCK_SIZE) - len(kept))]
        think = 0.0 if k == 0 else float(think_tool[k] if tool_use[k - 1] else think_end[k])
        turn = _RawTurn(length, int(out[k]), ids, None, think, "tool_use" if tool_use[k] else "end_turn")
        if too_long(turn) or (k == 0 and stop(turn)):
            return None
        if stop(turn):
            break
        session.turns.append(turn)
    return session


def generate_workload(*, num_sessions: int = 32, seed: int = 0, token_scale: float = 1 / 64,
                      time_scale: float = 1.0, max_think_s: float = float("inf"),
                      max_turns: int | None = None, max_input_tokens: int | None = None,
                      truncate_input_tokens: int | None = None) -> Workload:
    """A seeded synthetic coding-agent workload with docs/workload.md's measured statistics.

    Each session starts with a prompt of the shared tool + system prompt (the same block ids
    in every session) plus a session-specific part; turn ``k+1``'s prompt is turn ``k``'s
    prompt + its output + new tokens (tool results, user text). Block ids extend turn ``k``'s
    full blocks; its partial last block and the new content get fresh ids. Lengths are drawn
    in 64-token-block source units and then scaled as in :func:`load_trace`. The constants
    above (``*_Q``, ``P_TOOL_USE`` ...) name their sources.

    Args:
        num_sessions: sessions returned (always exactly this many).
        seed: the same seed gives the same workload; session ``i`` is drawn from its own
            ``numpy.random.default_rng([seed, i])``, so ``max_turns`` only truncates.
        token_scale: as in :func:`load_trace`; ``64 * token_scale`` must be an integer >= 1.
            The default 1/64 gives 1-token blocks (a ~15K-token coding prompt becomes ~240).
        time_scale, max_think_s: as in :func:`load_trace`.
        max_turns: keep the first N turns of each session.
        max_input_tokens: sessions with a longer scaled prompt are discarded and drawn again
            (whole sessions, as in :func:`load_trace`), so the result is biased to shorter ones.
        truncate_input_tokens: each session ends before its first turn with a longer scaled
            prompt, as in :func:`load_trace`; a session whose first prompt is longer is drawn
            again (like ``max_input_tokens``, so first prompts are biased to shorter ones).

    Raises:
        ValueError: a parameter out of range, or ``max_input_tokens`` too small to ever fit
            (below the shared prompt, or fewer than ``num_sessions`` fit in 1000 draws each).

    Example:
        >>> wl = generate_workload(num_sessions=2, seed=1)
        >>> wl.block_size, len(wl.sessions)
        (1, 2)
    """
    if isinstance(num_sessions, bool) or not isinstance(num_sessions, int) or num_sessions < 1:
        raise ValueError(f"num_sessions must be an int >= 1, got {num_sessions!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    _check_limits(time_scale, max_think_s, None, max_turns, max_input_tokens)
    check_replay_options(truncate_input_tokens)
    block_size = _block_size_after_scale({GEN_BLOCK_SIZE}, token_scale)

    def longer(t: _RawTurn, limit: int | None) -> bool:
        return limit is not None and _scaled_lengths(t, GEN_BLOCK_SIZE, block_size, token_scale)[0] > limit

    def too_long(t: _RawTurn) -> bool:
        return longer(t, max_input_tokens)

    def stop(t: _RawTurn) -> bool:
        return longer(t, truncate_input_tokens)

    smallest = _RawTurn(SHARED_PREFIX_TOKENS + 1, 1, [0] * -(-(SHARED_PREFIX_TOKENS + 1) // GEN_BLOCK_SIZE),
                        None, 0.0, "")
    for name, limit in (("max_input_tokens", max_input_tokens),
                        ("truncate_input_tokens", truncate_input_tokens)):
        if longer(smallest, limit):
            raise ValueError(f"{name}={limit} is below the shortest first prompt "
                             f"({_scaled_lengths(smallest, GEN_BLOCK_SIZE, block_size, token_scale)[0]} "
                             f"tokens at token_scale={token_scale!r})")
    raw: list[_RawSession] = []
    max_draws = 1000 * num_sessions
    for draw in range(max_draws):
        s = _draw_session(seed, draw, max_turns, too_long, stop)
        if s is not None:
            raw.append(s)
            if len(raw) == num_sessions:
                break
    else:
        raise ValueError(f"max_input_tokens={max_input_tokens}: only {len(raw)} of {num_sessions} "
                         f"sessions fit in {max_draws} draws")
    return _assemble(raw, name=f"builtin-seed{seed}", source=BUILTIN, fmt=BUILTIN,
                     token_scale=token_scale, time_scale=time_scale, max_think_s=max_think_s,
                     max_sessions=None, max_turns=None, max_input_tokens=None)
