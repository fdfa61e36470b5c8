"""Turn grammars and constraints with the real Kimi vocabulary, driven without a model."""

import json

import numpy as np
import pytest
import torch
from kvtier import ops
from kvtier.toolcall import (
    GrammarError,
    ToolCallConstraint,
    ToolCallParser,
    fill_bitmasks,
    normalize_tool_choice,
    normalize_tools,
    turn_grammar,
)

from tests.helpers.tool_schemas import LS, SEARCH
from tests.toolcall.sweep import as_parameters, check_arguments
from tests.toolcall.conftest import UNGENERABLE_TOOL

TURN = (
    "Searching.<|tool_calls_section_begin|><|tool_call_begin|>functions.search:1<|tool_call_argument_begin|>"
    '{"queries":["a","b"]}<|tool_call_end|><|tool_call_begin|>functions.ls:2<|tool_call_argument_begin|>'
    '{"path":"src","depth":2}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
)


def _matcher(compiler, tools, choice="auto", parallel=True):
    specs = normalize_tools(tools)
    return compiler.matcher(
        turn_grammar(specs, normalize_tool_choice(choice, specs), parallel)
    )


def _allowed(row: np.ndarray, vocab: int) -> np.ndarray:
    return np.nonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab])[0]


def test_grammar_follows_tool_choice(compiler, tok):
    ids = tok.encode(TURN)
    m = _matcher(compiler, [SEARCH, LS])
    assert m.consume_tokens(ids)  # auto: text, then calls, then end of turn
    for choice, consumed in [
        ("none", "Searching."),
        ("required", ""),
        ({"type": "function", "function": {"name": "ls"}}, ""),
    ]:
        m = _matcher(compiler, [SEARCH, LS], choice)
        assert tok.decode(ids[: m.try_consume_tokens(ids)]) == consumed, choice
    m = _matcher(compiler, [SEARCH, LS], "required", parallel=False)
    one_call = TURN[len("Searching.") : TURN.index("<|tool_call_begin|>functions.ls")]
    assert m.consume_tokens(tok.encode(one_call))
    assert (
        m.try_consume_tokens(tok.encode("<|tool_call_begin|>")) == 0
    )  # a second call is refused


@pytest.mark.parametrize("function", [{"name": "now"}, {"name": "now", "parameters": {}},
                                      {"name": "now", "parameters": {"properties": {"tz": {"type": "string"}}}}])
def test_arguments_of_a_tool_whose_parameters_name_no_type_are_an_object(compiler, tok, function):
    def allowed(arguments):
        turn = (f"<|tool_calls_section_begin|><|tool_call_begin|>functions.now:0<|tool_call_argument_begin|>"
                f"{arguments}<|tool_call_end|><|tool_calls_section_end|><|im_end|>")
        return _matcher(compiler, [{"type": "function", "function": function}], "required").consume_tokens(
            tok.encode(turn))

    assert allowed("{}")
    for arguments in ("[]", "null", '"x"', "3"):  # the parser would report these as invalid_arguments
        assert not allowed(arguments), arguments


def test_bitmask_rows_use_the_layout_ops_sample_takes(compiler, table, tok):
    cons = [
        ToolCallConstraint(_matcher(compiler, [SEARCH]), table, 512),
        ToolCallConstraint(_matcher(compiler, [SEARCH], "required"), table, 512),
    ]
    cons[1].consume(tok.token_id("<|tool_calls_section_begin|>"))
    bitmask = np.zeros((2, (tok.n_vocab + 31) // 32), dtype=np.int32)
    assert fill_bitmasks(cons, bitmask) == [None, None]
    reference = np.frombuffer(cons[0].matcher.compute_bitmask(), dtype=np.int32)
    assert (
        _allowed(bitmask[0], tok.n_vocab).tolist()
        == _allowed(reference, tok.n_vocab).tolist()
    )
    assert _allowed(bitmask[1], tok.n_vocab).tolist() == [
        tok.token_id("<|tool_call_begin|>")
    ]
    logits = torch.randn(2, tok.n_vocab)
    for temperature in (0.0, 1.0):
        out = ops.sample(
            logits,
            torch.full((2,), temperature),
            torch.ones(2),
            token_bitmask=torch.from_numpy(bitmask),
            backend="torch",
        )
        for row, t in enumerate(out.tolist()):
            assert t in set(_allowed(bitmask[row], tok.n_vocab).tolist())


def test_a_failed_row_does_not_affect_the_others(compiler, table, tok):
    good = ToolCallConstraint(_matcher(compiler, [SEARCH], "required"), table, 64)
    bad = ToolCallConstraint(_matcher(compiler, [SEARCH], "required"), table, 64)
    with pytest.raises(GrammarError, match="not allowed by the tool grammar"):
        bad.consume(tok.encode("hello")[0])
    bitmask = np.zeros((2, (tok.n_vocab + 31) // 32), dtype=np.int32)
    errors = fill_bitmasks([bad, good], bitmask)
    assert errors[0].startswith("GrammarError") and errors[1] is None
    assert _allowed(bitmask[1], tok.n_vocab).tolist() == [
        tok.token_id("<|tool_calls_section_begin|>")
    ]


def test_a_schema_llguidance_cannot_compile_raises_grammar_error(compiler):
    with pytest.raises(GrammarError, match="does not compile"):
        _matcher(compiler, [UNGENERABLE_TOOL], "required")


def _walk(constraint, tok, rng, max_tokens):
    """Random allowed tokens (a model whose output is noise) until the turn ends or max_tokens."""
    bitmask = np.zeros((1, (tok.n_vocab + 31) // 32), dtype=np.int32)
    out = []
    while len(out) < max_tokens and not constraint.finished:
        assert fill_bitmasks([constraint], bitmask) == [None]
        out.append(constraint.take(int(rng.choice(_allowed(bitmask[0], tok.n_vocab)))))
    return out


def test_random_tokens_under_the_mask_end_in_schema_valid_calls(
    compiler, table, tok, walle_dir
):
    """Every 7th valid walle schema, as a required tool: noise closes into complete, valid calls."""
    lines = [
        line
        for p in sorted(walle_dir.glob("*/valid.jsonl"))
        for line in p.read_text().splitlines()
    ]
    rng = np.random.default_rng(0)
    checked = 0
    for line in lines[::7]:
        schema = as_parameters(json.loads(line))
        tool = {"type": "function", "function": {"name": "tool", "parameters": schema}}
        con = ToolCallConstraint(_matcher(compiler, [tool], "required"), table, 128)
        out = _walk(con, tok, rng, 128)
        parser = ToolCallParser.for_tokenizer(tok)
        parser.feed_ids(out)
        parser.finish()
        assert con.finished and parser.tool_calls and not parser.problems, (
            line,
            tok.decode(out),
        )
        for call in parser.tool_calls:
            assert check_arguments(call.arguments, schema) is None, (
                line,
                call.arguments,
            )
            checked += 1
    assert checked >= 30
