"""Workloads: replay fidelity against the raw trace files, session inference, the generator,
bad traces, and the session/turn limits.

The real traces are read from ``../shared/traces`` next to the repository (never copied into
it); the tests that need them are skipped when that folder is absent.
"""

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest
from kvtier.bench.workload import (
    SHARED_PREFIX_TOKENS,
    TraceError,
    Turn,
    generate_workload,
    load_trace,
    prompt_token_ids,
)

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
TRACES = SHARED / "traces"
KV_DIR = TRACES / "kv-cache-tester"
CONVERSATION = TRACES / "conversation_trace.jsonl"
needs_traces = pytest.mark.skipif(
    not KV_DIR.is_dir() or not CONVERSATION.is_file(),
    reason=f"trace data not found under {TRACES} (expected ../shared next to the repository)")

VOCAB = 163840  # Kimi K2 / DeepSeek-V3 vocabulary
# Sessions chosen to cover: plain .json, .json.gz, sub-agents (0291: 2, 0277: 4), out == 0 and
# missing think_time (0553), missing think_time after empty-stop requests (0130), short ones.
KV_FILES = ["trace_0006.json", "trace_0130.json.gz", "trace_0165.json.gz", "trace_0277.json.gz",
            "trace_0291.json", "trace_0369.json.gz", "trace_0546.json.gz", "trace_0553.json.gz",
            "trace_0598.json.gz"]
MOONCAKE_LINES = 300


# ---------------------------------------------------------------------------------------------
# Helpers


def read_raw_kv(path):
    """[(session_id, [request dicts])] straight from the JSON: parent, then its sub-agents."""
    with (gzip.open(path, "rt") if path.name.endswith(".gz") else open(path)) as f:
        doc = json.load(f)
    out = []

    def walk(reqs, sid):
        out.append((sid, [r for r in reqs if r["type"] != "subagent"]))
        for r in reqs:
            if r["type"] == "subagent":
                walk(r["requests"], f"{sid}/{r['agent_id']}")

    walk(doc["requests"], doc["id"])
    return out


def expected_input(n_src, n_blocks, block_size, token_scale):
    return min(max(round(n_src * token_scale), (n_blocks - 1) * block_size + 1), n_blocks * block_size)


def assert_blocks_follow_source(wl, source_keys):
    """Token block i of any two prompts is equal iff their source keys are equal.

    ``source_keys[s][t]`` holds one int per block of turn t of session s. Checked as: equal keys
    give equal tokens (full blocks entirely, a partial block as a prefix of the full one) and
    distinct keys give distinct first tokens, which makes any two blocks differ.
    """
    B = wl.block_size
    keys, firsts, full_keys, full_rows, partial = [], [], [], [], []
    for sess, sess_keys in zip(wl.sessions, source_keys, strict=True):
        for turn, k in zip(sess.turns, sess_keys, strict=True):
            toks = np.asarray(prompt_token_ids(turn, B, VOCAB))
            k = np.asarray(k, dtype=np.int64)
            assert len(toks) == turn.input_tokens and len(k) == len(turn.block_ids)
            assert toks.min() >= 0 and toks.max() < VOCAB
            nfull = len(toks) // B
            keys.append(k)
            firsts.append(toks[::B])
            full_keys.append(k[:nfull])
            full_rows.append(toks[: nfull * B].reshape(nfull, B))
            if nfull < len(k):
                partial.append((int(k[-1]), toks[nfull * B:]))
    keys, firsts = np.concatenate(keys), np.concatenate(firsts)
    uniq, first_at, inv = np.unique(keys, return_index=True, return_inverse=True)
    assert np.array_equal(firsts, firsts[first_at][inv]), "equal source ids gave different tokens"
    assert len(np.unique(firsts[first_at])) == len(uniq), "different source ids gave equal blocks"
    full_keys, full_rows = np.concatenate(full_keys), np.concatenate(full_rows)
    fu, f_at, f_inv = np.unique(full_keys, return_index=True, return_inverse=True)
    assert np.array_equal(full_rows, full_rows[f_at][f_inv]), "equal source ids gave different blocks"
    canon = dict(zip(fu.tolist(), full_rows[f_at]))
    for key, toks in partial:
        if key in canon:
            assert np.array_equal(canon[key][: len(toks)], toks)
    return len(uniq)


# ---------------------------------------------------------------------------------------------
# kv-cache-tester replay fidelity


