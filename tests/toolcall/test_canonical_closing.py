"""A turn the budget forces closed is written with the tokens the tokenizer gives its text: K2's
``"}`` is the one token BPE makes of it, and a K3 turn closed from its first token encodes back,
through K3's renderer, to exactly the ids it was sampled as."""

from __future__ import annotations

import pytest

from kvtier import SamplingParams
from kvtier.toolcall import GrammarCompiler, JsonNesting, TokenTable, ToolCallConstraint, closing_tokens
from kvtier.toolcall.xtml_grammar import xtml_turn_grammar
from kvtier.toolcall.xtml_parser import XtmlParser
from tests.helpers.tool_schemas import LS, SEARCH


def test_k2_closes_a_string_with_the_merged_token(tok, compiler, table):
    params = SamplingParams(tools=[LS], tool_choice="required")
    con = ToolCallConstraint(compiler.matcher(params.tool_grammar), table, 64)
    prefix = [tok.token_id("<|tool_calls_section_begin|>"), tok.token_id("<|tool_call_begin|>"),
              *tok.encode_segment("functions.ls:0"), tok.token_id("<|tool_call_argument_begin|>"),
              *tok.encode_segment('{"path":"src')]
    for t in prefix:
        con.consume(t)
    path = closing_tokens(con.matcher, table, con.nesting)
    merged = tok.encode_segment('"}')
    assert len(merged) == 1 and path[:1] == merged, [tok.decode([t]) for t in path]
    assert path[1:3] == [tok.token_id("<|tool_call_end|>"), tok.token_id("<|tool_calls_section_end|>")]


@pytest.fixture(scope="module")
def k3(tok_dir, tmp_path_factory):
    from kvtier.tokenize import ChatFormat, copy_tokenizer, load_tokenizer

    k3_tok = load_tokenizer(copy_tokenizer(tok_dir, tmp_path_factory.mktemp("k3tok"), chat_format=ChatFormat.K3_XTML))
    compiler = GrammarCompiler(k3_tok, [k3_tok.token_id("<|end_of_msg|>")])
    return k3_tok, compiler, TokenTable(k3_tok, compiler.end_of_turn_ids)


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("tools, choice", [([LS], "required"), ([SEARCH, LS], {"type": "function",
                                                                               "function": {"name": "search"}})])
def test_k3_closed_turn_encodes_back_to_its_ids(k3, thinking, tools, choice):
    from kvtier.tokenize.xtml import XtmlOptions, encode_part, generation_prompt, render_xtml_parts

    tok, compiler, table = k3
    params = SamplingParams(tools=tools, tool_choice=choice)
    lark = xtml_turn_grammar(params.tool_specs, params.tool_choice_name, True, None)
    con = ToolCallConstraint(compiler.matcher(lark), table, 512)
    opening = encode_part(tok, generation_prompt(thinking))
    con.prime(opening[-3:])
    path = closing_tokens(con.matcher, table, JsonNesting())
    p = XtmlParser.for_tokenizer(tok, opening)
    p.feed_ids(path)
    p.finish()
    assert p.tool_calls and not p.problems
    message = {"role": "assistant", "content": p.content, "reasoning_content": p.reasoning,
               "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                              for c in p.tool_calls]}
    parts = render_xtml_parts([{"role": "user", "content": "go"}, message], tools, XtmlOptions(thinking=thinking),
                              add_generation_prompt=False)
    rendered = encode_part(tok, parts.messages[-1])
    assert rendered == opening + path, (tok.decode(rendered), tok.decode(opening + path))


def test_k3_closes_a_json_argument_with_the_merged_token(k3):
    tok, compiler, table = k3
    params = SamplingParams(tools=[SEARCH], tool_choice="required")
    con = ToolCallConstraint(compiler.matcher(xtml_turn_grammar(params.tool_specs, "required", True, None)), table, 512)
    sep, open_, close = (tok.token_id(t) for t in ("<|sep|>", "<|open|>", "<|close|>"))
    con.prime([open_, *tok.encode_segment("response"), sep])
    for t in [close, *tok.encode_segment("response"), sep, open_, *tok.encode_segment("tools"), sep,
              open_, *tok.encode_segment('call tool="search" index="1"'), sep,
              open_, *tok.encode_segment('argument key="queries" type="array"'), sep, *tok.encode_segment('["ab')]:
        con.consume(t)
    path = closing_tokens(con.matcher, table, con.nesting)
    merged = tok.encode_segment('"]')
    assert len(merged) == 1 and path[:2] == [*merged, close], [tok.decode([t]) for t in path]
