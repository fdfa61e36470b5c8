"""Requests with tools through the engine: the tiny random model (noise) under the tool grammar."""

import dataclasses

import pytest
from kvtier import SamplingParams

from tests.toolcall.sweep import check_arguments, k2vv_cases, walle_cases
from tests.toolcall.conftest import UNGENERABLE_TOOL
from tests.helpers.tool_schemas import LS, SEARCH

ASK = [{"role": "user", "content": "list the repository"}]


@pytest.fixture(scope="module")
def llm(tok_dir):
    from kvtier import LLM

    return LLM("tiny", tokenizer=tok_dir, num_device_pages=1024)


def test_sampling_params_check_tools():
    p = SamplingParams(tools=[SEARCH, LS], tool_choice="required")
    assert (
        p.tool_grammar.startswith("%llguidance") and "functions.ls:" in p.tool_grammar
    )
    assert (
        SamplingParams().tool_grammar is None
        and SamplingParams(tool_choice="none").tool_grammar is None
    )
    assert dataclasses.replace(p, tool_choice="none").tool_grammar != p.tool_grammar
    with pytest.raises(
        ValueError,
        match=r"tools\[0\]\.function\.parameters: unsupported keywords: format",
    ):
        SamplingParams(
            tools=[
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"format": "date"}},
                }
            ]
        )
    with pytest.raises(ValueError, match="'required' needs at least one tool"):
        SamplingParams(tool_choice="required")
    with pytest.raises(ValueError, match="parallel_tool_calls must be True or False"):
        SamplingParams(tools=[LS], parallel_tool_calls=1)


def test_tools_need_a_tokenizer():
    from kvtier import LLM

    with pytest.raises(
        ValueError, match=r"sampling_params\[0\]\.tools needs a tokenizer"
    ):
        LLM("tiny", num_device_pages=16).generate(
            prompt_token_ids=[[1, 2]], sampling_params=SamplingParams(tools=[LS])
        )


def test_chat_tool_choices(llm):
    schemas = {
        "search": SEARCH["function"]["parameters"],
        "ls": LS["function"]["parameters"],
    }
    for choice, names, temperature in [
        ("required", {"search", "ls"}, 0.0),
        ({"type": "function", "function": {"name": "ls"}}, {"ls"}, 1.0),
    ]:
        params = SamplingParams(max_tokens=32, temperature=temperature, seed=3)
        out = llm.chat(
            ASK, tools=[SEARCH, LS], tool_choice=choice, sampling_params=params
        )
        assert (
            out.finish_reason == "stop"
            and out.tool_calls
            and out.tool_call_problems == []
        ), out
        assert out.content == "" and len(out.token_ids) <= 32
        for call in out.tool_calls:
            assert call["name"] in names and call["id"].startswith(
                f"functions.{call['name']}:"
            )
            assert check_arguments(call["arguments"], schemas[call["name"]]) is None, (
                call
            )
    out = llm.chat(
        ASK,
        tools=[SEARCH, LS],
        tool_choice="none",
        sampling_params=SamplingParams(max_tokens=8, seed=3),
    )
    assert out.tool_calls == [] and out.content == llm.tokenizer.decode(
        out.token_ids
    ).removesuffix("<|im_end|>")


def test_a_failing_grammar_fails_only_its_request_and_others_are_unaffected(llm):
    """Also: an unconstrained request in the batch gets the tokens it gets alone, and a turn cut by
    max_tokens reports its open call as incomplete."""
    prompt = llm.tokenizer.encode("hello")
    plain = SamplingParams(max_tokens=6, temperature=0.0)
    alone = llm.generate(prompt_token_ids=[prompt], sampling_params=plain)[0]

    outs = llm.generate(
        prompt_token_ids=[prompt] * 4,
        sampling_params=[
            plain,
            SamplingParams(max_tokens=6, tools=[UNGENERABLE_TOOL], tool_choice="required"),
            SamplingParams(
                max_tokens=32, tools=[LS], tool_choice="required", temperature=0.0
            ),
            # Too short for any complete call: cut, and the open call is reported.
            SamplingParams(max_tokens=8, tools=[LS], tool_choice="required"),
        ],
    )
    assert outs[0].token_ids == alone.token_ids and outs[0].finish_reason == "length"
    assert (
        outs[1].finish_reason == "error"
        and "does not compile" in outs[1].error
        and outs[1].token_ids == []
    )
    assert outs[2].finish_reason == "stop" and outs[2].tool_calls
    assert outs[3].finish_reason == "length" and outs[3].tool_calls == []
    assert [p["kind"] for p in outs[3].tool_call_problems] == ["incomplete"]
    assert outs[3].tool_call_problems[0]["id"].startswith("functions.ls:")


