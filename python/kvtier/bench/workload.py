"""Coding-agent workloads for replay: load recorded traces or generate a seeded synthetic one.

A :class:`Workload` is a list of closed-loop :class:`Session` s. Turn ``k`` of a session is
submitted ``think_time_s`` after turn ``k-1`` finished; its prompt is described by
``block_ids``, one id per block of ``Workload.block_size`` tokens (the last block may be
partial). Equal ids mean equal token content, so the prefix structure of the source is kept
exactly; :func:`prompt_token_ids` turns a turn into concrete token ids.

Sources (see ``../shared/docs/WORKLOAD.md`` and ``../shared/traces/SOURCE.md``):

- **kv-cache-tester** (``*.json`` / ``*.json.gz``, one Claude Code session per file, 64-token
  blocks, ids local to the file). Facts measured on the 194 files in ``shared/traces``
  (13,857 requests), which this loader relies on:

  * ``len(hash_ids) == floor(in / block_size)`` for every request: the ids cover the *full*
    blocks only, and the ``in % block_size`` trailing tokens have no id. The loader gives such
    a tail a fresh id of its own (never shared), so a turn always has
    ``ceil(in / block_size)`` blocks. ``len == ceil(in / block_size)`` (last id covers the
    partial block) is accepted too; anything else is a :class:`TraceError`.
  * Sub-agent ids live in the *same* id space as their file: sibling sub-agents share their
    leading ids (19 of 19 sibling pairs share a common system/tool prompt), and no sub-agent
    id appears in its parent (0 of 17). So ids are namespaced per file, not per session:
    siblings share blocks exactly where the source says so, files never share.
  * ``out`` is 0 in 7 requests (aborted streams); ``out >= 0`` is accepted and replayed as 1
    token. ``in`` must be ``>= 1``.
  * ``think_time`` is absent in 22 requests (all after a request without ``api_time``). It
    is then derived from the timestamps: ``max(0, t_k - t_{k-1} - api_time_{k-1})``, the
    relation the other requests satisfy to within the 1 s rounding of ``t``.
  * A sub-agent becomes its own session ``"<parent id>/<agent_id>"`` placed right after its
    parent; the replay starts it like any other session, when a slot frees (its offset inside
    the parent is not modelled), and ``max_sessions`` counts it as a session.

- **Mooncake** (``*.jsonl``: ``timestamp`` ms, ``input_length``, ``output_length``,
  ``hash_ids`` of 512-token prefix-chained blocks, ids global to the file). There are no
  session ids, so sessions are inferred: a request whose ``hash_ids`` start with all the
  *full-block* ids of some session's latest turn (its first ``input_length // 512`` ids)
  continues the session with the longest such list (ties: the earliest session); otherwise it
  starts a new one. The latest turn's partial last block is left out of the match because the
  next prompt fills that block, which gives it a new prefix hash: matching the whole list
  chains 126 of the 12,031 conversation requests, matching full blocks 5,286 (6,745 sessions).
  A latest turn with no full block (< 512 tokens) is never continued. ``think_time`` is the
  arrival gap ``max(0, timestamp - previous turn's timestamp) / 1000``: this *approximates*
  think time by inter-arrival time (it includes the previous turn's service time).
  Measured: ``len(hash_ids) == ceil(input_length / 512)`` in all 16,024 requests.

Token scaling keeps the block structure: with ``B = source block size * token_scale`` (an
integer >= 1) and ``n`` source blocks, ``input_tokens = clamp(round(in * token_scale),
(n-1)*B + 1, n*B)`` and ``output_tokens = max(1, round(out * token_scale))``. Times:
``think_time_s = min(think_time * time_scale, max_think_s)``, 0 for a first turn.
"""

from __future__ import annotations

import gzip
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = [
    "Session",
    "TraceError",
    "check_replay_options",
    "Turn",
    "Workload",
    "generate_workload",
    "load_trace",
    "prompt_token_ids",
]

KV_CACHE_TESTER = "kv-cache-tester"
MOONCAKE = "mooncake"
BUILTIN = "builtin"
MIXED = "mixed"  # a folder holding both formats

