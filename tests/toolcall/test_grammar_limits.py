"""Grammar limits: compiles under llguidance's limits with the keyword at fault named, closing
searches bounded by fuel and a per-token deadline, and the engine ending each pathological
request within its own max_tokens while a small request beside it finishes in a few steps."""

import re

import llguidance
import numpy as np
import pytest

from kvtier import SamplingParams
from kvtier.toolcall import (
    GrammarCompiler,
    GrammarError,
    GrammarLimitError,
    GrammarLimits,
    GrammarStats,
    TokenTable,
    ToolCallConstraint,
    fill_bitmasks,
    normalize_tool_choice,
    normalize_tools,
    turn_grammar,
)
from tests.toolcall.conftest import UNGENERABLE_TOOL
from tests.toolcall.pathological import PATHOLOGICAL, REFUSED
from tests.helpers.tool_schemas import LS

BASE = "tools[0].function.parameters"
PREFILL_STEPS = 2  # steps before a request's first token at most (its prompt fits one step's budget)


def _specs(tools, choice="required"):
    specs = normalize_tools(tools)
    return specs, turn_grammar(specs, normalize_tool_choice(choice, specs))


def _compiler(tok, **limits):
    return GrammarCompiler(tok, [tok.token_id("<|im_end|>")], limits=GrammarLimits(**limits))


def test_limits_are_checked_and_passed_to_llguidance():
    with pytest.raises(ValueError, match="closing_fuel must be an int > 0"):
        GrammarLimits(closing_fuel=0)
    with pytest.raises(ValueError, match="mask_deadline_s must be a number > 0"):
        GrammarLimits(mask_deadline_s=float("nan"))
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['fuel'\]"):
        GrammarLimits.from_dict({"fuel": 1})
    assert GrammarLimits.from_dict({"max_items_in_row": 7}).parser_limits().max_items_in_row == 7
    ours, theirs = GrammarLimits().parser_limits(), llguidance.LLParserLimits()
    for name in ("max_items_in_row", "initial_lexer_fuel", "step_lexer_fuel", "step_max_items",
                 "max_lexer_states", "max_grammar_size"):
        assert getattr(ours, name) == getattr(theirs, name)  # unset: llguidance's own default


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_schema_names_the_tool_and_keyword(compiler, name):
    tool, where = REFUSED[name]
    specs, lark = _specs([LS, tool])
    with pytest.raises(GrammarError, match="does not compile") as e:
        compiler.compile(lark, specs)
    assert e.value.path == f"tools[1].function.parameters{where}"
    assert str(e.value).startswith(e.value.path + ": ")


def test_the_ungenerable_tool_names_min_length(compiler):
    specs, lark = _specs([UNGENERABLE_TOOL])
    with pytest.raises(GrammarError) as e:
        compiler.matcher(lark, specs)
    assert e.value.path == f"{BASE}.properties.s.minLength"


def test_grammar_size_limit_names_the_exploding_any_of(tok):
    specs, lark = _specs([PATHOLOGICAL["any_of_explosion"]])
    small = _compiler(tok, max_grammar_size=1000)
    with pytest.raises(GrammarError, match="grammar size") as e:
        small.compile(lark, specs)
    assert e.value.path == f"{BASE}.properties.x.anyOf"
    stats = small.stats.snapshot()
    assert stats["compile_errors"] == 1 and stats["compiles"] > 1  # the trial compiles of the search count
    _compiler(tok).compile(lark, specs)  # under llguidance's default size limit it compiles


def test_a_ref_chain_is_followed_to_the_definition_at_fault(compiler):
    bad = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"type": "object", "properties": {
        "n": {"type": "number", "minimum": -1e300, "maximum": 1e300}}}},
        "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}
    specs, lark = _specs([{"type": "function", "function": {"name": "g", "parameters": bad}}])
    with pytest.raises(GrammarError) as e:
        compiler.compile(lark, specs)
    assert e.value.path == f"{BASE}.$defs.b.properties.n"


def test_a_compile_past_its_timeout_is_a_limit_error(tok):
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2900)}}
    specs, lark = _specs([{"type": "function", "function": {"name": "wide", "parameters": wide}}])
    with pytest.raises(GrammarLimitError, match="compile_timeout_s=0.001 s"):  # it takes about a second
        _compiler(tok, compile_timeout_s=0.001).compile(lark, specs)


