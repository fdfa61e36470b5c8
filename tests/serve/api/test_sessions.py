"""SessionStore: one encoder per session, tool waits told to the pool with a running estimate per
tool, the idle TTL, deletion."""

from __future__ import annotations

import pytest

from kvtier.serve.api.protocol import ApiError
from kvtier.serve.api.sessions import DEFAULT_TOOL_WAIT_S, SessionStore


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


@pytest.fixture(scope="module")
def llm(tok_dir):
    from kvtier import LLM

    return LLM("tiny", tokenizer=tok_dir, num_device_pages=64, cache_policy="tool-aware")


def test_tool_waits_estimates_ttl_and_end(llm, monkeypatch):
    clock = Clock()
    store = SessionStore(llm.engine, llm.tokenizer, ttl_s=60, clock=clock)
    waits, returns = [], []
    monkeypatch.setattr(llm.engine.pool, "tool_wait_blocks", lambda sid, hashes, s: waits.append((sid, len(hashes), s)))
    monkeypatch.setattr(llm.engine.pool, "tool_return", lambda sid: returns.append(sid))

    enc = store.encoder("a")
    assert store.encoder("a") is enc and store.encoder(None) is not enc  # kept; None: a one-off encoder
    store.accepted("a")
    store.turn_ended("a", None, [], None)
    store.turn_ended("a", list(range(40)), ["ls"], None)
    ps = llm.engine.config.pool.page_size
    assert waits == [("a", 40 // ps, DEFAULT_TOOL_WAIT_S)] and returns == []
    clock.t += 2.0
    store.encoder("a")
    store.refused("a")  # a refused request (over the context, say) does not end the wait
    assert returns == [] and store.num_waiting == 1 and not store.tool_waits["ls"].observed
    clock.t += 1.0  # the tool took 3 s: the next accepted request ends the wait and teaches the estimate
    store.encoder("a")
    assert returns == [] and store.num_waiting == 1  # not yet: taken, not accepted
    store.accepted("a")
    assert returns == ["a"] and list(store.tool_waits["ls"].observed) == [3.0] and store.num_waiting == 0
    store.turn_ended("a", list(range(40)), ["ls"], None)
    assert waits[-1][2] == 3.0
    store.encoder("a")
    store.accepted("a")
    store.turn_ended("a", list(range(40)), ["ls"], 0.5)  # the client's hint wins
    assert waits[-1][2] == 0.5

    with pytest.raises(ApiError, match="cache_salt"):
        store.encoder("a", cache_salt="other")
    clock.t += 61
    assert store.expire() == 1 and "a" not in store.sessions and returns[-1] == "a"
    store.encoder("b")
    assert store.expire() == 0  # a request in flight keeps its session
    assert store.end("b") and not store.end("b")


@pytest.mark.parametrize("argv, match", [
    (["--port", "0"], "--tokenizer DIR is required"),
    (["--tokenizer", "x", "--max-queue", "0"], "--max-queue must be >= 1"),
    (["--tokenizer", "x", "--session-ttl-s", "0"], "--session-ttl-s must be"),
    (["--tokenizer", "x", "--port", "70000"], "--port must be in"),
])
def test_serve_options_are_checked_before_anything_loads(argv, match, capsys):
    from kvtier.cli import main

    assert main(["serve", "tiny", *argv]) == 2
    assert match in capsys.readouterr().err


def test_refused_requests_start_no_session(llm):
    store = SessionStore(llm.engine, llm.tokenizer, ttl_s=60, clock=Clock())
    store.encoder("new", "salt-a")
    store.refused("new")
    assert "new" not in store.sessions  # the refused first request left nothing, not even its salt
    store.encoder("new", "salt-b")
    store.encoder("new", "salt-b")  # a second request while the first is in flight
    store.refused("new")
    assert store.sessions["new"].in_flight == 1  # the first is still in flight: the session stays
    store.accepted("new")
    store.turn_ended("new", None, [], None)
    store.encoder("new", "salt-b")
    store.refused("new")
    assert "new" in store.sessions and store.sessions["new"].in_flight == 0  # it had an accepted turn
    store.refused(None)  # no session: nothing to do


def test_a_refused_resume_leaves_the_resume_to_the_retry(llm):
    """A resume refused before the engine (its prompt over the context, say) ends neither the tool
    wait nor the resume: the client's corrected retry is the one counted."""
    from tests.helpers.resume_finals import _final

    store = SessionStore(llm.engine, llm.tokenizer, ttl_s=60, clock=Clock())
    store.encoder("r")
    store.accepted("r")
    store.turn_ended("r", list(range(40)), ["ls"], 1.0, final=_final())
    assert store.num_waiting == 1
    store.encoder("r")
    store.refused("r")
    store.turn_ended("r", None, [], None, final=None)  # nothing more reaches the store for it
    assert store.num_waiting == 1 and store.resumes.snapshot()["resumes"] == 0
    store.encoder("r")
    store.accepted("r")
    store.turn_ended("r", list(range(60)), [], None, final=_final())
    assert store.num_waiting == 0 and store.resumes.snapshot()["resumes"] == 1


def test_a_resume_aborted_after_it_was_accepted_gives_the_wait_back(llm):
    """A resume the engine accepted and that was then aborted (its client disconnected) leaves
    the session waiting on its tool as before: the pool is told again, the wait it observed is
    taken back from the tool's estimate, and the client's retry is the resume counted."""
    from tests.helpers.resume_finals import _final

    clock = Clock()
    store = SessionStore(llm.engine, llm.tokenizer, ttl_s=60, clock=clock)
    pool = llm.engine.pool
    store.encoder("r")
    store.accepted("r")
    store.turn_ended("r", list(range(40)), ["ls"], 5.0, final=_final())
    assert store.num_waiting == 1 and pool.returns_within(0.0, 10.0) == 1
    clock.t += 2.0
    store.encoder("r")
    store.accepted("r")  # the resume reached the engine: the wait ended
    assert store.num_waiting == 0 and pool.returns_within(0.0, 10.0) == 0
    assert list(store.tool_waits["ls"].observed) == [2.0]
    store.aborted("r")  # the client went away
    assert store.num_waiting == 1 and store.resumes.snapshot()["resumes"] == 0
    assert pool.returns_within(0.0, 10.0) == 1 and list(store.tool_waits["ls"].observed) == []
    clock.t += 1.0
    store.encoder("r")
    store.accepted("r")  # the retry
    assert list(store.tool_waits["ls"].observed) == [3.0]
    store.turn_ended("r", list(range(60)), [], None, final=_final())
    assert store.num_waiting == 0 and store.resumes.snapshot()["resumes"] == 1