KV_DEFAULT_BLOCK_SIZE = 64  # kv-cache-tester files carry "block_size"; 64 when absent
MOONCAKE_BLOCK_SIZE = 512  # Mooncake FAST'25 README: hash_ids are 512-token blocks
STOPS = ("tool_use", "end_turn", "")

_MAX_LOCAL_ID = 2**40  # local hash ids must be in [0, 2**40); keys pack (namespace, id)


class TraceError(ValueError):
    """A trace file is malformed; the message names the file, the line or request, and what."""


@dataclass(frozen=True)
class Turn:
    """One request of a session.

    Attributes:
        input_tokens: prompt length in tokens after token scaling, >= 1.
        output_tokens: response length in tokens after token scaling, >= 1.
        block_ids: ``[ceil(input_tokens / block_size)]`` ints, one id per block of
            ``Workload.block_size`` tokens covering the prompt (the last may be partial).
            Ids are global in the workload; equal ids mean equal token content.
        think_time_s: seconds between the previous turn's finish and this turn's submission,
            after time scaling and capping; 0 for the first turn.
        stop: why the source response stopped: ``"tool_use"``, ``"end_turn"`` or ``""``.
        chat: the turn's text (:class:`kvtier.bench.conversations.ChatTurn`) for a text
            workload, encoded at submission; None for traces, whose prompts come from
            :func:`prompt_token_ids`.
    """

    input_tokens: int
    output_tokens: int
    block_ids: tuple[int, ...]
    think_time_s: float
    stop: str
    chat: object | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Session:
    """A closed-loop sequence of turns, e.g. ``"trace_0006"`` or ``"trace_0010/agent_001"``."""

    session_id: str
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class Workload:
    """Sessions to replay plus how they were made.

    Attributes:
        name: short label (file or folder stem, or ``"builtin-seed<S>"``).
        source: the trace path, or ``"builtin"``.
        format: ``"kv-cache-tester"``, ``"mooncake"``, ``"builtin"``, or ``"mixed"`` for a
            folder holding both trace formats.
        block_size: tokens per block after scaling (smallest source block size * token_scale).
        token_scale, time_scale, max_think_s: the scaling that was applied.
        sessions: in source order (sub-agents right after their parent).
    """

    name: str
    source: str
    format: str
    block_size: int
    token_scale: float
    time_scale: float
    max_think_s: float
    sessions: tuple[Session, ...]

    def num_requests(self) -> int:
        """Total number of turns over all sessions."""
        return sum(len(s.turns) for s in self.sessions)


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


def _where(path: Path, loc: str) -> str:
    return f"{path}: {loc}"


def _get_int(obj: dict, key: str, path: Path, loc: str, *, minimum: int) -> int:
    if key not in obj:
        raise TraceError(f"{_where(path, loc)}: missing field {key!r}")
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise TraceError(f"{_where(path, loc)}: field {key!r} must be an int, got {v!r}")
    if v < minimum:
        raise TraceError(f"{_where(path, loc)}: field {key!r} must be >= {minimum}, got {v}")
    return v


def _get_float(obj: dict, key: str, path: Path, loc: str, default: float | None = None) -> float:
    if key not in obj:
        if default is None:
            raise TraceError(f"{_where(path, loc)}: missing field {key!r}")
        return default
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise TraceError(f"{_where(path, loc)}: field {key!r} must be a finite number >= 0, got {v!r}")
    return float(v)


def _get_hash_ids(obj: dict, n_tokens: int, block_size: int, path: Path, loc: str) -> tuple[list[int], bool]:
    """Validated ``hash_ids``; the flag says whether an id-less partial tail block follows."""
    if "hash_ids" not in obj:
        raise TraceError(f"{_where(path, loc)}: missing field 'hash_ids'")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(type(h) is int and 0 <= h < _MAX_LOCAL_ID for h in ids):
        raise TraceError(f"{_where(path, loc)}: 'hash_ids' must be a list of ints in [0, 2**40)")
    full, ceil = n_tokens // block_size, -(-n_tokens // block_size)
    if len(ids) not in (full, ceil):
        raise TraceError(
            f"{_where(path, loc)}: {len(ids)} hash_ids for {n_tokens} input tokens; expected "
            f"floor or ceil({n_tokens} / {block_size}) = {full} or {ceil}")
    return ids, len(ids) < ceil