def _walk(constraint, tok, max_tokens, seed=0):
    """Random allowed tokens until the turn ends or max_tokens; returns the tokens taken."""
    rng = np.random.default_rng(seed)
    bitmask = np.zeros((1, (tok.n_vocab + 31) // 32), dtype=np.int32)
    out = []
    while len(out) < max_tokens and not constraint.finished:
        assert fill_bitmasks([constraint], bitmask) == [None]
        allowed = np.nonzero(np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[:tok.n_vocab])[0]
        out.append(constraint.take(int(rng.choice(allowed))))
    return out


def test_a_search_out_of_fuel_finds_nothing_and_the_turn_goes_on(tok, compiler, table):
    specs, lark = _specs([PATHOLOGICAL["min_items"]])
    stats = GrammarStats()
    c = ToolCallConstraint(compiler.matcher(lark, specs), table, 24, GrammarLimits(closing_fuel=50), stats)
    out = _walk(c, tok, 24)
    assert len(out) == 24 and not c.finished and not c.matcher.is_error()
    assert stats.snapshot()["out_of_fuel"] >= 1


def test_missing_the_mask_deadline_fails_that_row_only(tok, compiler, table):
    specs, lark = _specs([PATHOLOGICAL["min_items"]])
    late = ToolCallConstraint(compiler.matcher(lark, specs), table, 16, GrammarLimits(mask_deadline_s=1e-9))
    specs, lark = _specs([LS])
    fine = ToolCallConstraint(compiler.matcher(lark, specs), table, 16)
    bitmask = np.zeros((2, (tok.n_vocab + 31) // 32), dtype=np.int32)
    errors = fill_bitmasks([late, fine], bitmask)
    assert errors[0].startswith("GrammarLimitError") and "mask_deadline_s" in errors[0]
    assert errors[1] is None and bitmask[1].any()


@pytest.fixture(scope="module")
def llm(tok_dir):
    from kvtier import LLM

    return LLM("tiny", tokenizer=tok_dir, num_device_pages=1024)


def _run_beside_small(llm, params):
    """Queue a request with ``params`` and a plain max_tokens=2 one, step the engine until both
    end; returns {name: (output, engine steps from the start to its finish)}."""
    eng, prompt = llm.engine, llm.tokenizer.encode("hello")
    eng.attach_tokenizer(llm.tokenizer)
    start = eng.num_steps
    ids = {eng.add_request(prompt, params): "big",
           eng.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True)): "small"}
    done, bound = {}, params.max_tokens + PREFILL_STEPS + 2
    while eng.has_unfinished():
        for o in eng.step():
            done[ids[o.request_id]] = (o, eng.num_steps - start)
        assert eng.num_steps - start <= bound, "the engine did not end the request within its max_tokens"
    return done


@pytest.mark.parametrize("name", sorted(PATHOLOGICAL))
def test_a_pathological_schema_ends_within_max_tokens_while_a_small_request_finishes(llm, name):
    max_tokens = 16
    done = _run_beside_small(llm, SamplingParams(max_tokens=max_tokens, tools=[PATHOLOGICAL[name]],
                                                 tool_choice="required"))
    small, small_steps = done["small"]
    assert small.finish_reason == "length" and len(small.token_ids) == 2
    assert small_steps <= PREFILL_STEPS + 1 and small.metrics.engine_steps == small_steps
    big, big_steps = done["big"]
    assert len(big.token_ids) <= max_tokens and big_steps <= max_tokens + PREFILL_STEPS
    if big.finish_reason == "error":  # only a limit may end it early
        assert "mask_deadline_s" in big.error, big.error
    else:
        assert big.finish_reason == "length" and len(big.token_ids) == max_tokens
        assert big.tool_calls == [] and [p["kind"] for p in big.tool_call_problems] == ["incomplete"]


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_schema_fails_before_any_step(llm, name):
    tool, where = REFUSED[name]
    done = _run_beside_small(llm, SamplingParams(max_tokens=16, tools=[tool], tool_choice="required"))
    big, _ = done["big"]
    assert big.finish_reason == "error" and big.token_ids == [] and big.metrics.engine_steps == 0
    # GrammarLimitError: a pattern over max_pattern_size, refused before compiling
    assert re.match(rf"Grammar(Limit)?Error: {re.escape(BASE + where)}: the tool grammar does not compile",
                    big.error), big.error
    assert done["small"][0].finish_reason == "length"


def test_a_missed_deadline_ends_only_that_request(tok_dir):
    from kvtier import LLM

    llm = LLM("tiny", tokenizer=tok_dir, num_device_pages=256)
    llm.engine.grammar.limits = GrammarLimits(mask_deadline_s=1e-9)
    done = _run_beside_small(llm, SamplingParams(max_tokens=16, tools=[PATHOLOGICAL["min_items"]],
                                                 tool_choice="required"))
    big, steps = done["big"]
    assert big.finish_reason == "error" and "mask_deadline_s=1e-09 s" in big.error and steps <= PREFILL_STEPS
    assert done["small"][0].finish_reason == "length" and len(done["small"][0].token_ids) == 2
    stats = llm.engine.grammar.stats.snapshot()
    assert stats["cut"]["deadline"] == 1 and stats["masks"] >= 1
