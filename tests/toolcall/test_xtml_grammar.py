"""Constrained K3 turns (XTML) under llguidance: every tool of the schema corpus (K2-Vendor-Verifier
requests, walle's valid schemas) gives calls that parse and validate, whether the turn is the
grammar's shortest completion, random tokens under the mask, or ``tiny-k3`` (random weights)
sampling; ``tool_choice`` none / named / required and ``parallel_tool_calls`` hold;
``response_format`` puts a JSON instance of its schema on the response channel."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from kvtier import SamplingParams
from kvtier.toolcall import GrammarCompiler, JsonNesting, TokenTable, ToolCallConstraint, closing_tokens, fill_bitmasks
from kvtier.toolcall.xtml_grammar import xtml_turn_grammar
from kvtier.toolcall.xtml_parser import XtmlParser
from tests.helpers.tool_schemas import LS, SEARCH
from tests.toolcall.sweep import check_arguments, k2vv_cases, rendered, run, walle_cases

UNGENERABLE = {"TestRangeConstraints:2"}  # a string of >= 999,999,999,999 characters (as the K2 sweep)
SLACK = 24


@pytest.fixture(scope="module")
def k3_dir(tok_dir, tmp_path_factory):
    from kvtier.tokenize import ChatFormat, copy_tokenizer

    return copy_tokenizer(tok_dir, tmp_path_factory.mktemp("k3tok"), chat_format=ChatFormat.K3_XTML)


@pytest.fixture(scope="module")
def k3_tok(k3_dir):
    from kvtier.tokenize import load_tokenizer

    return load_tokenizer(k3_dir)


@pytest.fixture(scope="module")
def k3_compiler(k3_tok):
    return GrammarCompiler(k3_tok, [k3_tok.token_id("<|end_of_msg|>"), k3_tok.token_id("[EOS]")])


@pytest.fixture(scope="module")
def k3_table(k3_tok, k3_compiler):
    return TokenTable(k3_tok, k3_compiler.end_of_turn_ids)


@pytest.fixture(scope="module")
def corpus(k2vv_dir, walle_dir, k3_tok):
    """The corpus cases K3's renderer accepts (it refuses parameters that are not a JSON object
    schema at the root, a 400 before any grammar), and the names of those it refuses."""
    cases = [c for c in k2vv_cases() + walle_cases() if c.name not in UNGENERABLE]
    kept = rendered(k3_tok, cases)
    return kept, sorted({c.name for c in cases} - {c.name for c in kept})


def _think_tag(tok) -> list[int]:
    return [tok.token_id("<|open|>"), *tok.encode("think", allow_special=False), tok.token_id("<|sep|>")]


def _constraint(params, compiler, table, tok, max_tokens=4096, prime=True):
    lark = xtml_turn_grammar(params.tool_specs, params.tool_choice_name, params.parallel_tool_calls,
                             params.response_schema)
    con = ToolCallConstraint(compiler.matcher(lark, params.tool_specs), table, max_tokens)
    if prime:
        con.prime(_think_tag(tok))
    return con


def _parse(ids, tok) -> XtmlParser:
    p = XtmlParser.for_tokenizer(tok, channel="think")
    p.feed_ids(ids)
    p.finish()
    return p


def _random_turn(con, rng, tok) -> list[int]:
    """Tokens drawn uniformly from what the mask allows until the turn ends (the sampler is noise)."""
    out = []
    words = (tok.n_vocab + 31) // 32
    while not con.finished and con.num_tokens < con.max_tokens:
        bitmask = np.zeros((1, words), dtype=np.int32)
        assert fill_bitmasks([con], bitmask) == [None]
        allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:tok.n_vocab])
        out.append(con.take(int(allowed[rng.randrange(len(allowed))])))
    return out


def _check_calls(p: XtmlParser, case) -> None:
    assert p.tool_calls and not p.problems, (case.name, p.problems)
    for call in p.tool_calls:
        assert check_arguments(call.arguments, case.schemas[call.name]) is None, (case.name, call.arguments)


def test_renderer_refusals_are_the_non_object_roots(corpus):
    kept, refused = corpus
    assert len(kept) >= 290 and len(refused) <= 10, refused


def test_shortest_turn_of_every_corpus_tool_parses_and_validates(corpus, k3_compiler, k3_table, k3_tok):
    for case in corpus[0]:
        params = SamplingParams(tools=case.tools, tool_choice="required")
        con = _constraint(params, k3_compiler, k3_table, k3_tok)
        path = closing_tokens(con.matcher, k3_table, JsonNesting())
        assert path is not None and path[-1] in k3_table.end_of_turn, case.name
        _check_calls(_parse(path, k3_tok), case)


def test_random_tokens_under_the_mask_give_valid_calls(corpus, k3_compiler, k3_table, k3_tok):
    """Every 12th corpus tool, random allowed tokens with a budget of the shortest turn + 24."""
    rng = random.Random(7)
    for case in corpus[0][::12]:
        params = SamplingParams(tools=case.tools, tool_choice="required")
        probe = _constraint(params, k3_compiler, k3_table, k3_tok)
        shortest = len(closing_tokens(probe.matcher, k3_table, JsonNesting()))
        con = _constraint(params, k3_compiler, k3_table, k3_tok, max_tokens=shortest + SLACK)
        ids = _random_turn(con, rng, k3_tok)
        assert con.finished and len(ids) <= shortest + SLACK, case.name
        _check_calls(_parse(ids, k3_tok), case)


@pytest.mark.parametrize("choice, parallel, names", [
    ("required", True, {"search", "ls"}),
    ({"type": "function", "function": {"name": "ls"}}, True, {"ls"}),
    ("required", False, {"search", "ls"}),
    ("none", True, {None}),
    ("auto", True, {"search", "ls", None}),
])
def test_tool_choice_and_parallel_calls(choice, parallel, names, k3_compiler, k3_table, k3_tok):
    rng, seen = random.Random(3), set()
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (SEARCH, LS)}
    for _ in range(6):
        params = SamplingParams(tools=[SEARCH, LS], tool_choice=choice, parallel_tool_calls=parallel)
        ids = _random_turn(_constraint(params, k3_compiler, k3_table, k3_tok, max_tokens=160), rng, k3_tok)
        p = _parse(ids, k3_tok)
        assert not p.problems
        if choice in ("required", "none") or isinstance(choice, dict):
            assert bool(p.tool_calls) == (choice != "none")
        if not parallel:
            assert len(p.tool_calls) <= 1
        seen |= {c.name for c in p.tool_calls} or {None}
        for c in p.tool_calls:
            assert check_arguments(c.arguments, schemas[c.name]) is None
        assert [ids.count(k3_tok.token_id(t)) for t in ("<|open|>", "<|close|>")] == [ids.count(k3_tok.token_id(
            "<|close|>")) - 2, ids.count(k3_tok.token_id("<|close|>"))]  # every tag closed (+ think, message)
    assert seen <= names and (choice in ("none", "auto") or seen - {None})


def test_call_indexes_count_from_one(k3_compiler, k3_table, k3_tok):
    params = SamplingParams(tools=[LS], tool_choice="required")
    con = _constraint(params, k3_compiler, k3_table, k3_tok)
    text = k3_tok.decode(closing_tokens(con.matcher, k3_table, JsonNesting()))
    assert '<|open|>call tool="ls" index="1"<|sep|>' in text
    assert text.endswith("<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>")


def test_response_format_schema_on_the_response_channel(walle_dir, k3_compiler, k3_table, k3_tok):
    rng = random.Random(5)
    schemas = [c.tools[0]["function"]["parameters"] for c in walle_cases()
               if c.name.startswith(("TestAnyOf", "TestDefs", "TestRangeConstraints:0", "TestRequired"))][:10]
    assert schemas
    for schema in schemas:
        rf = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
        params = SamplingParams(response_format=rf)
        probe = _constraint(params, k3_compiler, k3_table, k3_tok)
        shortest = len(closing_tokens(probe.matcher, k3_table, JsonNesting()))
        ids = _random_turn(_constraint(params, k3_compiler, k3_table, k3_tok, max_tokens=shortest + SLACK), rng,
                           k3_tok)
        p = _parse(ids, k3_tok)
        assert not p.tool_calls and check_arguments(p.content, schema) is None, (schema, p.content)
    json_object = SamplingParams(response_format={"type": "json_object"}, tools=[LS])
    ids = _random_turn(_constraint(json_object, k3_compiler, k3_table, k3_tok, max_tokens=200), rng, k3_tok)
    p = _parse(ids, k3_tok)
    assert p.tool_calls or isinstance(json.loads(p.content), dict)


@pytest.fixture(scope="module")
def tiny_k3(k3_dir):
    from kvtier import LLM

    return LLM("tiny-k3", tokenizer=k3_dir, num_device_pages=2048)


def test_tiny_k3_forced_calls_parse_and_validate(tiny_k3, corpus):
    """A spread of 8 corpus tools through the engine (all in one batch), sampled at temperature 1
    (the whole corpus: the slow test below)."""
    tally = run(tiny_k3, corpus[0][::37][:8], temperature=1.0, seed=0)
    assert tally.outcomes["error"] == 0 and tally.complete == tally.requests, tally.failures
    assert tally.valid_calls == tally.calls >= tally.requests, tally.failures


def test_tiny_k3_response_format_validates(tiny_k3):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12},
                                               "n": {"type": "integer", "minimum": 3}}, "required": ["answer", "n"]}
    rf = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
    for thinking in ({"type": "enabled"}, {"type": "disabled"}):
        out = tiny_k3.chat([{"role": "user", "content": "answer in JSON"}], response_format=rf, thinking=thinking,
                           sampling_params=SamplingParams(max_tokens=96, temperature=1.0, seed=2, response_format=rf))
        assert out.finish_reason == "stop" and check_arguments(out.content, schema) is None, out


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_corpus_call_on_tiny_k3(k3_dir, corpus, seed, temperature):
    from kvtier import LLM

    llm = LLM("tiny-k3", tokenizer=k3_dir, seed=seed, num_device_pages=8192)
    tally = run(llm, corpus[0], temperature, seed)
    assert tally.outcomes["error"] == 0 and tally.complete == tally.requests, tally.failures
    assert tally.valid_calls == tally.calls >= tally.requests, tally.failures


def test_grammar_limits_and_errors_apply(k3_tok, k3_compiler):
    from kvtier.toolcall import GrammarError, GrammarLimitError, GrammarLimits

    from tests.toolcall.conftest import UNGENERABLE_TOOL

    params = SamplingParams(tools=[UNGENERABLE_TOOL], tool_choice="required")
    lark = xtml_turn_grammar(params.tool_specs, "required")
    with pytest.raises(GrammarError, match=r"^tools\[0\]\.function\.parameters\.properties\.s\.minLength: "):
        k3_compiler.compile(lark, params.tool_specs)
    tight = GrammarCompiler(k3_tok, k3_compiler.end_of_turn_ids, limits=GrammarLimits(max_pattern_size=10))
    patterned = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-z]{40}$"}}, "required": ["id"]}}}
    params = SamplingParams(tools=[patterned], tool_choice="required")
    with pytest.raises(GrammarLimitError, match=r"tools\[0\]\.function\.parameters\.properties\.id\.pattern"):
        tight.compile(xtml_turn_grammar(params.tool_specs, "required"), params.tool_specs)
