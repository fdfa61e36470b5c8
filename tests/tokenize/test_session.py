"""SessionEncoder: canonical incremental ids == full re-encode after every turn, rollback, tito."""

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.tokenize import SessionEncoder, render_chat

from .parts import ARGS, text, tool_call

TOOLS_A = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
TOOLS_B = TOOLS_A + [{"type": "function", "function": {"name": "read", "description": "读文件 <|im_end|>"}}]


def _step(data, msgs: list, state: dict) -> None:
    """Mutate the conversation like a client would: mostly appends, sometimes edits or new tools."""
    kind = data.draw(st.sampled_from(["user", "user", "assistant", "tools", "final", "edit", "tools_change",
                                      "system_first", "noop"]))
    if kind == "user":
        msgs.append({"role": "user", "content": data.draw(text())})
    elif kind in ("assistant", "final"):
        msgs.append({"role": "assistant", "content": data.draw(text()),
                     "reasoning_content": data.draw(text(allow_long=False))})
    elif kind == "tools":
        n = data.draw(st.integers(1, 3))
        calls = [tool_call(state["calls"] + k, data.draw(ARGS)) for k in range(n)]
        state["calls"] += n
        msgs.append({"role": "assistant", "content": data.draw(st.one_of(st.none(), text())), "tool_calls": calls,
                     "reasoning_content": data.draw(text(allow_long=False))})
        for c in calls:
            msgs.append({"role": "tool", "tool_call_id": c["id"], "content": data.draw(text()), "name": "bash"})
    elif kind == "edit" and msgs:
        i = data.draw(st.integers(0, len(msgs) - 1))
        if isinstance(msgs[i].get("content"), str):
            msgs[i] = {**msgs[i], "content": msgs[i]["content"] + data.draw(st.sampled_from(["", "x", "<|im_end|>", " 改"]))}
    elif kind == "tools_change":
        state["tools"] = data.draw(st.sampled_from([None, TOOLS_A, TOOLS_B]))
    elif kind == "system_first":
        msgs.insert(0, {"role": "system", "content": data.draw(text(allow_long=False))})


def _check_conversation(tok, data, steps: int):
    thinking = data.draw(st.booleans())
    gen = data.draw(st.booleans())
    enc = SessionEncoder(tok, thinking=thinking, add_generation_prompt=gen)
    msgs, state = [], {"calls": 0, "tools": data.draw(st.sampled_from([None, TOOLS_A]))}
    for _ in range(steps):
        _step(data, msgs, state)
        before = list(enc.ids)
        r = enc.append(copy.deepcopy(msgs), state["tools"])
        full = tok.encode(render_chat(msgs, state["tools"], add_generation_prompt=gen, thinking=thinking))
        assert list(enc.ids) == full
        assert before[:len(before) - r.rolled_back] + r.new_ids == full
        assert r.rolled_back <= len(before)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_canonical_incremental_equals_full_encode(tok, data):
    _check_conversation(tok, data, steps=10)


@pytest.mark.slow
@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_canonical_incremental_equals_full_encode_many(tok, data):
    _check_conversation(tok, data, steps=14)


def test_append_only_does_not_roll_back_and_encodes_only_the_suffix(tok):
    enc = SessionEncoder(tok)
    msgs = [{"role": "user", "content": "hello"}]
    enc.append(msgs)
    n = len(enc.ids)
    msgs += [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}]
    r = enc.append(msgs)
    assert r.rolled_back == 0 and list(enc.ids[:n]) == tok.encode(render_chat(msgs[:1]))
    assert enc.append(msgs) == type(r)([], 0)  # unchanged conversation: nothing to do


def test_history_edit_rolls_back_to_the_edited_turn(tok):
    enc = SessionEncoder(tok)
    msgs = [{"role": "user", "content": "a" * 50}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    enc.append(msgs)
    total = len(enc.ids)
    msgs[1] = {"role": "assistant", "content": "B"}
    r = enc.append(msgs)
    assert 0 < r.rolled_back < total  # the first user turn is kept
    assert list(enc.ids) == tok.encode(render_chat(msgs))


def test_changed_tools_roll_back_to_the_declaration(tok):
    enc = SessionEncoder(tok)
    msgs = [{"role": "user", "content": "x"}]
    enc.append(msgs, TOOLS_A)
    n = len(enc.ids)
    r = enc.append(msgs, TOOLS_B)
    assert r.rolled_back == n - len(tok.encode("<|im_system|>tool_declare<|im_middle|>"))
    assert list(enc.ids) == tok.encode(render_chat(msgs, TOOLS_B))


def test_thinking_final_answer_drops_reasoning(tok):
    enc = SessionEncoder(tok, thinking=True)
    call = tool_call(0, "{}")
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "reasoning_content": "long reasoning", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "out"}]
    enc.append(msgs)
    assert "long reasoning" in tok.decode(enc.ids)
    msgs.append({"role": "assistant", "content": "done", "reasoning_content": "r"})
    r = enc.append(msgs)
    assert r.rolled_back > 0 and "long reasoning" not in tok.decode(enc.ids)
    assert list(enc.ids) == tok.encode(render_chat(msgs, thinking=True))