# ---------------------------------------------------------------------------------------------
# kv-cache-tester


def _read_json(path: Path):
    try:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise TraceError(f"{path}: line {e.lineno}: malformed JSON: {e.msg}") from e
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise TraceError(f"{path}: cannot read: {e}") from e


def _kv_request(r: dict, path: Path, loc: str, block_size: int, prev: dict | None, tail_id: int):
    n_in = _get_int(r, "in", path, loc, minimum=1)
    n_out = _get_int(r, "out", path, loc, minimum=0)
    ids, has_tail = _get_hash_ids(r, n_in, block_size, path, loc)
    t = _get_float(r, "t", path, loc)
    if prev is None:
        think = 0.0
    else:  # absent in 22 real requests: derive it from the timestamps (module docstring)
        gap = t - _get_float(prev, "t", path, loc) - _get_float(prev, "api_time", path, loc, default=0.0)
        think = _get_float(r, "think_time", path, loc, default=max(0.0, gap))
    stop = r.get("stop", "")
    if not isinstance(stop, str):
        raise TraceError(f"{_where(path, loc)}: field 'stop' must be a string, got {stop!r}")
    return _RawTurn(n_in, n_out, ids, tail_id if has_tail else None, think,
                    stop if stop in STOPS else "")


def _kv_session(reqs, session_id: str, path: Path, loc: str, ns: int, block_size: int,
                tails: list[int], out: list[_RawSession], prefix_tokens: int,
                parent: str | None = None, start_turn: int = 0) -> None:
    """Append the session at ``loc`` and then, in order, the sub-agent sessions it starts."""
    if not isinstance(reqs, list):
        raise TraceError(f"{_where(path, loc + 'requests')}: must be a list, got {type(reqs).__name__}")
    session = _RawSession(session_id, ns, block_size, [], prefix_tokens, parent, start_turn)
    out.append(session)
    prev = None
    for i, r in enumerate(reqs):
        rloc = f"{loc}requests[{i}]"
        if not isinstance(r, dict):
            raise TraceError(f"{_where(path, rloc)}: request must be an object, got {type(r).__name__}")
        kind = r.get("type")
        if kind == "subagent":
            agent = r.get("agent_id")
            if not isinstance(agent, str) or not agent:
                raise TraceError(f"{_where(path, rloc)}: sub-agent needs a string 'agent_id'")
            _kv_session(r.get("requests"), f"{session_id}/{agent}", path, f"{rloc}.subagent.",
                        ns, block_size, tails, out, prefix_tokens, session_id, len(session.turns))
            continue
        if kind not in ("s", "n"):
            raise TraceError(f"{_where(path, rloc)}: field 'type' must be 's', 'n' or 'subagent', "
                             f"got {kind!r}")
        tails[0] += 1
        session.turns.append(_kv_request(r, path, rloc, block_size, prev, tails[0]))
        prev = r
    if not session.turns:
        raise TraceError(f"{_where(path, loc + 'requests')}: session {session_id!r} has no requests")


def _read_kv_cache_tester(path: Path, doc: dict, ns: int) -> list[_RawSession]:
    block_size = _get_int(doc, "block_size", path, "top level", minimum=1) if "block_size" in doc \
        else KV_DEFAULT_BLOCK_SIZE
    scope = doc.get("hash_id_scope", "local")
    if scope != "local":
        raise TraceError(f"{path}: hash_id_scope {scope!r} not supported (only 'local')")
    sid = doc.get("id", path.name.split(".")[0])
    if not isinstance(sid, str) or not sid:
        raise TraceError(f"{path}: field 'id' must be a non-empty string, got {sid!r}")
    prefix = sum(_get_int(doc, k, path, "top level", minimum=0) if k in doc else 0
                 for k in ("tool_tokens", "system_tokens"))
    out: list[_RawSession] = []
    _kv_session(doc["requests"], sid, path, "", ns, block_size, [0], out, prefix)
    return out


# ---------------------------------------------------------------------------------------------
# Mooncake


