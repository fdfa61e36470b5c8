"""Sessions keep the ids a turn sampled (K2's template and K3's XTML): the assistant message a
client sends back in its own serialisation keeps them; edited history re-renders from the first
difference and never keeps stale ids."""

from __future__ import annotations

import json

import pytest

from kvtier.tokenize import ChatFormat, SessionEncoder
from kvtier.tokenize.chat import render_chat
from kvtier.tokenize.sampled import message_key
from kvtier.tokenize.xtml import XtmlOptions, encode_xtml
from kvtier.tokenize.xtml_session import XtmlSessionEncoder

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "read a file",
                                            "parameters": {"type": "object", "properties": {
                                                "path": {"type": "string"}, "limit": {"type": "integer"}}}}}]
OPTS = XtmlOptions(thinking=False)


def _sampled_k2(tok, text: str) -> list[int]:
    """Ids a model could sample for ``text`` that are not its canonical encoding (a token split in
    two) and end with ``<|im_end|>``."""
    ids = tok.encode(text)
    split = [i for i in ids if len(tok.decode([i])) > 1][0]
    k = ids.index(split)
    s = tok.decode([split])
    odd = ids[:k] + tok.encode(s[:1]) + tok.encode(s[1:]) + ids[k + 1:]
    assert tok.decode(odd) == tok.decode(ids) and odd != ids
    return odd + [tok.token_id("<|im_end|>")]


def _k2_call_text(args: str) -> str:
    return ("<|tool_calls_section_begin|><|tool_call_begin|>functions.read_file:0<|tool_call_argument_begin|>"
            f"{args}<|tool_call_end|><|tool_calls_section_end|>")


def _k2_turn(tok, enc, messages):
    enc.append(messages, TOOLS)
    prompt = list(enc.ids)
    body = "Let me look." + _k2_call_text('{"path": "a.py", "limit": 5}')
    ids = _sampled_k2(tok, body)
    message = {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "functions.read_file:0", "type": "function",
         "function": {"name": "read_file", "arguments": '{"path": "a.py", "limit": 5}'}}]}
    assert enc.append_generated(ids, message)
    return prompt, ids, message


def test_message_key_ignores_serialisation():
    a = {"role": "assistant", "content": "x", "tool_calls": [
        {"id": "1", "function": {"name": "f", "arguments": '{"a": 1, "b": [2]}'}}]}
    b = {"role": "assistant", "content": [{"type": "text", "text": "x"}], "tool_calls": [
        {"id": "other", "type": "function", "function": {"name": "f", "arguments": {"b": [2], "a": 1}}}]}
    assert message_key(a) == message_key(b)
    assert message_key({**b, "reasoning_content": "r"}) != message_key(a)
    swapped = {**a, "tool_calls": a["tool_calls"] + [{"function": {"name": "g", "arguments": "{}"}}]}
    assert message_key(swapped) != message_key({**a, "tool_calls": swapped["tool_calls"][::-1]})
    assert message_key({"role": "user", "content": "x"}) is None


def test_k2_keeps_sampled_ids_whatever_the_serialisation(tok):
    enc = SessionEncoder(tok, "tito")
    msgs = [{"role": "user", "content": "open a.py"}]
    prompt, ids, message = _k2_turn(tok, enc, msgs)
    # the client re-dumps the arguments (other spacing and key order) and sends a tool result
    back = {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "functions.read_file:0", "type": "function",
         "function": {"name": "read_file", "arguments": json.dumps({"limit": 5, "path": "a.py"})}}]}
    nxt = msgs + [back, {"role": "tool", "tool_call_id": "functions.read_file:0", "content": "print(1)"}]
    r = enc.append(nxt, TOOLS)
    assert r.rolled_back == 0
    kept = prompt + ids[:-1]
    assert list(enc.ids[:len(kept)]) == kept and enc.ids[len(kept)] == tok.token_id("<|im_end|>")
    assert list(enc.ids[len(kept) + 1:]) == tok.encode(render_chat(nxt, TOOLS)[len(render_chat(msgs + [back], TOOLS,
                                                                                              False)):])
    # unchanged next turn: still kept
    enc.append(nxt + [{"role": "user", "content": "thanks"}], TOOLS)
    assert list(enc.ids[:len(kept)]) == kept


