"""From source sessions (a trace's or the generator's) to a :class:`Workload`: token and time
scaling, limits, truncation and global block ids.

Token scaling keeps the block structure: with ``B = source block size * token_scale`` (an
integer >= 1) and ``n`` source blocks, ``input_tokens = clamp(round(in * token_scale),
(n-1)*B + 1, n*B)`` and ``output_tokens = max(1, round(out * token_scale))``. Times:
``think_time_s = min(think_time * time_scale, max_think_s)``, 0 for a first turn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from kvtier.bench.workload.types import _MAX_LOCAL_ID, Session, Turn, Workload

# ---------------------------------------------------------------------------------------------
# Source-level representation shared by the readers and the generator.


@dataclass
class _RawTurn:
    in_tokens: int  # source tokens
    out_tokens: int  # source tokens, may be 0
    hash_ids: list[int]  # local ids in the session's namespace, one per full (or last) block
    tail: int | None  # local id of an id-less partial tail block (its own namespace), or None
    think_s: float  # unscaled seconds
    stop: str


@dataclass
class _RawSession:
    session_id: str
    namespace: int  # id space: sessions with the same namespace share equal ids
    block_size: int  # source tokens per block
    turns: list[_RawTurn]
    # kv-cache-tester only: the file's tool_tokens + system_tokens (a warm prefix may replace
    # the start of the first prompt); None for formats without them.
    prefix_tokens: int | None = None
    parent: str | None = None  # the session that started this sub-agent, if any
    start_turn: int = 0  # the parent's turns before this sub-agent's marker




# ---------------------------------------------------------------------------------------------
# Scaling, filtering and global ids


def _block_size_after_scale(source_sizes: set[int], token_scale: float) -> int:
    if not (isinstance(token_scale, (int, float)) and math.isfinite(token_scale) and token_scale > 0):
        raise ValueError(f"token_scale must be a finite number > 0, got {token_scale!r}")
    smallest = min(source_sizes)
    for bs in sorted(source_sizes):
        scaled = bs * token_scale
        if bs % smallest or abs(scaled - round(scaled)) > 1e-9 or round(scaled) < 1:
            raise ValueError(
                f"token_scale={token_scale!r} gives {bs} * {token_scale!r} = {scaled:g} tokens per "
                f"block; allowed scales make every source block size {sorted(source_sizes)} an "
                f"integer >= 1: k / {smallest} for an integer k >= 1 (e.g. 1, 1/2, ..., 1/{smallest})")
    return round(smallest * token_scale)


def _check_limits(time_scale, max_think_s, max_sessions, max_turns, max_input_tokens) -> None:
    if not (isinstance(time_scale, (int, float)) and math.isfinite(time_scale) and time_scale >= 0):
        raise ValueError(f"time_scale must be a finite number >= 0, got {time_scale!r}")
    if not (isinstance(max_think_s, (int, float)) and max_think_s >= 0):
        raise ValueError(f"max_think_s must be a number >= 0, got {max_think_s!r}")
    for name, v in (("max_sessions", max_sessions), ("max_turns", max_turns),
                    ("max_input_tokens", max_input_tokens)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be None or an int >= 1, got {v!r}")


def _scaled_lengths(t: _RawTurn, src_bs: int, block_size: int, token_scale: float) -> tuple[int, int]:
    """(input_tokens, output_tokens) after scaling; the prompt keeps covering the same blocks."""
    n = len(t.hash_ids) + (t.tail is not None)
    per_src = round(src_bs * token_scale)  # == block_size * (src_bs // smallest source size)
    n_in = min(max(round(t.in_tokens * token_scale), (n - 1) * per_src + 1), n * per_src)
    return n_in, max(1, round(t.out_tokens * token_scale))


def _common_prefix(a: list, b: list) -> int:
    m = min(len(a), len(b))
    if a[:m] == b[:m]:
        return m
    if m > 0 and a[: m - 1] == b[: m - 1]:  # the common case: only a partial last block changed
        return m - 1
    lo, hi = 0, m - 1  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _truncate(s: _RawSession, lengths: list, limit: int | None, reached: dict) -> int:
    """How many turns of ``s`` the replay keeps under ``truncate_input_tokens`` (0: drop it).

    ``reached`` maps each session seen so far to the turns it keeps: a sub-agent runs only if
    its parent's replay gets to its marker, i.e. keeps every parent turn before it.
    """
    if limit is None:
        n = len(lengths)
    elif s.parent is not None and reached.get(s.parent, 0) < max(s.start_turn, 1):
        n = 0
    else:
        n = next((i for i, (n_in, _) in enumerate(lengths) if n_in > limit), len(lengths))
    reached[s.session_id] = n
    return n


def _assemble(raw: list[_RawSession], *, name: str, source: str, fmt: str, token_scale: float,
              time_scale: float, max_think_s: float, max_sessions, max_turns, max_input_tokens,
              truncate_input_tokens=None, warm_prefix_fraction: float = 0.0,
              sample_seed: int | None = None) -> Workload:
    """Scale, filter (max_turns, truncate_input_tokens, max_input_tokens, then max_sessions:
    the first N, or with ``sample_seed`` N drawn without replacement by
    ``numpy.random.default_rng(sample_seed)``, kept in source order), share the warm prefix
    and number blocks."""
    _check_limits(time_scale, max_think_s, max_sessions, max_turns, max_input_tokens)
    check_replay_options(truncate_input_tokens, warm_prefix_fraction)
    block_size = _block_size_after_scale({s.block_size for s in raw}, token_scale)
    kept: list[tuple[_RawSession, list[_RawTurn], list[tuple[int, int]]]] = []
    reached: dict[str, int] = {}
    for s in raw:
        turns = s.turns[:max_turns] if max_turns is not None else s.turns
        lengths = [_scaled_lengths(t, s.block_size, block_size, token_scale) for t in turns]
        n = _truncate(s, lengths, truncate_input_tokens, reached)
        if n == 0:
            continue
        turns, lengths = turns[:n], lengths[:n]
        if max_input_tokens is not None and any(n_in > max_input_tokens for n_in, _ in lengths):
            continue
        kept.append((s, turns, lengths))
        if sample_seed is None and max_sessions is not None and len(kept) == max_sessions:
            break
    if sample_seed is not None and max_sessions is not None and len(kept) > max_sessions:
        chosen = np.random.default_rng(sample_seed).choice(len(kept), size=max_sessions, replace=False)
        kept = [kept[i] for i in sorted(chosen)]
    warm = int(warm_prefix_fraction * max((s.prefix_tokens or 0 for s, _, _ in kept), default=0))
    table: dict[int, int] = {}  # packed (namespace, local id) -> dense index, first-seen order
    starts: list[int] = []  # dense index -> its first block id (a source block has `sub` ids)
    alloc = [0]  # the next free block id
    smallest = min(x.block_size for x in raw)
    sessions = [Session(s.session_id, tuple(_number_turns(
        s, turns, lengths, (table, starts, alloc), s.block_size // smallest, block_size, time_scale,
        max_think_s, warm if s.prefix_tokens is not None else 0))) for s, turns, lengths in kept]
    return Workload(name, source, fmt, block_size, float(token_scale), float(time_scale),
                    float(max_think_s), tuple(sessions))


def check_replay_options(truncate_input_tokens=None, warm_prefix_fraction: float = 0.0) -> None:
    """Validate the replay-tool options of :func:`load_trace` / :func:`generate_workload`.

    Raises:
        ValueError: ``truncate_input_tokens`` is not None or an int >= 1 (tokens), or
            ``warm_prefix_fraction`` is not a number in [0, 1].
    """
    v = truncate_input_tokens
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ValueError(f"truncate_input_tokens must be None or an int >= 1, got {v!r}")
    f = warm_prefix_fraction
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f <= 1:
        raise ValueError(f"warm_prefix_fraction must be a number in [0, 1], got {f!r}")


def _number_turns(s: _RawSession, turns, lengths, ids: tuple, sub: int, block_size: int,
                  time_scale: float, max_think_s: float, warm_tokens: int = 0):
    """Turns with global block ids; a source block of ``sub`` workload blocks gets ``sub`` ids.

    With one source block size everywhere, ``sub == 1`` and the block id is the dense index.
    The first ``warm_tokens // s.block_size`` full blocks of the first turn get the warm
    prefix's keys by position (-1, -2, ... for 64-token source blocks: the same in every
    session with that block size), and every later occurrence of their local ids the same keys.
    """
    table, starts, alloc = ids
    base, tail_base = (2 * s.namespace) * _MAX_LOCAL_ID, (2 * s.namespace + 1) * _MAX_LOCAL_ID
    n_warm = min(warm_tokens // s.block_size, turns[0].in_tokens // s.block_size)
    warm_keys = [-1 - i - s.block_size * _MAX_LOCAL_ID for i in range(n_warm)]
    warm: dict[int, int] = {}
    for h, key in zip(turns[0].hash_ids, warm_keys):
        warm.setdefault(h, key)
    prev_ids: list[int] = []
    prev_gids: list[int] = []
    for k, (t, (n_in, n_out)) in enumerate(zip(turns, lengths)):
        lcp = _common_prefix(t.hash_ids, prev_ids)  # same namespace: equal ids, equal blocks
        first = warm_keys if k == 0 else []
        gids = prev_gids[:lcp] + [table.setdefault(first[i] if i < len(first) else warm.get(h, base + h),
                                                   len(table))
                                  for i, h in enumerate(t.hash_ids[lcp:], lcp)]
        if t.tail is not None:
            gids.append(table.setdefault(tail_base + t.tail, len(table)))
        while len(starts) < len(table):  # the new indexes, all from this session
            starts.append(alloc[0])
            alloc[0] += sub
        nb = -(-n_in // block_size)
        if sub == 1 and alloc[0] == len(starts):  # every index has one id: starts[i] == i
            block_ids = tuple(gids[:nb])
        else:
            first = np.asarray(starts, dtype=np.int64)[np.asarray(gids, dtype=np.int64)]
            block_ids = tuple((first[:, None] + np.arange(sub)).ravel()[:nb].tolist())
        think = 0.0 if k == 0 else min(t.think_s * time_scale, max_think_s)
        prev_ids, prev_gids = t.hash_ids, gids
        yield Turn(n_in, n_out, block_ids, float(think), t.stop)