def _mooncake_lines(path: Path):
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                except json.JSONDecodeError as e:
                    raise TraceError(f"{path}: line {lineno}: malformed JSON: {e.msg}") from e
                if not isinstance(r, dict):
                    raise TraceError(f"{path}: line {lineno}: expected a JSON object")
                yield lineno, r
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"{path}: cannot read: {e}") from e


def _read_mooncake(path: Path, ns: int) -> list[_RawSession]:
    """Read a Mooncake JSONL and infer sessions by prefix extension (module docstring)."""
    sessions: list[_RawSession] = []
    last_ts: list[float] = []
    latest_full: list[list[int]] = []  # per session: ids of its latest turn's full blocks
    by_last_id: dict[int, list[int]] = {}  # latest_full[s][-1] -> sessions s, ascending
    stem = path.name.split(".")[0]
    for lineno, r in _mooncake_lines(path):
        loc = f"line {lineno}"
        n_in = _get_int(r, "input_length", path, loc, minimum=1)
        n_out = _get_int(r, "output_length", path, loc, minimum=0)
        ids, has_tail = _get_hash_ids(r, n_in, MOONCAKE_BLOCK_SIZE, path, loc)
        ts = _get_float(r, "timestamp", path, loc)
        s = _longest_extended(ids, latest_full, by_last_id)
        if s is None:
            s = len(sessions)
            sessions.append(_RawSession(f"{stem}/s{s:05d}", ns, MOONCAKE_BLOCK_SIZE, []))
            last_ts.append(ts)
            latest_full.append([])
        elif latest_full[s]:
            by_last_id[latest_full[s][-1]].remove(s)
        think = max(0.0, ts - last_ts[s]) / 1000.0 if sessions[s].turns else 0.0
        sessions[s].turns.append(_RawTurn(n_in, n_out, ids, lineno if has_tail else None, think, ""))
        last_ts[s] = ts
        latest_full[s] = ids[: n_in // MOONCAKE_BLOCK_SIZE]
        if latest_full[s]:
            bucket = by_last_id.setdefault(latest_full[s][-1], [])
            bucket.append(s)
            bucket.sort()
    return sessions


def _longest_extended(ids: list[int], latest_full: list[list[int]], by_last_id: dict) -> int | None:
    """The earliest session whose latest turn's full-block ids are the longest prefix of ``ids``."""
    for k in range(len(ids), 0, -1):
        for s in by_last_id.get(ids[k - 1], ()):
            prev = latest_full[s]
            if len(prev) == k and prev == ids[:k]:
                return s
    return None


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
              truncate_input_tokens=None, warm_prefix_fraction: float = 0.0) -> Workload:
    """Scale, filter (max_turns, truncate_input_tokens, max_input_tokens, then max_sessions),
    share the warm prefix and number blocks."""
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
        if max_sessions is not None and len(kept) == max_sessions:
            break
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


# ---------------------------------------------------------------------------------------------
# Public loaders


def _trace_files(path: Path) -> list[Path]:
    if not path.exists():
        raise FileNotFoundError(f"trace path does not exist: {path}")
    if path.is_file():
        return [path]
    files = sorted(p for p in path.iterdir() if p.is_file()
                   and (p.name.endswith((".json", ".json.gz", ".jsonl"))))
    if not files:
        raise TraceError(f"{path}: folder holds no *.json, *.json.gz or *.jsonl trace files")
    return files


def _read_file(path: Path, ns: int) -> tuple[str, list[_RawSession]]:
    if path.name.endswith(".jsonl"):
        return MOONCAKE, _read_mooncake(path, ns)
    if path.name.endswith((".json", ".json.gz")):
        doc = _read_json(path)
        if isinstance(doc, dict) and "requests" in doc:
            return KV_CACHE_TESTER, _read_kv_cache_tester(path, doc, ns)
        raise TraceError(f"{path}: unknown trace format: expected an object with 'requests' "
                         "(kv-cache-tester)")
    raise TraceError(f"{path}: unknown trace format: expected *.json, *.json.gz (kv-cache-tester) "
                     "or *.jsonl (Mooncake)")


