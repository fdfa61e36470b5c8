"""Alternatives per generated token: chat ``top_logprobs`` (0-20, with ``logprobs: true``) and a
completion's ``logprobs`` N (0-5), as OpenAI defines them, streamed and not."""

from __future__ import annotations

import math

import openai
import pytest

from kvtier import LLM, SamplingParams


def test_engine_returns_the_top_alternatives_of_the_distribution_it_reports():
    llm = LLM("tiny", page_size=16, num_device_pages=64)
    prompt = list(range(1, 40))
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=4))[0]
    assert len(out.top_logprobs) == len(out.token_ids) == 5
    for tok, lp, alts in zip(out.token_ids, out.logprobs, out.top_logprobs):
        assert len(alts) == 4 and [a[1] for a in alts] == sorted((a[1] for a in alts), reverse=True)
        assert alts[0][0] == tok and math.isclose(alts[0][1], lp, abs_tol=1e-6)  # greedy: the best one
        assert len({a[0] for a in alts}) == 4 and all(a[1] <= 0 for a in alts)
    plain = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=True))[0]
    assert plain.top_logprobs is None and plain.token_ids == out.token_ids
    assert max(abs(a - b) for a, b in zip(plain.logprobs, out.logprobs)) < 1e-4  # its prefix cached this time
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(top_logprobs=3)  # needs logprobs=True
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(logprobs=True, top_logprobs=21)


def test_chat_and_completions_return_alternatives(server):
    client = server.client()
    msgs = [{"role": "user", "content": "say something"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert content and all(len(c.top_logprobs) == 3 for c in content)
    for c in content:
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob >= c.top_logprobs[2].logprob
        assert math.isclose(c.top_logprobs[0].logprob, c.logprob, abs_tol=1e-5)  # greedy
        assert c.top_logprobs[0].token == c.token
    streamed = []
    for ch in client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0,
                                             logprobs=True, top_logprobs=2, stream=True):
        if ch.choices and ch.choices[0].logprobs is not None and ch.choices[0].logprobs.content:
            streamed += ch.choices[0].logprobs.content
    assert streamed and all(len(c.top_logprobs) == 2 for c in streamed)
    assert [c.token for c in streamed] == [c.token for c in content]

    t = client.completions.create(model="tiny", prompt="def main(", max_tokens=3, temperature=0, logprobs=2)
    lp = t.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(len(alts) <= 2 and max(alts.values()) >= v for alts, v in zip(lp.top_logprobs, lp.token_logprobs))

    for bad in (dict(logprobs=True, top_logprobs=21), dict(top_logprobs=2)):
        with pytest.raises(openai.BadRequestError, match="top_logprobs"):
            client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, **bad)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, logprobs=6)
