"""Streaming tool-call parser: chunking never changes the result; variants are tolerated; problems
are results, never exceptions."""

import json
import random

import pytest
from kvtier.toolcall import ContentDelta, ToolCall, ToolCallParser, ToolCallProblem

SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
STREAMS = [
    (
        f'Let me check 🔍.{SB}{CB}functions.search:1{AB}{{"queries":["大型机 订阅成本","a<b"]}}{CE}'
        f'{CB}functions.read_file:2{AB}{{"path":"src/<|x|>.py"}}{CE}{SE}<|im_end|>'
    ),
    f'<think>plan: call ls</think>ok{SB}{CB} search:0 {AB}  {{"q": 1}}\n{CE}{SE}',
    f'{CB}functions.ls:3{AB}{{"path":"."}}{CE}',  # no section markers
    f"x<|tool_call_section_begin|>{CB}functions.a:0{AB}{{}}{CE}<|tool_call_section_end|>",  # singular variant
    f'{SB}{CB}functions.bad:0{AB}{{"a":}}{CE}{CB}functions.cut:1{AB}{{"path":"/tm',  # invalid then truncated
]


def _summary(p: ToolCallParser):
    return p.content, p.reasoning, p.tool_calls, p.problems


def _chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(
        rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12)))
    )
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("stream", STREAMS)
def test_random_text_chunkings_match_the_whole(stream):
    whole = ToolCallParser()
    calls = [
        e
        for e in whole.feed_text(stream) + whole.finish()
        if isinstance(e, (ToolCall, ToolCallProblem))
    ]
    rng = random.Random(0)
    for _ in range(50):
        p = ToolCallParser()
        events = [e for c in _chunks(stream, rng) for e in p.feed_text(c)] + p.finish()
        assert _summary(p) == _summary(whole)
        assert (
            "".join(e.text for e in events if isinstance(e, ContentDelta))
            == whole.content
        )
        assert [
            e for e in events if isinstance(e, (ToolCall, ToolCallProblem))
        ] == calls


@pytest.mark.parametrize("stream", STREAMS)
def test_random_id_chunkings_match_the_whole(stream, tok):
    ids = tok.encode(stream)
    whole = ToolCallParser.for_tokenizer(tok)
    whole.feed_ids(ids)
    whole.finish()
    text_parser = ToolCallParser()
    text_parser.feed_text(tok.decode(ids))
    text_parser.finish()
    assert _summary(whole) == _summary(text_parser)
    rng = random.Random(1)
    for _ in range(30):
        p = ToolCallParser.for_tokenizer(tok)
        cuts = sorted(rng.sample(range(1, len(ids)), k=min(len(ids) - 1, 5)))
        for a, b in zip([0, *cuts], [*cuts, len(ids)]):
            p.feed_ids(ids[a:b])
        p.finish()
        assert _summary(p) == _summary(whole)


def test_calls_are_yielded_when_their_end_marker_arrives():
    p = ToolCallParser()
    assert p.feed_text(f"hi{SB}{CB}functions.search:1{AB}") == [ContentDelta("hi")]
    assert p.feed_text('{"queries":["x"]}') == []
    events = p.feed_text(f"{CE}")
    assert events == [ToolCall(0, "functions.search:1", "search", '{"queries":["x"]}')]


def test_variants_seen_in_the_wild():
    p = ToolCallParser()
    p.feed_text(STREAMS[1] + STREAMS[3].replace("x", "", 1))
    p.finish()
    assert [c.to_dict() for c in p.tool_calls] == [
        {"id": "search:0", "name": "search", "arguments": '{"q": 1}'},
        {"id": "functions.a:0", "name": "a", "arguments": "{}"},
    ]
    assert p.reasoning == "plan: call ls" and p.content == "ok" and p.problems == []
    q = ToolCallParser()
    q.feed_text(STREAMS[2])
    assert q.tool_calls[0].name == "ls"


def test_problems_are_reported_not_raised():
    p = ToolCallParser()
    p.feed_text(STREAMS[4])
    events = p.finish()
    assert [pr.kind for pr in p.problems] == ["invalid_arguments", "incomplete"]
    assert p.problems[1] in events
    cut = p.problems[1]
    assert (cut.index, cut.id, cut.arguments) == (1, "functions.cut:1", '{"path":"/tm')
    assert json.dumps(p.result())  # serialisable
    q = ToolCallParser()
    q.feed_text(f"{CB}functions.a:0{AB}{{}}{CB}functions.b:1{AB}{{}}{CE}{AB}{CB}{CE}")
    q.finish()
    assert [pr.kind for pr in q.problems] == [
        "incomplete",
        "unexpected_marker",
        "bad_id",
    ]
    assert [c.name for c in q.tool_calls] == ["b"]


def test_feed_ids_needs_a_tokenizer():
    with pytest.raises(ValueError, match="feed_ids needs special_tokens"):
        ToolCallParser().feed_ids([1, 2])


def test_arguments_nested_deeper_than_the_stack_are_a_problem_not_an_exception():
    p = ToolCallParser()
    out = p.feed_text("<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>" + "[" * 100_000
                      + "<|tool_call_end|>")
    (problem,) = out
    assert isinstance(problem, ToolCallProblem) and problem.kind == "invalid_arguments"


@pytest.mark.parametrize(
    "arguments, got",
    [("[1, 2]", "array"), ('"x"', "string"), ("3", "number"), ("2.5", "number"),
     ("true", "boolean"), ("null", "null")],
)
def test_arguments_that_are_json_but_not_an_object_are_a_problem(arguments, got):
    p = ToolCallParser()
    (problem,) = p.feed_text(f"{CB}functions.ls:0{AB} {arguments} {CE}")
    assert isinstance(problem, ToolCallProblem) and p.tool_calls == []
    assert problem.kind == "invalid_arguments"
    assert problem.message == f"arguments of 'ls' must be a JSON object, got a JSON {got}: {arguments!r}"
    assert (problem.index, problem.id, problem.arguments) == (0, "functions.ls:0", f" {arguments} ")


def test_a_non_object_call_does_not_stop_the_calls_after_it():
    p = ToolCallParser()
    p.feed_text(f"{SB}{CB}functions.a:0{AB}[]{CE}{CB}functions.b:1{AB}{{}}{CE}{SE}")
    p.finish()
    assert [(pr.kind, pr.index) for pr in p.problems] == [("invalid_arguments", 0)]
    assert [(c.name, c.index, c.arguments) for c in p.tool_calls] == [("b", 1, "{}")]