def load_trace(path, *, token_scale: float = 1.0, time_scale: float = 1.0,
               max_think_s: float = float("inf"), max_sessions: int | None = None,
               max_turns: int | None = None, max_input_tokens: int | None = None,
               truncate_input_tokens: int | None = None,
               warm_prefix_fraction: float = 0.0) -> Workload:
    """Load a kv-cache-tester or Mooncake trace (a file, or a folder of them) as a workload.

    Args:
        path: a ``*.json`` / ``*.json.gz`` (kv-cache-tester) or ``*.jsonl`` (Mooncake) file, or
            a folder: every such file in sorted name order, formats may be mixed. Block ids
            are namespaced per file (files never share blocks).
        token_scale: multiplies every length; ``source block size * token_scale`` must be an
            integer >= 1 for every file (64-token blocks: 1, 1/2, ..., 1/64; Mooncake 512).
        time_scale: multiplies think times (0: no waiting).
        max_think_s: cap on each scaled think time, seconds.
        max_sessions: keep the first N sessions (after the other filters).
        max_turns: keep the first N turns of each session.
        max_input_tokens: drop every session with a (kept) turn whose scaled prompt is longer;
            whole sessions go, so the prefix structure of the ones kept stays intact.
        truncate_input_tokens: end each session before its first turn whose scaled prompt is
            longer; a session whose first turn is longer is dropped, and so are the
            sub-agents it starts. This is kv-cache-tester's ``trace_replay_tester.py
            --max-context`` (default 128,000 there): it drops such traces and stops a user at
            the first request over the limit. Applied before ``max_input_tokens``.
        warm_prefix_fraction: the replay tool's ``--warm-prefix-pct`` (0.5 there): the first
            ``int(fraction * max(tool_tokens + system_tokens))`` tokens (the maximum over the
            kept kv-cache-tester sessions) of every session's first prompt are one canonical
            prefix, the same in all sessions and sub-agents, as Claude Code's tool definitions
            and system prompt are. Its full source blocks get the same ids everywhere (every
            later turn that keeps them too); Mooncake sessions are left as they are.

    Returns:
        Workload with ``format`` ``"kv-cache-tester"``, ``"mooncake"`` or ``"mixed"``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        TraceError: unknown format, malformed JSON, missing or ill-typed field, bad length,
            ``hash_ids`` count inconsistent with the input length, empty folder, or two
            sessions with the same id; the message names the file and line or request.
        ValueError: a scale or limit out of range.

    Example:
        >>> wl = load_trace("../shared/traces/kv-cache-tester", token_scale=1/64)  # doctest: +SKIP
        >>> wl.block_size  # doctest: +SKIP
        1
    """
    path = Path(path)
    raw: list[_RawSession] = []
    formats = set()
    for ns, f in enumerate(_trace_files(path)):
        fmt, sessions = _read_file(f, ns)
        if not sessions:
            raise TraceError(f"{f}: no requests in this trace file")
        formats.add(fmt)
        raw.extend(sessions)
    seen: dict[str, int] = {}
    for s in raw:
        if s.session_id in seen:
            raise TraceError(f"{path}: session id {s.session_id!r} appears twice "
                             f"(files {seen[s.session_id]} and {s.namespace} in sorted order)")
        seen[s.session_id] = s.namespace
    fmt = formats.pop() if len(formats) == 1 else MIXED
    name = path.name.split(".")[0]
    return _assemble(raw, name=name, source=str(path), fmt=fmt, token_scale=token_scale,
                     time_scale=time_scale, max_think_s=max_think_s, max_sessions=max_sessions,
                     max_turns=max_turns, max_input_tokens=max_input_tokens,
                     truncate_input_tokens=truncate_input_tokens,
                     warm_prefix_fraction=warm_prefix_fraction)


# ---------------------------------------------------------------------------------------------
# Synthetic workload
#
# Quantiles (p10, p50, p90) of a split lognormal: below the median log-spread from p10/p50,
# above it from p50/p90, so all three quantiles are met exactly. Sources: WORKLOAD.md's table
# (710 sessions) unless marked "local" (measured on the 194 kv-cache-tester files in
# shared/traces, parent requests only).

