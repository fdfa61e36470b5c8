"""``kvtier bench --workload sdk-agents``: agent sessions through the official SDKs against
``kvtier serve tiny`` (one session of 3 turns per API), and the reuse arithmetic of its report
(reachable tokens, ratios, the summary) checked row by row."""

from __future__ import annotations

import json

import pytest

from kvtier.bench.agent_reuse import (annotate, new_session_bounds, prompt_tail, reachable_tokens, restated_tokens,
                                      summarize)
from kvtier.bench.agent_sessions import APIS, AgentWorkload, first_requests
from tests.conftest import TOKENIZER_DIR

PAGE = 16


def test_reachable_tokens_are_the_computed_tokens_in_whole_pages():
    assert reachable_tokens(100, 20, PAGE) == 112  # 119 computed tokens: 7 pages
    assert reachable_tokens(32, 1, PAGE) == 32  # the one sampled token was never computed
    assert reachable_tokens(31, 2, PAGE) == 32
    assert reachable_tokens(15, 1, PAGE) == 0
    with pytest.raises(ValueError, match="page_size"):
        reachable_tokens(10, 1, 0)


def test_workload_checks_name_their_options_and_spread_forced_turns():
    for bad, option in [(dict(sessions=0), "--agent-sessions"), (dict(turns=0), "--agent-turns"),
                        (dict(apis=("chat", "completions")), "--agent-apis"), (dict(apis=()), "--agent-apis"),
                        (dict(tool_share=1.5), "--agent-tool-share"), (dict(max_tokens=0), "--max-output-tokens"),
                        (dict(concurrency=0), "--concurrency")]:
        with pytest.raises(ValueError, match=option):
            AgentWorkload(**bad)
    half = AgentWorkload(tool_share=0.5)
    assert [half.forced(0, k) for k in range(6)] == [False, True] * 3
    assert [half.forced(1, k) for k in range(6)] == [True, False] * 3  # shifted per session
    assert not any(AgentWorkload(tool_share=0).forced(s, k) for s in range(3) for k in range(6))
    assert all(AgentWorkload(tool_share=1).forced(s, k) for s in range(3) for k in range(6))
    assert sum(AgentWorkload(tool_share=0.25).forced(0, k) for k in range(8)) == 2


def row(api, session, turn, prompt, output, cached, calls, forced=None):
    return {"api": api, "session": session, "turn": turn, "forced": bool(calls) if forced is None else forced,
            "prompt_tokens": prompt, "output_tokens": output, "cached_tokens": cached, "tool_calls": calls,
            "finish": "stop"}


def test_annotate_and_summarize_on_given_rows():
    bounds = {("chat", 1): (208, 208)}
    rows = annotate([row("chat", 0, 0, 230, 40, 0, 1), row("chat", 0, 1, 300, 10, 256, 0),
                     row("chat", 0, 2, 330, 5, 304, 0), row("chat", 1, 0, 231, 7, 208, 0)], PAGE, bounds)
    assert [r["kind"] for r in rows] == ["first", "tool", "text", "new-session"]
    assert [r["reachable_tokens"] for r in rows] == [None, 256, 304, 208]
    assert [r["restated_tokens"] for r in rows] == [None, 256, 304, 208]  # no tail: the page bound
    assert [r["ratio"] for r in rows] == [None, 1.0, 1.0, 1.0]
    assert [r["lost"] for r in rows] == [None, False, False, None]
    assert [r["reached_checkpoint"] for r in rows] == [None, True, True, True]
    rows[2]["cached_tokens"] = 288  # turn 1's prompt (300 tokens: 288 in whole pages), none of its output
    assert annotate(rows, PAGE, bounds)[2]["lost"]
    [text] = [s for s in summarize(annotate(rows, PAGE, bounds)) if s["api"] == "chat" and s["kind"] == "text"]
    assert text == {"api": "chat", "kind": "text", "turns": 1, "cached_tokens": 288, "reachable_tokens": 304,
                    "ratio": 288 / 304, "min_ratio": 288 / 304, "full_turns": 0, "restated_tokens": 304,
                    "restated_ratio": 288 / 304, "after_tail": 0, "reached_checkpoint": 0, "lost_turns": 1}
    assert annotate(rows[:1] + rows[3:], PAGE, None)[1]["ratio"] is None  # no bound: not counted