@pytest.fixture(scope="module")
def kv_folder(tmp_path_factory):
    """A folder of symlinks to the chosen real files (no copies)."""
    d = tmp_path_factory.mktemp("kv")
    for name in KV_FILES:
        (d / name).symlink_to(KV_DIR / name)
    return d


@needs_traces
@pytest.mark.parametrize("token_scale", [1.0, 1 / 64])
def test_kv_cache_tester_replay_follows_raw_json(kv_folder, token_scale):
    time_scale, cap = 0.5, 100.0
    wl = load_trace(kv_folder, token_scale=token_scale, time_scale=time_scale, max_think_s=cap)
    B = round(64 * token_scale)
    assert (wl.format, wl.block_size, wl.source) == ("kv-cache-tester", B, str(kv_folder))
    raw = [(fi, sid, reqs) for fi, name in enumerate(sorted(KV_FILES))
           for sid, reqs in read_raw_kv(KV_DIR / name)]
    assert [s.session_id for s in wl.sessions] == [sid for _, sid, _ in raw]
    assert len(wl.sessions) >= 8 and any("/" in s.session_id for s in wl.sessions)
    source_keys, tail = [], 0
    for sess, (fi, sid, reqs) in zip(wl.sessions, raw):
        assert len(sess.turns) == len(reqs)
        sess_keys = []
        for t, (turn, r) in enumerate(zip(sess.turns, reqs)):
            ids = r["hash_ids"]
            assert len(ids) == r["in"] // 64  # the relation the loader documents
            n = math.ceil(r["in"] / 64)
            assert turn.input_tokens == expected_input(r["in"], n, B, token_scale)
            assert turn.output_tokens == max(1, round(r["out"] * token_scale))
            assert turn.stop == r["stop"]
            if t == 0:
                assert turn.think_time_s == 0.0
            else:
                prev = reqs[t - 1]
                think = r.get("think_time", max(0.0, r["t"] - prev["t"] - prev.get("api_time", 0.0)))
                assert turn.think_time_s == pytest.approx(min(think * time_scale, cap))
            k = [fi * 2**32 + h for h in ids]  # ids are local to the file, shared by its sub-agents
            if n > len(ids):
                tail += 1
                k.append(-tail)  # the id-less tail block: its own content
            sess_keys.append(k)
        source_keys.append(sess_keys)
    distinct = assert_blocks_follow_source(wl, source_keys)
    assert distinct == len({b for s in wl.sessions for t in s.turns for b in t.block_ids})


@needs_traces
def test_sub_agents_are_sessions_sharing_the_file_id_space():
    wl = load_trace(KV_DIR / "trace_0277.json.gz")
    raw = read_raw_kv(KV_DIR / "trace_0277.json.gz")
    assert [s.session_id for s in wl.sessions] == [sid for sid, _ in raw]
    parent, agents = wl.sessions[0], wl.sessions[1:]
    assert len(agents) == 4 and all(a.session_id.startswith("trace_0277/agent_") for a in agents)
    parent_ids = {b for t in parent.turns for b in t.block_ids}
    first = [a.turns[0].block_ids for a in agents]
    # Siblings start with the same sub-agent prompt: shared blocks, as the source ids say.
    assert all(f[:100] == first[0][:100] for f in first)
    assert not parent_ids & {b for a in agents for t in a.turns for b in t.block_ids}


@needs_traces
def test_mixed_folder_splits_mooncake_blocks(tmp_path):
    (tmp_path / "b_trace_0546.json.gz").symlink_to(KV_DIR / "trace_0546.json.gz")
    with open(CONVERSATION) as f:
        rows = [json.loads(next(f)) for _ in range(40)]
    write_jsonl(tmp_path / "a_conv.jsonl", rows)
    wl = load_trace(tmp_path, token_scale=1 / 16)
    assert (wl.format, wl.block_size) == ("mixed", 4)
    (sid, reqs), = read_raw_kv(KV_DIR / "trace_0546.json.gz")
    assert wl.sessions[-1].session_id == sid
    # The kv-cache-tester file sets the block size; a 512-token Mooncake block becomes 8 blocks.
    members = infer_sessions(rows)
    keys = [[[2**40 + h * 8 + j for h in rows[i]["hash_ids"] for j in range(8)]
             [: math.ceil(expected_input(rows[i]["input_length"], len(rows[i]["hash_ids"]), 32, 1 / 16) / 4)]
             for i in m] for m in members]
    keys.append([list(r["hash_ids"]) + [-i - 1] * (r["in"] % 64 > 0) for i, r in enumerate(reqs)])
    assert len(wl.sessions) == 1 + len(members)
    assert_blocks_follow_source(wl, keys)


