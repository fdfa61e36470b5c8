"""The resume target: turns resuming a session after a tool wait, misses of ``--resume-ttft-s`` by
why, counted by the session store and exposed in ``/metrics``."""

from __future__ import annotations

import openai
import pytest

from kvtier.serve.api.resume import ResumeTracker, miss_reason, shared_prefix
from tests.helpers.resume_finals import _final
from tests.serve.api.conftest import start_server, stop_server
from tests.serve.api.tool_waits import settle, tool_waits


@pytest.mark.parametrize("ttft, kept, cached, tiers, why", [
    (0.5, 64, 64, {"device": 64}, None),  # within the target
    (None, 64, 0, {}, None),  # no first token: not a resume that missed
    (2.0, 64, 48, {"device": 48}, "evicted"),
    (2.0, 64, 64, {"device": 32, "host": 32}, "prefetch_late"),
    (2.0, 64, 64, {"device": 48, "disk": 16}, "prefetch_late"),
    (2.0, 64, 64, {"device": 64}, "queued"),
    (2.0, 160, 96, {"device": 96}, "queued"),  # capped at the prompt's full pages before its last token
])
def test_miss_reasons(ttft, kept, cached, tiers, why):
    assert miss_reason(ttft, 1.0, kept, 100, cached, tiers, 16) == why
    # an own prefill within the target leaves the reason as it was
    assert miss_reason(ttft, 1.0, kept, 100, cached, tiers, 16, prefill_s=lambda n, c: 0.9) == why
    assert miss_reason(ttft, 1.0, kept, 100, cached, tiers, 16, prefill_s=lambda n, c: None) == why  # no fit yet


@pytest.mark.parametrize("cached, tiers", [(48, {"device": 48}), (64, {"device": 32, "host": 32}),
                                           (64, {"device": 64})])
def test_an_own_prefill_over_the_target_is_counted_before_the_pools_reasons(cached, tiers):
    asked = []

    def prefill_s(new_tokens, cached_tokens):
        asked.append((new_tokens, cached_tokens))
        return 1.5

    assert miss_reason(2.0, 1.0, 64, 100, cached, tiers, 16, prefill_s=prefill_s) == "prefill"
    assert asked == [(36, 64)]  # the prompt past the 64 tokens it can find in full pages
    assert miss_reason(0.5, 1.0, 64, 100, cached, tiers, 16, prefill_s=prefill_s) is None  # met all the same
    assert len(asked) == 1  # a met resume asks for no estimate


def test_the_tracker_asks_the_own_prefill_of_the_tokens_past_those_it_can_find():
    asked = []

    def prefill_s(new_tokens, cached_tokens):
        asked.append((new_tokens, cached_tokens))
        return 5.0 if new_tokens > 40 else 0.1

    t = ResumeTracker(16, target_s=1.0, prefill_s=prefill_s)
    t.begin("a", list(range(70)))
    t.accepted("a", list(range(60)) + [7] * 40)  # 48 shared in full pages: 52 of 100 tokens are its own
    t.end("a", _final(ttft_s=3.0, cached=48))
    t.begin("b", list(range(90)))
    t.accepted("b", list(range(90)) + [7] * 10)  # 80 shared in full pages: 20 its own
    t.end("b", _final(ttft_s=3.0, cached=80))
    t.begin("c", list(range(90)))
    t.accepted("c", list(range(90)) + [7] * 10)
    t.end("c", _final(ttft_s=0.5, cached=80))  # within the target: no estimate asked
    assert asked == [(52, 48), (20, 80)]
    assert t.snapshot()["misses"] == {"evicted": 0, "prefetch_late": 0, "queued": 1, "prefill": 1}


def test_shared_prefix():
    assert shared_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert shared_prefix([1, 2], [1, 2, 3]) == 2 and shared_prefix([], [1]) == 0 and shared_prefix([9], [1]) == 0


def test_tracker_counts_resumes_and_misses_by_reason():
    t = ResumeTracker(16, target_s=1.0)
    t.begin("a", list(range(70)))
    t.accepted("a", list(range(60)) + [7] * 40)  # shares 60 tokens: 48 in full pages
    t.end("a", _final(ttft_s=3.0, cached=32))
    t.begin("b", list(range(40)))
    t.accepted("b", list(range(50)))
    t.end("b", _final(ttft_s=3.0, cached=32))  # 32 shared in full pages, all found on the device
    t.begin("c", list(range(40)))
    t.end("c", None)  # aborted: not counted
    t.end("d", _final())  # not a resume
    t.begin("e", list(range(40)))
    t.accepted("e", list(range(50)))
    t.end("e", _final(ttft_s=0.2))  # within the target
    assert t.snapshot() == {"resumes": 3, "misses": {"evicted": 1, "prefetch_late": 0, "queued": 1, "prefill": 0},
                            "target_s": 1.0}
    with pytest.raises(ValueError, match="--resume-ttft-s"):
        t.set_target(0.0)


def test_serve_checks_the_target_before_loading(capsys):
    from kvtier.cli import main

    assert main(["serve", "tiny", "--tokenizer", "x", "--resume-ttft-s", "-1"]) == 2
    assert "--resume-ttft-s must be" in capsys.readouterr().err


def test_a_resumed_turn_over_the_target_is_counted_in_metrics(tmp_path):
    """A target no turn can meet (1 us) with a pool that evicts nothing: the resumed turn finds
    its whole shared prefix on the device, so it missed for time spent queued or computing, or for
    its own prefill once the scheduler's step-time model has its first fit."""
    s = start_server(tmp_path, "--num-device-pages", "512", "--resume-ttft-s", "0.000001")
    try:
        client = s.client()
        tools = [{"type": "function", "function": {"name": "ls", "parameters": {
            "type": "object", "properties": {"path": {"type": "string", "maxLength": 8}}, "required": ["path"]}}}]
        msgs = [{"role": "user", "content": "list the repository"}]
        kw = dict(model="tiny", tools=tools, temperature=0, extra_body={"session_id": "resume-1"})
        first = client.chat.completions.create(messages=msgs, tool_choice="required", max_tokens=48, **kw)
        m = first.choices[0].message
        assert m.tool_calls
        before, expired0 = tool_waits(s)
        assert before == 1
        msgs += [m.model_dump(exclude_none=True)]
        # a tool result answering no call is refused (as OpenAI does) and is not the resume
        with pytest.raises(openai.BadRequestError, match=r"messages\[2\]\.tool_call_id"):
            client.chat.completions.create(messages=msgs + [{"role": "tool", "tool_call_id": "call_none",
                                                             "content": "a.py"}], max_tokens=4, **kw)
        assert tool_waits(s)[0] == 1
        msgs += [{"role": "tool", "tool_call_id": c.id, "content": "a.py"} for c in m.tool_calls]
        second = client.chat.completions.create(messages=msgs, tool_choice="none", max_tokens=4, **kw)
        assert second.usage.prompt_tokens_details.cached_tokens > 0
        assert settle(s, 0, expired0)
        got = s.metrics()
        assert got[("kvtier_resumes_total",)] == 1
        misses = {r: got[("kvtier_resume_slo_misses_total", ("reason", r))]
                  for r in ("evicted", "prefetch_late", "queued", "prefill")}
        assert misses["evicted"] == misses["prefetch_late"] == 0 and misses["queued"] + misses["prefill"] == 1
    finally:
        stop_server(s)
