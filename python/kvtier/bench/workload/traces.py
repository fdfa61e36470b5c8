"""Trace loaders: recorded coding-agent sessions as a :class:`~kvtier.bench.workload.Workload`.

Sources (see ``docs/workload.md`` and ``../shared/traces/SOURCE.md``):

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
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

from kvtier.bench.workload.scaling import _assemble, _RawSession, _RawTurn
from kvtier.bench.workload.types import (
    _MAX_LOCAL_ID,
    KV_CACHE_TESTER,
    KV_DEFAULT_BLOCK_SIZE,
    MIXED,
    MOONCAKE,
    MOONCAKE_BLOCK_SIZE,
    STOPS,
    TraceError,
    Workload,
)

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
    if not isinstance(ids, list) or (ids and (set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) >= _MAX_LOCAL_ID)):
        raise TraceError(f"{_where(path, loc)}: 'hash_ids' must be a list of ints in [0, 2**40)")
    full, ceil = n_tokens // block_size, -(-n_tokens // block_size)
    if len(ids) not in (full, ceil):
        raise TraceError(
            f"{_where(path, loc)}: {len(ids)} hash_ids for {n_tokens} input tokens; expected "
            f"floor or ceil({n_tokens} / {block_size}) = {full} or {ceil}")
    return ids, len(ids) < ceil


# ---------------------------------------------------------------------------------------------
# kv-cache-tester


def read_json(path: Path):
    """The JSON document in ``path`` (gzip-compressed when its name ends in ``.gz``).

    Raises:
        TraceError: the file is not valid JSON (names the file and line).
    """
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
        doc = read_json(path)
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
               warm_prefix_fraction: float = 0.0, sample_seed: int | None = None) -> Workload:
    """Load a kv-cache-tester or Mooncake trace (a file, or a folder of them) as a workload.

    Args:
        path: a ``*.json`` / ``*.json.gz`` (kv-cache-tester) or ``*.jsonl`` (Mooncake) file, or
            a folder: every such file in sorted name order, formats may be mixed. Block ids
            are namespaced per file (files never share blocks).
        token_scale: multiplies every length; ``source block size * token_scale`` must be an
            integer >= 1 for every file (64-token blocks: 1, 1/2, ..., 1/64; Mooncake 512).
        time_scale: multiplies think times (0: no waiting).
        max_think_s: cap on each scaled think time, seconds.
        max_sessions: keep the first N sessions (after the other filters), or with
            ``sample_seed`` N of them drawn at random (see below).
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
        sample_seed: None keeps the first ``max_sessions``; an int draws ``max_sessions`` of
            the sessions left after the other filters without replacement, with
            ``numpy.random.default_rng(sample_seed)``, and keeps them in source order (the
            same seed gives the same sessions). A sub-agent is drawn like any session.

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
                     warm_prefix_fraction=warm_prefix_fraction, sample_seed=sample_seed)
