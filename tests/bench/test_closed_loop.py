"""The closed loop shared by the replay and the simulator, driven against a fake target on a
virtual clock: every turn takes one virtual second; a prompt of 0 tokens is refused."""

from __future__ import annotations

import math

import pytest
from kvtier.bench.closed_loop import ActiveSession, ClosedLoop, sum_sections
from kvtier.bench.workload import Session, Turn, Workload
from kvtier.cache.checkpoints.index import StateStats
from kvtier.cache.pool_stats import RemoteSnapshot
from kvtier.serve.params import RequestMetrics, RequestOutput


class FakeTarget:
    def __init__(self):
        self.now, self.running, self.events = 0.0, [], []

    def submit(self, a: ActiveSession, turn: Turn, arrival_time: float) -> None:
        if turn.input_tokens == 0:
            raise ValueError("prompt is empty")
        self.running.append((self.now + 1.0, a, arrival_time))
        self.events.append(("submit", a.session.session_id, a.next_turn, self.now))

    def advance(self, until):
        if not self.running:
            if until is None:
                return None
            self.now = until
            return []
        end = min(t for t, _, _ in self.running)
        if until is not None and until < end:
            self.now = until
            return []
        self.now = end
        done = [(a, arr) for t, a, arr in self.running if t == end]
        self.running = [r for r in self.running if r[0] != end]
        return [(a, RequestOutput(0, None, [7], None, None, 0, "length",
                                  metrics=RequestMetrics(arr, first_token_time=end, finish_time=end)))
                for a, arr in done]

    def tool_wait(self, a, expected_wait_s):
        self.events.append(("tool_wait", a.session.session_id, expected_wait_s))

    def tool_return(self, a):
        self.events.append(("tool_return", a.session.session_id))


def _session(name: str, inputs: list[int], think_s: float) -> Session:
    return Session(name, tuple(Turn(n, 1, (1,), think_s if k else 0.0, "tool_use") for k, n in enumerate(inputs)))


def _run(sessions, **kw) -> tuple[ClosedLoop, FakeTarget]:
    target = FakeTarget()
    wl = Workload("t", "t", "builtin", 4, 1.0, 1.0, math.inf, tuple(sessions))
    loop = ClosedLoop(wl, target, lambda: target.now, **kw)
    loop.run()
    return loop, target


def test_ramp_concurrency_think_times_and_refusals():
    sessions = [_session(f"s{i}", [3, 0, 5], think_s=2.0) for i in range(3)]
    loop, target = _run(sessions, concurrency=2, ramp_s=1.0)
    by = {(r.session_id, r.turn): r for r in loop.records}
    assert [by["s0", 0].arrival_s, by["s1", 0].arrival_s] == [0.0, 0.5]  # session i at i * ramp_s / concurrency
    assert by["s0", 0].finish_s == 1.0 and by["s0", 0].ttft_s == 1.0
    # turn 1 is refused (an error record at its due time), the session goes on with turn 2
    assert by["s0", 1].error == "prompt is empty" and by["s0", 1].arrival_s == 3.0
    assert by["s0", 2].arrival_s == 5.0 and by["s0", 2].error is None
    # the third session starts when the first one ends (a slot frees), never before
    assert by["s2", 0].arrival_s == by["s0", 2].finish_s == 6.0
    assert len(loop.records) == 9 and not loop.warmup_records


def test_tool_waits_are_estimated_and_the_window_cuts_sessions():
    sessions = [_session("a", [3, 4, 5], think_s=2.0)]
    loop, target = _run(sessions, concurrency=1, tool_aware=True)
    waits = [e for e in target.events if e[0] == "tool_wait"]
    assert waits == [("tool_wait", "a", 9.0), ("tool_wait", "a", 2.0)]  # prior p50, then the median observed
    assert target.events[-1] == ("tool_return", "a")
    loop, _ = _run(sessions, concurrency=1, warmup_s=0.5, duration_s=4.0)
    assert [r.turn for r in loop.warmup_records] == [0] and [r.turn for r in loop.records] == [1]
    with pytest.raises(ValueError, match="warmup_s"):
        _run(sessions, concurrency=1, warmup_s=2.0, duration_s=1.0)
    with pytest.raises(ValueError, match="concurrency"):
        _run(sessions, concurrency=0)


def test_sum_sections_adds_each_section_over_pools_scaling_its_bytes():
    a, b = StateStats(fallbacks=2), StateStats(tokens_lost=7)
    a.hits["host"], a.bytes_loaded["host"] = 3, 10
    b.hits["host"], b.bytes_loaded["host"], b.saved["turn"] = 1, 5, 4
    remote = RemoteSnapshot({"ok": 2}, {"ok": 1}, 0)
    got = sum_sections([{"state": a}, {"remote": remote}, {"state": b}], [1.0, 9.0, 3.0])  # by name: each over its pools
    total = got["state"]
    assert total.hits == {"device": 0, "host": 4, "disk": 0, "remote": 0}
    assert total.bytes_loaded["host"] == 10 + 15 and total.saved == {"grid": 0, "turn": 4}
    assert (total.fallbacks, total.tokens_lost) == (2, 7)
    assert got["remote"] == remote and list(got) == ["state", "remote"]
    assert sum_sections([{}, {}], [1.0, 1.0]) == {}
