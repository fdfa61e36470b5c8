"""XtmlSessionEncoder: after every turn of a growing K3 conversation (appends, parallel results sent
back out of order, edits, tools and options that change), its incremental ids equal a full
encoding; a turn's tails and generation prompt are rolled back exactly to the end of the last
history message; a refused turn leaves the session as it was."""

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.tokenize import SessionEncoder
from kvtier.tokenize.session import ListIdStore
from kvtier.tokenize.xtml import XtmlOptions, encode_xtml
from kvtier.tokenize.xtml_session import XtmlSessionEncoder, session_encoder

from .parts import text

BASH = {"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}
READ = {"type": "function", "function": {"name": "read", "description": "读文件 <|open|>"}}
OPTIONS = [XtmlOptions(), XtmlOptions(thinking=False), XtmlOptions(thinking_effort="max"),
           XtmlOptions(tool_choice="none", response_format={"type": "json_object"})]
ARGS = st.one_of(st.just('{"cmd": "ls"}'), st.just("{not json"), st.just(""),
                 st.dictionaries(st.sampled_from(["a", "b", "ключ"]),
                                 st.one_of(st.integers(), st.booleans(), st.none(), text(allow_long=False),
                                           st.lists(st.integers(), max_size=3)), max_size=3))


def _step(data, msgs: list, state: dict) -> None:
    """Change the conversation as a client would: mostly appends, sometimes edits."""
    kind = data.draw(st.sampled_from(["user", "user", "assistant", "calls", "edit", "dynamic", "noop"]))
    if kind == "user":
        msgs.append({"role": "user", "content": data.draw(text())})
    elif kind == "assistant":
        msgs.append({"role": "assistant", "content": data.draw(text()),
                     "reasoning_content": data.draw(st.one_of(st.none(), text(allow_long=False)))})
    elif kind == "calls":
        n = data.draw(st.integers(1, 3))
        ids = [f"call_{state['calls'] + k}" for k in range(n)]
        state["calls"] += n
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": i, "type": "function", "function": {"name": "bash", "arguments": data.draw(ARGS)}} for i in ids]})
        for i in data.draw(st.permutations(ids)):  # results in any order
            msgs.append({"role": "tool", "tool_call_id": i, "content": data.draw(text(allow_long=False))})
    elif kind == "edit" and msgs:
        k = data.draw(st.integers(0, len(msgs) - 1))
        if msgs[k]["role"] in ("user", "assistant") and not msgs[k].get("tools"):
            msgs[k]["content"] = data.draw(text(allow_long=False))
    elif kind == "dynamic" and not state["dynamic"]:
        msgs.append({"role": "system", "content": "", "tools": [READ]})
        state["dynamic"] = True


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_incremental_ids_equal_a_full_encoding(k3_tok, data):
    enc = XtmlSessionEncoder(k3_tok, store=ListIdStore())
    msgs: list = [{"role": "user", "content": data.draw(text())}]
    state = {"calls": 0, "dynamic": False}
    for _ in range(data.draw(st.integers(1, 6))):
        tools = data.draw(st.sampled_from([None, [BASH]]))
        options = data.draw(st.sampled_from(OPTIONS))
        before = list(enc.ids)
        r = enc.append(msgs, tools, options)
        expected = encode_xtml(k3_tok, msgs, tools, options)
        assert list(enc.ids) == expected
        assert before[:len(before) - r.rolled_back] + r.new_ids == expected
        _step(data, msgs, state)


def test_default_store_hashes_the_pages(k3_tok):
    from kvtier.cache import block_hashes

    enc = session_encoder(k3_tok, page_size=16, salt=b"s")
    assert isinstance(enc, XtmlSessionEncoder)
    msgs = [{"role": "user", "content": "hello there " * 20}]
    enc.append(msgs, [BASH], XtmlOptions(thinking_effort="low"))
    ids = [int(i) for i in enc.ids]
    assert ids == encode_xtml(k3_tok, msgs, [BASH], XtmlOptions(thinking_effort="low"))
    assert enc.block_hashes() == block_hashes(ids, 16, salt=b"s")


def test_tails_roll_back_to_the_end_of_the_last_history_message(k3_tok):
    enc = XtmlSessionEncoder(k3_tok, store=ListIdStore())
    msgs = [{"role": "user", "content": "q1"}]
    enc.append(msgs, [BASH], XtmlOptions(tool_choice="required", response_format={"type": "json_object"}))
    turn1 = len(enc)
    history = encode_xtml(k3_tok, msgs, [BASH], XtmlOptions(), add_generation_prompt=False)
    msgs = msgs + [{"role": "assistant", "content": "a1", "reasoning_content": "r"}, {"role": "user", "content": "q2"}]
    r = enc.append(msgs, [BASH])
    assert r.rolled_back == turn1 - len(history)  # the tails and the generation prompt, none of the history
    assert list(enc.ids)[:len(history)] == history
    assert list(enc.ids) == encode_xtml(k3_tok, msgs, [BASH])


def test_a_sampled_turn_rendered_back_is_a_pure_append(k3_tok):
    """After the plain generation prompt, the answer renders back exactly: nothing rolls back."""
    enc = XtmlSessionEncoder(k3_tok, store=ListIdStore())
    msgs = [{"role": "user", "content": "hi"}]
    enc.append(msgs, options=XtmlOptions(thinking=False))
    msgs.append({"role": "assistant", "content": "hello"})
    msgs.append({"role": "user", "content": "more"})
    r = enc.append(msgs, options=XtmlOptions(thinking=False))
    gen = len(k3_tok.encode('<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'))
    assert r.rolled_back == gen  # the generation prompt is re-encoded as the start of the assistant part


def test_a_refused_turn_leaves_the_session_unchanged(k3_tok):
    enc = XtmlSessionEncoder(k3_tok, store=ListIdStore())
    msgs = [{"role": "user", "content": "hi"}]
    enc.append(msgs)
    ids, text_ = list(enc.ids), enc.text
    bad = copy.deepcopy(msgs) + [{"role": "user", "content": "x", "tools": [BASH]}]
    with pytest.raises(ValueError, match=r"messages\[1\]\.tools"):
        enc.append(bad)
    assert list(enc.ids) == ids and enc.text == text_
    assert enc.append(msgs).new_ids == []


def test_session_encoder_follows_the_tokenizer(tok, k3_tok):
    assert isinstance(session_encoder(tok), SessionEncoder)
    assert isinstance(session_encoder(k3_tok), XtmlSessionEncoder)
    with pytest.raises(ValueError, match="tokenizer: speaks k3-xtml"):
        SessionEncoder(k3_tok)
    with pytest.raises(ValueError, match="tokenizer: XtmlSessionEncoder needs"):
        XtmlSessionEncoder(tok)
