"""Kept sampled ids and the checkpoints where turns come back, on a hybrid model (``tiny-k3``,
fp32, K3's XTML): a prompt whose assistant turn keeps the ids the model sampled (not the ones its
text re-encodes to) is served from the cache with the greedy tokens and prompt log-probs of the
same prompt computed from scratch (<= 1e-4), reaching past the previous prompt; a new session with
the same tools reuses the tool declaration (a checkpoint at its end)."""

from __future__ import annotations

import pytest
import torch

from kvtier import LLM, SamplingParams
from kvtier.serve import Engine
from kvtier.serve.chat import new_encoder
from kvtier.tokenize.xtml import XtmlOptions, encode_xtml

TOL = 1e-4
PS = 16
GRID = 1024  # far past these prompts: only prompt ends, turn ends and the renderer's boundaries count
OPTS = XtmlOptions(thinking=False)
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository.",
                                            "parameters": {"type": "object", "properties": {
                                                "path": {"type": "string", "description": "the file's path"},
                                                "limit": {"type": "integer"}}, "required": ["path"]}}}]
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True, prompt_logprobs=True)


def _llm(k3_tok_dir, **kw) -> LLM:
    return LLM("tiny-k3", tokenizer=k3_tok_dir, dtype="float32", page_size=PS, num_device_pages=128,
               max_num_seqs=2, state_checkpoint_tokens=GRID, **kw)


@pytest.fixture(scope="module")
def llms(k3_tok_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield _llm(k3_tok_dir), _llm(k3_tok_dir, enable_prefix_caching=False)
    torch.set_num_threads(threads)


def _run(engine: Engine, ids, params=PARAMS, **kw):
    rid = engine.add_request(list(ids), params, **kw)
    out = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                out = o
    return out


def _sampled(tok, messages, answer) -> list[int]:
    """Ids a model could sample for ``answer`` after ``messages``' generation prompt: its canonical
    ids with one token split in two (so re-encoding the text would not give them back)."""
    no_gen = encode_xtml(tok, messages, TOOLS, OPTS, add_generation_prompt=False)
    gen = encode_xtml(tok, messages, TOOLS, OPTS)[len(no_gen):]
    part = encode_xtml(tok, messages + [answer], TOOLS, OPTS, add_generation_prompt=False)[len(no_gen):]
    tail = part[len(gen):]
    word = tok.encode_segment("Looking")
    k = tail.index(word[0])
    ids = tail[:k] + tok.encode_segment("Lo") + tok.encode_segment("oking") + tail[k + len(word):]
    assert ids != tail
    return ids


def test_kept_sampled_ids_served_from_cache_equal_recompute(llms):
    cached, scratch = llms
    tok, engine = cached.tokenizer, cached.engine
    messages = [{"role": "system", "content": "You are a coding agent. " * 6},
                {"role": "user", "content": "Open the main module and tell me what it does, please."}]
    answer = {"role": "assistant", "content": "Looking at it now.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path":"main.py"}'}}]}
    enc = new_encoder(engine, tok)
    enc.append(messages, TOOLS, OPTS)
    prompt = list(enc.ids)
    sampled = _sampled(tok, messages, answer)
    # the turn as the engine ran it: its prompt, then the sampled ids (their KV computed; the
    # last one, never run, is left out as a decode leaves it)
    _run(engine, prompt + sampled[:-1], checkpoint_at=tuple(enc.boundaries().values()))
    assert enc.append_generated(sampled, answer)
    # the client sends the call back re-serialised, with its result
    back = {**answer, "tool_calls": [{"id": "c1", "type": "function",
                                      "function": {"name": "read_file", "arguments": {"path": "main.py"}}}]}
    nxt = messages + [back, {"role": "tool", "tool_call_id": "c1", "content": "print('hello')\n" * 4}]
    enc.append(nxt, TOOLS, OPTS)
    ids = list(enc.ids)
    assert ids[:len(prompt) + len(sampled)] == prompt + sampled
    assert ids != encode_xtml(tok, nxt, TOOLS, OPTS)  # the kept ids are not the re-encoded ones

    hit = _run(engine, ids)
    ref = _run(scratch.engine, ids)
    reachable = (len(prompt) + len(sampled) - 1) // PS * PS
    assert hit.num_cached_tokens >= reachable > len(prompt)  # the sampled turn came back from the cache
    assert ref.num_cached_tokens == 0
    assert hit.token_ids == ref.token_ids
    assert max(abs(a - b) for a, b in zip(hit.logprobs, ref.logprobs)) <= TOL
    n = hit.num_cached_tokens  # prompt log-probs of the positions computed
    pairs = [(a, b) for a, b in zip(hit.prompt_logprobs[n:], ref.prompt_logprobs[n:]) if a is not None]
    assert pairs and max(abs(a - b) for a, b in pairs) <= TOL

    # an edited answer re-renders from it: the canonical ids, never the stale sampled ones
    edited = messages + [{**back, "content": "Looking at it."}, nxt[2]]
    enc.append(edited, TOOLS, OPTS)
    assert list(enc.ids) == encode_xtml(tok, edited, TOOLS, OPTS)


def test_new_session_with_same_tools_reuses_the_declaration(llms):
    cached = llms[0]
    tok, engine = cached.tokenizer, cached.engine
    first = [{"role": "system", "content": "Alpha agent. " * 5}, {"role": "user", "content": "hi"}]
    other = [{"role": "system", "content": "Beta agent. " * 5}, {"role": "user", "content": "hello"}]
    a = new_encoder(engine, tok)
    a.append(first, TOOLS, OPTS)
    tools_end = a.boundaries()["tools"]
    assert tools_end == len(encode_xtml(tok, first, TOOLS, OPTS)) - len(encode_xtml(tok, first, None, OPTS))
    assert tools_end >= 2 * PS
    _run(engine, a.ids, checkpoint_at=tuple(a.boundaries().values()))
    b = new_encoder(engine, tok)
    b.append(other, TOOLS, OPTS)
    shared = next(i for i, (x, y) in enumerate(zip(a.ids, b.ids)) if x != y)
    assert shared >= tools_end  # the declaration is the prefix the two sessions share
    out = _run(engine, b.ids, checkpoint_at=tuple(b.boundaries().values()))
    assert out.num_cached_tokens == tools_end // PS * PS
    # a third session with the same system prompt reaches the opening of its first user message
    c = new_encoder(engine, tok)
    third = [first[0], {"role": "user", "content": "x" + "y" * 40}]
    c.append(third, TOOLS, OPTS)
    shared = next(i for i, (x, y) in enumerate(zip(a.ids, c.ids)) if x != y)
    assert a.boundaries()["last_body"] == shared and shared // PS > tools_end // PS
    assert _run(engine, c.ids).num_cached_tokens == shared // PS * PS