GEN_BLOCK_SIZE = 64  # source tokens per block, as kv-cache-tester
# WORKLOAD.md: requests per session p10/p50/p90.
REQUESTS_PER_SESSION_Q = (7, 45, 155)
# local: median tool_tokens 12,439 + median system_tokens 2,774. WORKLOAD.md: ~12K + ~2.8K
# tokens "repeat across sessions", so every session starts with the same 15,213 tokens
# (237 full 64-token blocks with the same ids in every session).
SHARED_PREFIX_TOKENS = 15_213
# local: first request `in` p10/p50/p90 = 16,008 / 22,452 / 204,560, minus the shared prefix.
FIRST_EXTRA_TOKENS_Q = (795, 7_239, 189_347)
# WORKLOAD.md: new tokens per turn (in_k - in_{k-1} - out_{k-1}) p50 284, p90 3.0K. Its p10
# is -3 (shrinking contexts, compaction): not modelled; the lower half is spread so p10 = 1.
NEW_TOKENS_Q = (1, 284, 3_000)
# WORKLOAD.md: output tokens per request p10/p50/p90.
OUTPUT_TOKENS_Q = (105, 216, 898)
# WORKLOAD.md: think_time (s) after a tool_use stop, and after an end_turn stop.
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
    """A seeded synthetic coding-agent workload with WORKLOAD.md's measured statistics.

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


# ---------------------------------------------------------------------------------------------
# Token ids

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer on a uint64 array (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


def _multiplier(span: int) -> int:
    a = 0x9E3779B1 % span or 1
    while math.gcd(a, span) != 1:
        a += 1
    return a


def prompt_token_ids(turn: Turn, block_size: int, vocab_size: int, *, low: int = 0) -> list[int]:
    """The prompt of ``turn`` as token ids: block id -> ``block_size`` tokens, concatenated.

    Each block's tokens are a pure function of (block id, position in block, ``vocab_size``,
    ``low``), so equal ids give equal tokens in every turn and session. The first token is
    ``low + (a * id + c) mod span`` with ``span = vocab_size - low`` and ``a`` coprime to
    ``span``: a bijection, so ids that differ by less than ``span`` (every id of a workload
    with fewer than ``span`` distinct blocks, ids being dense from 0) are guaranteed distinct
    blocks. The other tokens are a splitmix64 hash of (id, position) reduced mod ``span``;
    two ids that share a first token (ids ``span`` apart) are equal blocks with probability
    about ``span ** -(block_size - 1)``.

    Args:
        turn: its ``block_ids`` ``[ceil(input_tokens / block_size)]`` and ``input_tokens``.
        block_size: tokens per block, ``Workload.block_size``.
        vocab_size: tokens are in ``[low, vocab_size)``; ``vocab_size <= 2**32``.
        low: smallest token id to use (e.g. to skip special tokens).

    Returns:
        ``input_tokens`` ints (the last block cut short).

    Raises:
        ValueError: ``low >= vocab_size``, or ``len(turn.block_ids)`` does not match
            ``ceil(turn.input_tokens / block_size)``.

    Example:
        >>> t = Turn(input_tokens=5, output_tokens=1, block_ids=(7, 3), think_time_s=0.0, stop="")
        >>> len(prompt_token_ids(t, 4, 1000))
        5
    """
    span = vocab_size - low
    if low < 0 or span < 1 or vocab_size > 2**32:
        raise ValueError(f"need 0 <= low < vocab_size <= 2**32, got low={low}, vocab_size={vocab_size}")
    if block_size < 1 or len(turn.block_ids) != -(-turn.input_tokens // block_size):
        raise ValueError(f"turn has {len(turn.block_ids)} block ids for {turn.input_tokens} tokens; "
                         f"block_size={block_size} needs {-(-turn.input_tokens // max(block_size, 1))}")
    ids = np.asarray(turn.block_ids, dtype=np.uint64)
    span64 = np.uint64(span)
    first = (ids % span64) * np.uint64(_multiplier(span)) + np.uint64(0x7F4A7C15 % span)
    pos = np.arange(block_size, dtype=np.uint64)
    tokens = _mix64(ids[:, None] * _GOLDEN + (pos + np.uint64(1)) * _MIX2) % span64
    tokens[:, 0] = first % span64
    return (tokens.ravel()[: turn.input_tokens] + np.uint64(low)).astype(np.int64).tolist()