def test_a_turn_sampled_after_a_tail_is_bounded_by_the_history_end():
    assert restated_tokens(424, 46, PAGE) == 368  # 378 ids of history: 23 whole pages
    assert restated_tokens(46, 46, PAGE) == 0
    for bad in [(40, 46, PAGE), (424, -1, PAGE), (424, 46, 0)]:
        with pytest.raises(ValueError, match="after_history|page_size"):
            restated_tokens(*bad)
    # a forced turn (424 prompt ids, 46 of them after its history: the tail and the generation
    # prompt) then an unforced one; the K2 template has no tail, so the same rows keep the page bound
    rows = [row("chat", 0, 0, 289, 64, 0, 0), row("chat", 0, 1, 424, 62, 352, 1, forced=True),
            row("chat", 0, 2, 530, 64, 368, 0), row("chat", 0, 3, 664, 62, 592, 1)]
    out = annotate(rows, PAGE, None, tail=(36, 46))
    assert [r["after_tail"] for r in out] == [None, False, True, False]
    assert [r["reachable_tokens"] for r in out] == [None, 352, 480, 592]
    assert [r["restated_tokens"] for r in out] == [None, 352, 368, 592]
    assert [r["restated_ratio"] for r in out] == [None, 1.0, 1.0, 1.0] and out[2]["ratio"] == 368 / 480
    assert out[2]["reached_checkpoint"] and out[2]["lost"]  # nothing of the sampled call came back
    rows[2]["cached_tokens"] = 352  # a page short of the history end: its checkpoint was not found
    assert not annotate(rows, PAGE, None, tail=(36, 46))[2]["reached_checkpoint"]
    [tool] = [s for s in summarize(annotate(rows, PAGE, None, tail=(36, 46))) if s["api"] == "all"
              and s["kind"] == "tool"]
    assert (tool["reachable_tokens"], tool["restated_tokens"], tool["after_tail"], tool["reached_checkpoint"]) == \
        (480, 368, 1, 0)
    assert [r["restated_tokens"] for r in annotate(rows, PAGE, None, tail=(0, 3))] == [None, 352, 480, 592]


def test_a_turn_the_server_refuses_ends_its_session_and_is_not_counted():
    from kvtier.bench.agent_sessions import TurnUsage, run_session

    class Refused(Exception):
        status_code = 400

    class Driver:  # answers two turns, then refuses (as the SDKs raise an HTTP error)
        api, calls = "chat", 0

        def start(self, user):
            return [user]

        def call(self, history, forced, max_tokens, session_id):
            self.calls += 1
            if self.calls == 3:
                raise Refused("request failed: GrammarLimitError")
            return TurnUsage(100 * self.calls, 10, 0, 0, "stop"), "reply", []

        def extend(self, history, reply, results, user):
            return history + [reply, user]

    rows, history = run_session(Driver(), AgentWorkload(tool_share=0), "n", 0, range(6))
    assert history is None and [r["turn"] for r in rows] == [0, 1, 2] and rows[2]["error"].startswith("400: ")
    out = annotate(rows, PAGE, None)
    assert [r["kind"] for r in out] == ["first", "text", "error"] and out[2]["ratio"] is None
    assert [s["turns"] for s in summarize(out) if s["api"] == "all"] == [1]

    class Down(Driver):
        def call(self, *a):
            raise ConnectionError("no server")  # no HTTP status: not an answer, raised

    with pytest.raises(ConnectionError):
        run_session(Down(), AgentWorkload(), "n", 0, range(2))


def _tokenizer(model):
    if not (TOKENIZER_DIR / "tiktoken.model").is_file():
        pytest.skip(f"real Kimi tokenizer files not present at {TOKENIZER_DIR}")
    from kvtier.bench.agent_sessions import served_tokenizer

    return served_tokenizer(model, str(TOKENIZER_DIR))


