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


def test_a_k3_length_stop_keeps_the_prompt_ids_for_the_next_turn(k3_tok):
    """A K3 turn stopped by max_tokens leaves its message open, so its sampled ids are not kept;
    the next turn still starts from the prompt's ids up to its history's end (the boundary its
    checkpoint sits at), with a session id and, filed by the message returned, without one."""
    from types import SimpleNamespace

    from kvtier.serve.api.jobs import Final
    from kvtier.serve.chat import add_chat_request
    from kvtier.tokenize.xtml import XtmlOptions, encode_xtml

    class Engine:  # what the store and add_chat_request read of an engine
        config = SimpleNamespace(pool=SimpleNamespace(page_size=16))
        block_hash_salt, prefill_time_s, pool = b"", None, None

        def add_request(self, ids, params, **kw):
            self.prompt, self.checkpoint_at = list(ids), kw["checkpoint_at"]
            return 0

    engine, opts = Engine(), XtmlOptions(thinking=False)
    params = SimpleNamespace(tools=None)
    first = [{"role": "user", "content": "say hello at length"}]
    history_end = len(encode_xtml(k3_tok, first, None, opts, add_generation_prompt=False))
    for session_id in ("long", None):
        store = SessionStore(engine, k3_tok, ttl_s=60, clock=Clock())
        enc = store.encoder(session_id, "", first)
        add_chat_request(engine, enc, first, params, prompt_options=opts)
        store.accepted(session_id)
        assert history_end in engine.checkpoint_at and engine.prompt[:history_end] == list(enc.ids[:history_end])
        prompt = engine.prompt
        out = k3_tok.encode_segment("Hello there, and")  # the budget ran out inside the message
        final = Final("length", len(prompt), len(out), 0, {}, "Hello there, and", "", [], [], None, out)
        assert not store.generated(session_id, final, enc, first)
        store.turn_ended(session_id, None, [], None, final)
        nxt = first + [{"role": "assistant", "content": "Hello there, and"}, {"role": "user", "content": "go on"}]
        again = store.encoder(session_id, "", nxt)
        assert again is enc  # the session's encoder, found by id or by the conversation
        r = enc.append(nxt, None, opts)
        assert r.rolled_back == len(prompt) - history_end  # only what followed the history
        assert list(enc.ids) == encode_xtml(k3_tok, nxt, None, opts)