def test_tito_keeps_sampled_ids(tok):
    enc = SessionEncoder(tok, mode="tito")
    msgs = [{"role": "user", "content": "say hello"}]
    enc.append(msgs)
    # a non-canonical split of "hello" the model could have sampled
    sampled = tok.encode("hel") + tok.encode("lo") + [tok.token_id("<|im_end|>")]
    assert sampled[:-1] != tok.encode("hello")
    enc.append_generated(sampled)
    prefix = list(enc.ids)
    msgs += [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    r = enc.append(msgs)
    assert r.rolled_back == 0 and list(enc.ids[:len(prefix)]) == prefix
    assert tok.decode(enc.ids) == render_chat(msgs)
    # the client edits the answer: the sampled turn is rolled back and re-encoded canonically
    msgs[1] = {"role": "assistant", "content": "hi"}
    r = enc.append(msgs)
    assert r.rolled_back > 0 and list(enc.ids) == tok.encode(render_chat(msgs))


def test_tito_errors(tok):
    with pytest.raises(ValueError, match="mode='tito'"):
        SessionEncoder(tok).append_generated([1])
    with pytest.raises(ValueError, match="generation prompt"):
        SessionEncoder(tok, mode="tito").append_generated([1])
    with pytest.raises(ValueError, match="mode must be"):
        SessionEncoder(tok, mode="fast")


def test_bad_messages_leave_session_unchanged(tok):
    enc = SessionEncoder(tok)
    msgs = [{"role": "user", "content": "ok"}]
    enc.append(msgs)
    ids = list(enc.ids)
    with pytest.raises(ValueError, match=r"messages\[1\]\.role"):
        enc.append(msgs + [{"role": "bot", "content": "x"}])
    assert list(enc.ids) == ids and enc.append(msgs).new_ids == []


def test_in_place_edit_is_seen(tok):
    enc = SessionEncoder(tok)
    msgs = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"}]
    enc.append(msgs)
    msgs[0]["content"] = "changed in place"
    r = enc.append(msgs)
    assert r.rolled_back > 0 and list(enc.ids) == tok.encode(render_chat(msgs))


def test_default_store_is_the_cpp_buffer_when_built(tok):
    from kvtier import _C

    enc = SessionEncoder(tok, page_size=16)
    enc.append([{"role": "user", "content": "hello " * 40}])
    if hasattr(_C, "TokenBuffer"):
        from kvtier.cache import block_hashes

        assert enc._store.block_hashes() == block_hashes(list(enc.ids), 16)
    assert list(enc.ids) == tok.encode(render_chat([{"role": "user", "content": "hello " * 40}]))


@pytest.mark.parametrize("store", ["default", "list"])
def test_ids_kept_across_turns_are_a_snapshot(tok, store):
    """Keeping ``enc.ids`` never blocks later appends (no pinned C++ view) and never changes."""
    from kvtier.tokenize import ListIdStore

    enc = SessionEncoder(tok, store=ListIdStore() if store == "list" else None, page_size=4)
    msgs = [{"role": "user", "content": "hi"}]
    enc.append(msgs)
    kept = enc.ids
    first = list(kept)
    for k in range(12):  # grows far past any initial capacity, with a rollback in between
        msgs.append({"role": "assistant" if k % 2 else "user", "content": f"turn {k} " + "数据 " * 300})
        if k == 6:
            msgs[1]["content"] = "edited"
        enc.append(msgs)
    assert list(kept) == first
    ids = enc.ids
    ids[0] = 0 if ids[0] else 1  # the caller's copy: writing to it leaves the session alone
    assert list(enc.ids) == tok.encode(render_chat(msgs))


def test_tools_changed_in_place_are_seen(tok):
    enc = SessionEncoder(tok)
    tools = copy.deepcopy(TOOLS_A)
    msgs = [{"role": "user", "content": "go"}]
    enc.append(msgs, tools)
    tools[0]["function"]["name"] = "shell"
    r = enc.append(msgs, tools)
    assert r.rolled_back > 0 and list(enc.ids) == tok.encode(render_chat(msgs, tools))