@pytest.mark.parametrize("edit", ["answer", "reorder", "truncate", "tools", "earlier"])
def test_k2_edited_history_re_renders(tok, edit):
    enc = SessionEncoder(tok, "tito")
    msgs = [{"role": "user", "content": "open a.py"}]
    _k2_turn(tok, enc, msgs)
    back = {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "functions.read_file:0", "type": "function",
         "function": {"name": "read_file", "arguments": '{"path": "a.py", "limit": 5}'}}]}
    tools = TOOLS
    if edit == "answer":
        back["content"] = "Let me see."
    elif edit == "reorder":
        back["tool_calls"].append({"id": "functions.read_file:1", "type": "function",
                                   "function": {"name": "read_file", "arguments": '{"path": "b.py"}'}})
        back["tool_calls"].reverse()
    elif edit == "truncate":
        back["content"] = "Let me"
    elif edit == "tools":
        tools = TOOLS + [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
    elif edit == "earlier":
        msgs = [{"role": "user", "content": "open b.py"}]
    nxt = msgs + [back, {"role": "user", "content": "go on"}]
    enc.append(nxt, tools)
    assert list(enc.ids) == tok.encode(render_chat(nxt, tools))
    assert not enc.sampled


def _k3_turn(k3_tok, enc, messages):
    """Append ``messages`` and a sampled tool-call turn (its canonical ids with one token split);
    returns (prompt ids, sampled ids)."""
    enc.append(messages, TOOLS, OPTS)
    prompt = list(enc.ids)
    answer = {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path":"a.py","limit":5}'}}]}
    no_gen = encode_xtml(k3_tok, messages, TOOLS, OPTS, add_generation_prompt=False)
    part = encode_xtml(k3_tok, messages + [answer], TOOLS, OPTS, add_generation_prompt=False)[len(no_gen):]
    gen = prompt[len(no_gen):]
    assert part[:len(gen)] == gen  # the history message starts as the generation prompt
    tail = part[len(gen):]
    look = k3_tok.encode_segment("Let me look.")
    k = tail.index(look[0])
    ids = tail[:k] + k3_tok.encode_segment("Le") + k3_tok.encode_segment("t me look.") + tail[k + len(look):]
    assert ids != tail and ids[-1] == k3_tok.token_id("<|end_of_msg|>")
    assert enc.append_generated(ids, answer)
    return prompt, ids


def test_k3_keeps_sampled_ids_and_names_boundaries(k3_tok):
    enc = XtmlSessionEncoder(k3_tok)
    msgs = [{"role": "user", "content": "open a.py"}]
    opts = XtmlOptions(thinking=False, tool_choice="required")
    enc.append(msgs, TOOLS, opts)
    b = enc.boundaries()
    no_tail = encode_xtml(k3_tok, msgs, TOOLS, OPTS, add_generation_prompt=False)
    assert b["history"] == len(no_tail)
    assert b["tools"] == len(encode_xtml(k3_tok, [{"role": "user", "content": ""}], TOOLS, OPTS,
                                         add_generation_prompt=False)) - len(
        encode_xtml(k3_tok, [{"role": "user", "content": ""}], None, OPTS, add_generation_prompt=False))
    enc2 = XtmlSessionEncoder(k3_tok)
    prompt, ids = _k3_turn(k3_tok, enc2, msgs)
    back = {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": {"limit": 5, "path": "a.py"}}}]}
    nxt = msgs + [back, {"role": "tool", "tool_call_id": "c1", "content": "print(1)"}]
    r = enc2.append(nxt, TOOLS, opts)
    assert r.rolled_back <= len(prompt) - len(encode_xtml(k3_tok, msgs, TOOLS, OPTS, add_generation_prompt=False))
    assert list(enc2.ids[:len(prompt) + len(ids)]) == prompt + ids
    after = encode_xtml(k3_tok, nxt, TOOLS, opts)
    before = encode_xtml(k3_tok, msgs + [back], TOOLS, opts, add_generation_prompt=False)
    before_tails = len(before) - (len(encode_xtml(k3_tok, msgs + [back], TOOLS, OPTS, add_generation_prompt=False)))
    assert list(enc2.ids[len(prompt) + len(ids):]) == after[len(before) - before_tails:]
    # a third turn that keeps the history keeps the ids; a changed answer re-renders
    enc2.append(nxt + [{"role": "user", "content": "ok"}], TOOLS, opts)
    assert list(enc2.ids[:len(prompt) + len(ids)]) == prompt + ids
    edited = msgs + [{**back, "content": "Let me see."}, nxt[2], {"role": "user", "content": "ok"}]
    enc2.append(edited, TOOLS, opts)
    assert list(enc2.ids) == encode_xtml(k3_tok, edited, TOOLS, opts)
    assert not enc2.sampled


@pytest.mark.parametrize("edit", ["reasoning", "reorder", "truncate", "tools", "earlier"])
def test_k3_edited_history_re_renders(k3_tok, edit):
    enc = XtmlSessionEncoder(k3_tok)
    msgs = [{"role": "user", "content": "open a.py"}]
    _k3_turn(k3_tok, enc, msgs)
    back = {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path":"a.py","limit":5}'}}]}
    tools = TOOLS
    if edit == "reasoning":
        back["reasoning_content"] = "hmm"
    elif edit == "reorder":
        back["tool_calls"].insert(0, {"id": "c0", "type": "function",
                                      "function": {"name": "read_file", "arguments": '{"path":"b.py"}'}})
    elif edit == "truncate":
        back["tool_calls"] = []
    elif edit == "tools":
        tools = TOOLS + [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
    elif edit == "earlier":
        msgs = [{"role": "user", "content": "open b.py"}]
    nxt = msgs + [back, {"role": "user", "content": "go on"}]
    enc.append(nxt, tools, OPTS)
    assert list(enc.ids) == encode_xtml(k3_tok, nxt, tools, OPTS)
    assert not enc.sampled


def test_k3_length_stop_keeps_nothing(k3_tok):
    enc = XtmlSessionEncoder(k3_tok)
    enc.append([{"role": "user", "content": "hi"}], None, OPTS)
    assert not enc.append_generated(k3_tok.encode_segment("Hello there"),
                                    {"role": "assistant", "content": "Hello there"})
    assert k3_tok.chat_format is ChatFormat.K3_XTML