def test_the_tail_and_new_session_bounds_come_from_the_renderer():
    from kvtier.bench.agent_sessions import SYSTEM, ChatDriver
    from kvtier.tokenize import ChatFormat
    from kvtier.tokenize.xtml import XtmlOptions
    from kvtier.tokenize.xtml_session import XtmlSessionEncoder

    k3, hybrid = _tokenizer("tiny-k3")
    assert k3.chat_format is ChatFormat.K3_XTML and hybrid  # the format tiny-k3 is served in
    tail, after = prompt_tail(k3)
    assert 0 < tail < after
    # the same count after a longer history, read off the renderer's boundaries
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "list the files"},
               {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                   "name": "run_command", "arguments": '{"command": "ls"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "a.py\nb.py"}]
    for choice, n in (("required", after), ("auto", after - tail)):
        enc = XtmlSessionEncoder(k3)
        enc.append(history, ChatDriver(None, "").tools, XtmlOptions(tool_choice=choice))
        assert len(enc.ids) - enc.boundaries()["history"] == n
    k2, k2_hybrid = _tokenizer("tiny")
    assert prompt_tail(k2)[0] == 0 and not k2_hybrid  # K2's template renders no tail
    assert prompt_tail(None) is None

    firsts = first_requests(AgentWorkload(sessions=2, apis=("chat", "messages")), "cafe0123")
    assert [(api, s) for api, s, _ in firsts] == [("chat", 0), ("chat", 1), ("messages", 0), ("messages", 1)]
    # two first prompts made to share one more token past the user message's opening tag
    pair = [("chat", 0, "tag1: fix it"), ("chat", 1, "tag2: fix it")]
    page, restated = new_session_bounds(k3, PAGE, pair, checkpoints_only=True)[("chat", 1)]
    enc = XtmlSessionEncoder(k3)
    enc.append([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "tag1: fix it"}],
               ChatDriver(None, "").tools, XtmlOptions(tool_choice="auto"))
    assert restated == enc.boundaries()["last_body"] // PAGE * PAGE and page >= restated
    assert new_session_bounds(k3, PAGE, pair)[("chat", 1)] == (page, page)  # attention only: the page bound
    bounds = new_session_bounds(k3, PAGE, firsts, checkpoints_only=True)
    assert set(bounds) == {("chat", 1), ("messages", 0), ("messages", 1)}
    assert all(b[0] >= b[1] >= enc.boundaries()["tools"] // PAGE * PAGE for b in bounds.values())


def test_the_command_refuses_what_it_does_not_take(capsys):
    from kvtier.cli import main

    assert main(["bench", "--workload", "sdk-agents", "--trace", "x.json"]) == 2
    assert "--workload sdk-agents makes its own sessions" in capsys.readouterr().err
    assert main(["bench", "--workload", "sdk-agents", "--agent-apis", "chat,completions"]) == 2
    assert "--agent-apis" in capsys.readouterr().err


def test_sessions_through_the_sdks_report_cached_over_reachable(tmp_path):
    pytest.importorskip("openai")
    pytest.importorskip("anthropic")
    if not (TOKENIZER_DIR / "tiktoken.model").is_file():
        pytest.skip(f"real Kimi tokenizer files not present at {TOKENIZER_DIR}")
    from kvtier.bench.agent_sessions import bench_agents, local_server
    from kvtier.tokenize import load_tokenizer

    workload = AgentWorkload(sessions=1, turns=3, max_tokens=32)
    out = tmp_path / "agents.json"
    with local_server("tiny", str(TOKENIZER_DIR), ["--page-size", str(PAGE)]) as server:
        result = bench_agents(workload, model="tiny", tokenizer=str(TOKENIZER_DIR), page_size=PAGE,
                              endpoint=f"{server.url}/v1", json_path=str(out))
    assert server.proc.poll() is not None  # stopped by its PID
    assert json.loads(out.read_text()) == result
    assert result["provenance"]["commit"] and result["provenance"]["page_size"] == PAGE
    evicted = result["provenance"]["evicted_during_run"]  # kvtier serve counts them
    assert evicted is not None and all(n >= 0 for tiers in evicted.values() for n in tiers.values())

    rows = result["turns"]
    assert [(r["api"], r["turn"]) for r in rows] == [(api, k) for api in APIS for k in range(3)]
    prov = result["provenance"]
    assert (prov["chat_format"], prov["hybrid"], prov["prompt_tail"]["tail"]) == ("k2-template", False, 0)
    bounds = new_session_bounds(load_tokenizer(TOKENIZER_DIR), PAGE, first_requests(workload, prov["nonce"]))
    for i, r in enumerate(rows):
        assert 0 <= r["cached_tokens"] < r["prompt_tokens"] and r["output_tokens"] >= 1
        if r["forced"]:
            assert r["tool_calls"] >= 1, r
        if r["turn"] == 0:
            shared = bounds.get((r["api"], r["session"]), (None, None))
            assert (r["kind"], r["reachable_tokens"], r["restated_tokens"]) == \
                (("first", None, None) if i == 0 else ("new-session", *shared))
            assert i == 0 or (shared[0] > 0 and shared[0] % PAGE == 0)
            continue
        prev = rows[i - 1]
        assert r["prompt_tokens"] > prev["prompt_tokens"]  # the history came back, and more
        assert r["kind"] == ("tool" if prev["tool_calls"] else "text")
        reach = (prev["prompt_tokens"] + prev["output_tokens"] - 1) // PAGE * PAGE
        assert r["reachable_tokens"] == r["restated_tokens"] == reach and r["ratio"] == r["cached_tokens"] / reach
        assert r["lost"] == (r["cached_tokens"] <= prev["prompt_tokens"] // PAGE * PAGE)
    assert any(r["forced"] for r in rows) and not all(r["forced"] for r in rows)

    counted = [r for r in rows if r["ratio"] is not None]
    for s in result["summary"]:
        group = [r for r in counted if r["kind"] == s["kind"] and s["api"] in ("all", r["api"])]
        assert s["turns"] == len(group) and s["cached_tokens"] == sum(r["cached_tokens"] for r in group)
        assert s["reachable_tokens"] == sum(r["reachable_tokens"] for r in group)
        assert s["ratio"] == s["cached_tokens"] / s["reachable_tokens"]
        assert s["min_ratio"] == min(r["ratio"] for r in group)
        assert s["lost_turns"] == sum(bool(r["lost"]) for r in group)
    assert {(s["api"], s["kind"]) for s in result["summary"]} >= {("all", "new-session"), ("chat", "tool")}