# ---------------------------------------------------------------------------------------------
# Mooncake


def infer_sessions(rows):
    """Reference session inference, quadratic: continue the session whose latest turn's full
    blocks are the longest prefix of the request (earliest on ties), else start a new one."""
    sessions = []
    for i, r in enumerate(rows):
        best, best_len = None, 0
        for s, members in enumerate(sessions):
            last = rows[members[-1]]
            full = last["hash_ids"][: last["input_length"] // 512]
            if full and r["hash_ids"][: len(full)] == full and len(full) > best_len:
                best, best_len = s, len(full)
        if best is None:
            sessions.append([i])
        else:
            sessions[best].append(i)
    return sessions


@needs_traces
@pytest.mark.parametrize("token_scale", [1.0, 1 / 64])
def test_mooncake_replay_follows_raw_jsonl(tmp_path, token_scale):
    with open(CONVERSATION) as f:
        lines = [next(f) for _ in range(MOONCAKE_LINES)]
    path = tmp_path / "conversation_head.jsonl"
    path.write_text("".join(lines))
    rows = [json.loads(x) for x in lines]
    wl = load_trace(path, token_scale=token_scale, time_scale=2.0)
    B = round(512 * token_scale)
    assert (wl.format, wl.block_size) == ("mooncake", B)
    ref = infer_sessions(rows)
    assert [s.session_id for s in wl.sessions] == [f"conversation_head/s{i:05d}" for i in range(len(ref))]
    assert any(len(m) >= 3 for m in ref)  # the head has real multi-turn chains
    source_keys = []
    for sess, members in zip(wl.sessions, ref, strict=True):
        assert len(sess.turns) == len(members)
        for t, (turn, i) in enumerate(zip(sess.turns, members)):
            r = rows[i]
            assert len(r["hash_ids"]) == math.ceil(r["input_length"] / 512)
            assert turn.input_tokens == expected_input(r["input_length"], len(r["hash_ids"]), B, token_scale)
            assert turn.output_tokens == max(1, round(r["output_length"] * token_scale))
            gap = 0.0 if t == 0 else max(0, r["timestamp"] - rows[members[t - 1]]["timestamp"]) / 1000
            assert turn.think_time_s == pytest.approx(gap * 2.0) and turn.stop == ""
        source_keys.append([rows[i]["hash_ids"] for i in members])
    assert_blocks_follow_source(wl, source_keys)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_mooncake_session_inference_on_a_small_trace(tmp_path):
    def row(ts, ids, n_in=None):
        return {"timestamp": ts, "input_length": n_in or 512 * len(ids), "output_length": 10, "hash_ids": ids}

    rows = [
        row(0, [1, 2]),                      # 0: new session A
        row(1000, [1, 3]),                   # 1: does not start with [1, 2]: new session B
        row(3000, [1, 2, 4], 1500),          # 2: extends A; its last block is partial
        row(3500, [1, 3, 5]),                # 3: extends B
        row(4000, [1, 2, 7, 8]),             # 4: extends A's full blocks [1, 2] (4 was partial)
        row(4100, [1, 2, 9]),                # 5: A's latest is [1, 2, 7, 8] now: new session C
        row(4000, [1, 3, 5, 6]),             # 6: extends B
        row(3000, [1, 3, 5, 6, 10]),         # 7: extends B; timestamp went back: think 0
        row(5000, [1]),                      # 8: no latest turn is a prefix: new session D
        row(6000, [1, 11]),                  # 9: D's [1] is the longest matching prefix
        row(6500, [2], 100),                 # 10: under one block: new session E ...
        row(7000, [2, 12]),                  # 11: ... never continued (no full block): new F
    ]
    wl = load_trace(write_jsonl(tmp_path / "small.jsonl", rows), time_scale=1.0)
    turns = {s.session_id: s.turns for s in wl.sessions}
    assert list(turns) == [f"small/s{i:05d}" for i in range(6)]
    assert [len(t) for t in turns.values()] == [3, 4, 1, 2, 1, 1]
    assert infer_sessions(rows) == [[0, 2, 4], [1, 3, 6, 7], [5], [8, 9], [10], [11]]
    assert [t.think_time_s for t in turns["small/s00000"]] == [0.0, 3.0, 1.0]
    assert [t.think_time_s for t in turns["small/s00001"]] == [0.0, 2.5, 0.5, 0.0]
    a = turns["small/s00000"]
    assert a[1].block_ids[:2] == a[0].block_ids and a[2].block_ids[:2] == a[0].block_ids
    assert a[2].block_ids[2] != a[1].block_ids[2]


# ---------------------------------------------------------------------------------------------
# Generator


def test_generator_is_deterministic_per_seed():
    a = generate_workload(num_sessions=6, seed=5)
    assert a == generate_workload(num_sessions=6, seed=5)
    assert a != generate_workload(num_sessions=6, seed=6)
    assert (a.format, a.source, a.block_size, len(a.sessions)) == ("builtin", "builtin", 1, 6)


def test_generator_prefix_structure():
    shared = SHARED_PREFIX_TOKENS // 64  # the shared prompt's full blocks: 237
    for token_scale in (1 / 64, 1 / 8):
        firsts = [s.turns[0].block_ids for s in generate_workload(num_sessions=5, token_scale=token_scale).sessions]
        assert all(f[:shared] == firsts[0][:shared] for f in firsts)
    # Unscaled, so that "the previous turn's full blocks" are the source's.
    wl = generate_workload(num_sessions=12, seed=2, token_scale=1.0)
    B = wl.block_size
    firsts = [s.turns[0].block_ids for s in wl.sessions]
    assert B == 64 and all(f[:shared] == firsts[0][:shared] for f in firsts)
    own = [{b for t in s.turns for b in t.block_ids[shared:]} for s in wl.sessions]
    assert sum(map(len, own)) == len(set().union(*own))  # no session-specific block is shared
    for s in wl.sessions:
        assert s.turns[0].think_time_s == 0.0
        for prev, cur in zip(s.turns, s.turns[1:]):
            kept = prev.input_tokens // B
            assert cur.block_ids[:kept] == prev.block_ids[:kept]
            assert not set(cur.block_ids[kept:]) & set(prev.block_ids)
            assert cur.input_tokens >= prev.input_tokens + prev.output_tokens
            assert len(cur.block_ids) == math.ceil(cur.input_tokens / B)


def test_generator_statistics_near_workload_md():
    """Medians over 150 sessions (~9K turns) land near docs/workload.md's p50s.

    Bounds are loose: the median of requests per session from 150 draws has a standard error of
    about 15%, the per-turn medians (thousands of draws) of a few percent.
    """
    wl = generate_workload(num_sessions=150, seed=3, token_scale=1.0)
    turns = [len(s.turns) for s in wl.sessions]
    pairs = [(a, b) for s in wl.sessions for a, b in zip(s.turns, s.turns[1:])]
    out = [t.output_tokens for s in wl.sessions for t in s.turns]
    new = [b.input_tokens - a.input_tokens - a.output_tokens for a, b in pairs]
    think_tool = [b.think_time_s for a, b in pairs if a.stop == "tool_use"]
    think_end = [b.think_time_s for a, b in pairs if a.stop == "end_turn"]
    first = [s.turns[0].input_tokens for s in wl.sessions]
    assert 30 <= np.median(turns) <= 65                       # 45
    assert 185 <= np.median(out) <= 250                       # 216
    assert 230 <= np.median(new) <= 340                       # 284
    assert 7.5 <= np.median(think_tool) <= 11                 # 9 s
    assert 95 <= np.median(think_end) <= 180                  # 132 s
    assert 0.92 <= np.mean([a.stop == "tool_use" for a, _ in pairs]) <= 0.96  # 0.94
    assert 17_000 <= np.median(first) <= 30_000               # 22.5K (first requests, local)


def test_generator_limits():
    full = generate_workload(num_sessions=5, seed=9, token_scale=1 / 16)
    cut = generate_workload(num_sessions=5, seed=9, token_scale=1 / 16, max_turns=3)
    def shape(turns):
        return [(t.input_tokens, t.output_tokens, len(t.block_ids), t.think_time_s, t.stop) for t in turns]

    for a, b in zip(full.sessions, cut.sessions, strict=True):
        assert shape(b.turns) == shape(a.turns[:3])
    # Ids are numbered in first-seen order, so the first session's are identical too.
    assert cut.sessions[0].turns == full.sessions[0].turns[:3]
    small = generate_workload(num_sessions=4, seed=9, token_scale=1 / 64, max_input_tokens=400)
    assert len(small.sessions) == 4
    assert max(t.input_tokens for s in small.sessions for t in s.turns) <= 400
    capped = generate_workload(num_sessions=4, seed=9, time_scale=0.1, max_think_s=2.0)
    assert max(t.think_time_s for s in capped.sessions for t in s.turns) <= 2.0
    with pytest.raises(ValueError, match="max_input_tokens"):
        generate_workload(num_sessions=2, token_scale=1 / 64, max_input_tokens=100)
    with pytest.raises(ValueError, match="token_scale"):
        generate_workload(token_scale=1 / 3)


# ---------------------------------------------------------------------------------------------
# prompt_token_ids


def test_prompt_token_ids_maps_ids_to_blocks():
    a = Turn(input_tokens=10, output_tokens=1, block_ids=(5, 9, 5), think_time_s=0.0, stop="")
    toks = prompt_token_ids(a, 4, 1000, low=10)
    assert len(toks) == 10 and all(10 <= x < 1000 for x in toks)
    assert toks[0:2] == toks[8:10] and toks[0:4] != toks[4:8]
    b = Turn(input_tokens=4, output_tokens=1, block_ids=(9,), think_time_s=0.0, stop="")
    assert prompt_token_ids(b, 4, 1000, low=10) == toks[4:8]
    # Ids 0 .. span-1 get pairwise-distinct first tokens covering [low, vocab_size).
    span = Turn(input_tokens=990, output_tokens=1, block_ids=tuple(range(990)), think_time_s=0.0, stop="")
    assert sorted(prompt_token_ids(span, 1, 1000, low=10)) == list(range(10, 1000))
    with pytest.raises(ValueError, match="block ids"):
        prompt_token_ids(a, 8, 1000)
    with pytest.raises(ValueError, match="low"):
        prompt_token_ids(a, 4, 10, low=10)


# ---------------------------------------------------------------------------------------------
# Bad traces


def kv_doc(requests):
    return {"id": "t", "block_size": 64, "hash_id_scope": "local", "requests": requests}


def kv_req(n_in=130, n_out=5, **kw):
    r = {"t": 0.0, "type": "n", "in": n_in, "out": n_out, "hash_ids": list(range(n_in // 64)),
         "stop": "tool_use", "think_time": 0.0}
    r.update(kw)
    return r


def write_json(path, obj):
    path.write_text(json.dumps(obj))
    return path


def test_malformed_json_names_file_and_line(tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text('{"requests": [\n  {"in": 1,\n  oops}\n]}')
    with pytest.raises(TraceError, match=r"broken\.json: line 3"):
        load_trace(bad)
    bad_lines = tmp_path / "broken.jsonl"
    bad_lines.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{"x": \n')
    with pytest.raises(TraceError, match=r"broken\.jsonl: line 2: malformed JSON"):
        load_trace(bad_lines)


def test_missing_field_names_request_and_field(tmp_path):
    r = kv_req()
    del r["out"]
    with pytest.raises(TraceError, match=r"m\.json: requests\[1\]: missing field 'out'"):
        load_trace(write_json(tmp_path / "m.json", kv_doc([kv_req(), r])))
    sub = kv_req()
    del sub["in"]
    doc = kv_doc([kv_req(), {"t": 1.0, "type": "subagent", "agent_id": "agent_001",
                             "requests": [kv_req(), sub]}])
    with pytest.raises(TraceError, match=r"requests\[1\]\.subagent\.requests\[1\]: missing field 'in'"):
        load_trace(write_json(tmp_path / "s.json", doc))
    with pytest.raises(TraceError, match=r"x\.jsonl: line 1: missing field 'hash_ids'"):
        load_trace(write_jsonl(tmp_path / "x.jsonl", [{"timestamp": 0, "input_length": 5, "output_length": 1}]))


@pytest.mark.parametrize("field, value, message", [
    ("in", -5, r"'in' must be >= 1"),
    ("in", 0, r"'in' must be >= 1"),
    ("out", -1, r"'out' must be >= 0"),
    ("in", 3.5, r"'in' must be an int"),
    ("hash_ids", [1, 2, 3, 4], r"4 hash_ids for 130 input tokens"),
    ("hash_ids", "abc", r"'hash_ids' must be a list"),
    ("think_time", -2.0, r"'think_time' must be a finite number >= 0"),
    ("type", "x", r"'type' must be"),
])
def test_bad_request_values(tmp_path, field, value, message):
    doc = kv_doc([kv_req(), kv_req(**{field: value})])
    with pytest.raises(TraceError, match=r"v\.json: requests\[1\]: .*" + message):
        load_trace(write_json(tmp_path / "v.json", doc))


def test_bad_mooncake_values(tmp_path):
    rows = [{"timestamp": 0, "input_length": 600, "output_length": -1, "hash_ids": [1, 2]}]
    with pytest.raises(TraceError, match=r"n\.jsonl: line 1: field 'output_length' must be >= 0"):
        load_trace(write_jsonl(tmp_path / "n.jsonl", rows))
    rows = [{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2, 3]}]
    with pytest.raises(TraceError, match=r"c\.jsonl: line 1: 3 hash_ids for 600 input tokens"):
        load_trace(write_jsonl(tmp_path / "c.jsonl", rows))


def test_unknown_format_and_missing_paths(tmp_path):
    with pytest.raises(TraceError, match=r"l\.json: unknown trace format"):
        load_trace(write_json(tmp_path / "l.json", [1, 2]))
    with pytest.raises(TraceError, match=r"o\.json: unknown trace format"):
        load_trace(write_json(tmp_path / "o.json", {"sessions": []}))
    (tmp_path / "t.txt").write_text("hello")
    with pytest.raises(TraceError, match=r"t\.txt: unknown trace format"):
        load_trace(tmp_path / "t.txt")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TraceError, match="empty"):
        load_trace(empty)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_trace(tmp_path / "nowhere")


def test_token_scale_must_give_whole_blocks(tmp_path):
    path = write_json(tmp_path / "ok.json", kv_doc([kv_req()]))
    with pytest.raises(ValueError, match=r"token_scale=0\.3 .*allowed scales.* k / 64"):
        load_trace(path, token_scale=0.3)
    with pytest.raises(ValueError, match="token_scale"):
        load_trace(path, token_scale=1 / 128)
    assert load_trace(path, token_scale=1 / 32).block_size == 2


# ---------------------------------------------------------------------------------------------
# Limits


def limits_doc():
    """Session 'big' has a 2,000-token turn; 'small' stays at 600; 'mid' at 1,200 only at turn 3."""
    def session(sid, lengths):
        return {"id": sid, "requests": [kv_req(n, 7, t=float(i), think_time=float(i))
                                        for i, n in enumerate(lengths)]}
    return [session("big", [500, 2000, 2100]), session("small", [300, 400, 600]),
            session("mid", [300, 500, 700, 1200]), session("tiny", [100, 150])]


def test_limits(tmp_path):
    for i, doc in enumerate(limits_doc()):
        write_json(tmp_path / f"s{i}.json", doc)
    full = load_trace(tmp_path)
    assert [s.session_id for s in full.sessions] == ["big", "small", "mid", "tiny"]
    assert full.num_requests() == 12

    def lengths(wl):
        return {s.session_id: [t.input_tokens for t in s.turns] for s in wl.sessions}

    assert lengths(load_trace(tmp_path, max_input_tokens=700)) == {
        "small": [300, 400, 600], "tiny": [100, 150]}  # 'mid' goes whole for its 1,200 turn
    assert lengths(load_trace(tmp_path, max_turns=2)) == {
        "big": [500, 2000], "small": [300, 400], "mid": [300, 500], "tiny": [100, 150]}
    # max_turns applies first: 'mid' cut to 3 turns fits under 700.
    assert list(lengths(load_trace(tmp_path, max_turns=3, max_input_tokens=700))) == ["small", "mid", "tiny"]
    assert list(lengths(load_trace(tmp_path, max_input_tokens=650, max_sessions=1))) == ["small"]
    assert list(lengths(load_trace(tmp_path, max_sessions=2))) == ["big", "small"]
    scaled = load_trace(tmp_path, token_scale=1 / 64, max_input_tokens=10)
    assert lengths(scaled) == {"small": [5, 7, 10], "tiny": [2, 3]}  # 300/64 -> 5 (in 5 blocks)
    capped = load_trace(tmp_path, time_scale=2.0, max_think_s=3.0)
    assert [t.think_time_s for t in capped.sessions[2].turns] == [0.0, 2.0, 3.0, 3.0]
    # Files never share blocks, even with equal local ids.
    ids = [{b for t in s.turns for b in t.block_ids} for s in full.sessions]
    assert sum(map(len, ids)) == len(set().union(*ids))
    with pytest.raises(ValueError, match="max_turns"):
        load_trace(tmp_path, max_turns=0)


def test_truncate_input_tokens_stops_sessions_as_the_replay_tool_does(tmp_path):
    docs = limits_doc()
    docs[1]["requests"].append({"type": "subagent", "agent_id": "a1",
                                "requests": [kv_req(900, 3), kv_req(950, 3)]})
    # 'big' starts 'a2' after its first turn and 'late' after its second.
    docs[0]["requests"].insert(1, {"type": "subagent", "agent_id": "a2", "requests": [kv_req(100, 3)]})
    docs[0]["requests"].insert(3, {"type": "subagent", "agent_id": "late", "requests": [kv_req(100, 3)]})
    for i, doc in enumerate(docs):
        write_json(tmp_path / f"s{i}.json", doc)

    def lengths(wl):
        return {s.session_id: [t.input_tokens for t in s.turns] for s in wl.sessions}

    # 'big' keeps its first turn only, so it reaches 'a2' but never 'late' (the replay tool
    # stops a user at its first request over the limit); 'mid' stops before its 1,200-token
    # turn; the sub-agent 'small/a1' starts over the limit and goes.
    assert lengths(load_trace(tmp_path, truncate_input_tokens=700)) == {
        "big": [500], "big/a2": [100], "small": [300, 400, 600], "mid": [300, 500, 700],
        "tiny": [100, 150]}
    # A parent whose first turn is over the limit goes with its sub-agents.
    assert lengths(load_trace(tmp_path, truncate_input_tokens=400)) == {
        "small": [300, 400], "mid": [300], "tiny": [100, 150]}
    # Truncation comes before max_input_tokens, so a truncated session can then fit.
    assert "mid" in lengths(load_trace(tmp_path, truncate_input_tokens=700, max_input_tokens=700))
    # Kept turns are unchanged: lengths, think times and which blocks repeat (ids are numbered
    # in first-seen order, so they shift when sessions go).
    def tokens(turns):
        first_seen = {}
        return [(t.input_tokens, t.output_tokens, t.think_time_s,
                 [first_seen.setdefault(b, len(first_seen)) for b in t.block_ids]) for t in turns]

    full = {s.session_id: s.turns for s in load_trace(tmp_path).sessions}
    for s in load_trace(tmp_path, truncate_input_tokens=700).sessions:
        assert tokens(s.turns) == tokens(full[s.session_id][: len(s.turns)])
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="truncate_input_tokens"):
            load_trace(tmp_path, truncate_input_tokens=bad)
    gen = generate_workload(num_sessions=12, seed=3, token_scale=1.0, truncate_input_tokens=40_000)
    assert len(gen.sessions) == 12 and all(s.turns for s in gen.sessions)
    assert all(t.input_tokens <= 40_000 for s in gen.sessions for t in s.turns)
    # Sessions are cut, not replaced: each is a prefix of the same draw without the limit,
    # or a draw whose first prompt was over it.
    free = generate_workload(num_sessions=40, seed=3, token_scale=1.0)
    turns = {s.session_id: s.turns for s in free.sessions}
    for s in gen.sessions:
        if s.session_id in turns:
            assert [t.input_tokens for t in s.turns] == \
                [t.input_tokens for t in turns[s.session_id][: len(s.turns)]]
    assert any(len(s.turns) < len(turns[s.session_id]) for s in gen.sessions if s.session_id in turns)
    with pytest.raises(ValueError, match="truncate_input_tokens=1000 is below the shortest"):
        generate_workload(num_sessions=2, token_scale=1.0, truncate_input_tokens=1000)
    with pytest.raises(ValueError, match="truncate_input_tokens"):
        generate_workload(num_sessions=2, truncate_input_tokens=0)


def warm_docs():
    """Two files: local ids collide on purpose; tool + system tokens 300 and 1,000."""
    a = kv_doc([kv_req(700, 5, hash_ids=list(range(10))),
                kv_req(900, 5, hash_ids=list(range(14))),
                {"type": "subagent", "agent_id": "sa", "requests": [
                    kv_req(400, 5, hash_ids=[50, 51, 52, 53, 54, 55])]}])
    a.update(id="a", tool_tokens=200, system_tokens=100)
    b = kv_doc([kv_req(260, 5, hash_ids=[0, 1, 2, 3]),
                kv_req(600, 5, hash_ids=[0, 1, 9, 9, 9, 9, 9, 9, 9])])  # compaction at block 2
    b.update(id="b", tool_tokens=900, system_tokens=100)
    return a, b


def test_warm_prefix_is_shared_by_every_session(tmp_path):
    a, b = warm_docs()
    write_json(tmp_path / "a.json", a)
    write_json(tmp_path / "b.json", b)
    cold = load_trace(tmp_path)
    warm = load_trace(tmp_path, warm_prefix_fraction=0.5)  # 0.5 * max(300, 1000) = 500 tokens
    by = {s.session_id: s for s in warm.sessions}
    # 500 tokens -> the first 7 full 64-token blocks of each first prompt, b's first prompt
    # has only 4 full blocks.
    pa, psa, pb = (by[k].turns[0].block_ids for k in ("a", "a/sa", "b"))
    assert pa[:7] == psa[:6] + pa[6:7] and pa[:4] == pb[:4]
    assert len(set(pa[7:]) & set(pb) ) == 0 and pa[7] not in psa
    # Later turns keep the shared blocks where they keep the prefix.
    assert by["a"].turns[1].block_ids[:10] == pa[:10]
    assert by["b"].turns[1].block_ids[:2] == pb[:2]
    assert not set(by["b"].turns[1].block_ids[2:]) & set(pa)
    # Without it, files share nothing; with it, the lengths and turn count are unchanged.
    ids = [{x for t in s.turns for x in t.block_ids} for s in cold.sessions]
    assert not ids[0] & ids[2]
    assert [[t.input_tokens for t in s.turns] for s in cold.sessions] == \
        [[t.input_tokens for t in s.turns] for s in warm.sessions]
    # Token ids follow the block ids: the warm blocks are the same tokens in every session.
    B = warm.block_size
    assert prompt_token_ids(by["a"].turns[0], B, VOCAB)[: 4 * B] == \
        prompt_token_ids(by["b"].turns[0], B, VOCAB)[: 4 * B]
    assert load_trace(tmp_path, warm_prefix_fraction=0.0).sessions == cold.sessions
    for bad in (-0.1, 1.5, "half", math.nan):
        with pytest.raises(ValueError, match="warm_prefix_fraction"):
            load_trace(tmp_path, warm_prefix_fraction=bad)


@needs_traces
def test_warm_prefix_on_the_real_traces(kv_folder):
    wl = load_trace(kv_folder, warm_prefix_fraction=0.5)
    firsts = [s.turns[0].block_ids for s in wl.sessions]
    # kv_folder's largest tool + system prompt is computed from the files themselves.
    docs = [json.load(gzip.open(KV_DIR / n, "rt") if n.endswith(".gz") else open(KV_DIR / n))
            for n in KV_FILES]
    k = int(0.5 * max(d["tool_tokens"] + d["system_tokens"] for d in docs)) // 64
    full = [min(k, s.turns[0].input_tokens // 64) for s in wl.sessions]  # full blocks only
    assert k > 50 and all(f[:n] == firsts[0][:n] for f, n in zip(firsts, full))
    assert all(f[k] != firsts[0][k] for f in firsts[1:] if len(f) > k)


def test_warm_prefix_keeps_equal_ids_equal_content(tmp_path):
    """Files with other block sizes, and repeated local ids, never make one id stand for two
    contents: checked on the tokens."""
    a = {"id": "a", "block_size": 32, "hash_id_scope": "local", "tool_tokens": 256,
         "requests": [kv_req(512, 3, hash_ids=list(range(16)))]}
    b = kv_doc([kv_req(512, 3, hash_ids=list(range(8)))])
    b.update(id="b", tool_tokens=256)
    c = kv_doc([kv_req(256, 3, hash_ids=[5, 5, 5, 5]), kv_req(320, 3, hash_ids=[5, 5, 5, 5, 7])])
    c.update(id="c", tool_tokens=256)
    d = kv_doc([kv_req(256, 3, hash_ids=[0, 1, 2, 3])])
    d.update(id="d", tool_tokens=256)
    for order in ("abcd", "dcba"):
        folder = tmp_path / order
        folder.mkdir()
        for i, (name, doc) in enumerate(zip(order, [dict(a=a, b=b, c=c, d=d)[x] for x in order])):
            write_json(folder / f"{i}_{name}.json", doc)
        wl = load_trace(folder, warm_prefix_fraction=1.0)
        B = wl.block_size
        seen = {}
        for s in wl.sessions:
            for t in s.turns:
                toks = prompt_token_ids(t, B, VOCAB)
                for j, bid in enumerate(t.block_ids[: t.input_tokens // B]):
                    assert seen.setdefault(bid, toks[j * B:(j + 1) * B]) == toks[j * B:(j + 1) * B]
        by = {s.session_id: s.turns for s in wl.sessions}
        # 'c' repeats a local id, yet its first prompt is the canonical prefix, as 'd''s is.
        assert by["c"][0].block_ids == by["d"][0].block_ids
        assert by["c"][1].block_ids[: len(by["c"][0].block_ids)] == by["c"][0].block_ids