def test_real_requests_and_walle_tools_give_valid_calls(llm):
    """A few K2-Vendor-Verifier requests and walle schemas at temperatures 0 and 1 (the full sweep
    is ``test_sweep.py``, slow)."""
    from tests.toolcall.sweep import run

    cases = k2vv_cases()[:2] + walle_cases()[::40]
    for temperature in (0.0, 1.0):
        tally = run(llm, cases, temperature, seed=7, slack=8)
        assert tally.requests == len(cases) and tally.complete == len(cases), (
            tally.failures
        )
        assert tally.calls >= len(cases) and tally.valid_calls == tally.calls, (
            tally.failures
        )


def _summary(events) -> dict:
    """What a run of parser events says: the fields a RequestOutput reports."""
    kinds = lambda name: [e for e in events if type(e).__name__ == name]  
    return {"content": "".join(e.text for e in kinds("ContentDelta")),
            "reasoning_content": "".join(e.text for e in kinds("ReasoningDelta")),
            "tool_calls": [e.to_dict() for e in kinds("ToolCall")],
            "tool_call_problems": [e.to_dict() for e in kinds("ToolCallProblem")]}


def _reported(out) -> dict:
    return {k: getattr(out, k) for k in ("content", "reasoning_content", "tool_calls", "tool_call_problems")}


@pytest.mark.parametrize("max_tokens", [48, 6], ids=["calls", "cut"])
def test_llm_chat_parses_each_turn_once(llm, tool_call_parsers, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=3)
    out = llm.chat(ASK, tools=[SEARCH, LS], tool_choice="required", sampling_params=params)
    assert len(tool_call_parsers) == 1
    assert out.tool_calls if max_tokens == 48 else out.tool_call_problems[0]["kind"] == "incomplete"
    # the output's fields are its one parser's events
    assert out.events and _summary(out.events) == _reported(out)


def test_take_events_streams_the_parse_the_output_reports(llm, tool_call_parsers):
    """Events taken after each step, then the output's rest, are the one parse of the turn: each
    call is taken in the step its ``<|tool_call_end|>`` is sampled, before the turn ends."""
    from kvtier.serve.chat import add_chat_request, new_encoder

    engine = llm.engine
    if engine.tokenizer is None:  # LLM attaches it on the first chat or tools request
        engine.attach_tokenizer(llm.tokenizer)
    params = SamplingParams(max_tokens=48, temperature=0.0, seed=3, tools=[SEARCH, LS], tool_choice="required")
    rid = add_chat_request(engine, new_encoder(engine, llm.tokenizer), ASK, params)
    end = llm.tokenizer.token_id("<|tool_call_end|>")
    taken, steps_of_calls, out = [], [], None
    while out is None:
        done = {o.request_id: o for o in engine.step()}
        out = done.get(rid)
        if out is None:
            new = engine.take_events(rid)
            taken += new
            steps_of_calls += [len(engine.sequence(rid).output_token_ids)] * sum(
                type(e).__name__ == "ToolCall" for e in new)
    assert len(tool_call_parsers) == 1 and out.tool_calls
    assert _summary(taken + out.events) == _reported(out)
    ends = [i + 1 for i, t in enumerate(out.token_ids) if t == end]
    assert steps_of_calls and steps_of_calls == ends[:len(steps_of_calls)] and len(steps_of_calls) >= len(ends) - 1
    assert engine.take_events(rid) == []  # reported: nothing more
