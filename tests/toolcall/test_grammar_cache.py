"""A compiled tool grammar whose matcher failed while decoding is dropped from the compile cache:
copies share the lazily built lexer of the one they came from, so the next request would fail
at once ("too many expressions constructed") instead of compiling afresh."""

import kvtier.toolcall as toolcall
from kvtier import LLM, SamplingParams

TOOLS = [{"type": "function", "function": {"name": "ls", "parameters": {
    "type": "object", "properties": {"path": {"type": "string", "maxLength": 8}}, "required": ["path"]}}}]


def test_a_grammar_that_failed_while_decoding_is_compiled_afresh(tok_dir, monkeypatch):
    llm = LLM("tiny", tokenizer=str(tok_dir), page_size=16, num_device_pages=64)
    params = SamplingParams(max_tokens=48, temperature=0, tools=TOOLS, tool_choice="required")
    ok = llm.chat([{"role": "user", "content": "list"}], sampling_params=params)
    assert ok.error is None
    compiler = llm.engine.grammar.compiler()
    compiles = compiler.stats.compiles
    assert params.tool_grammar in compiler._cache  # kept: the next request copies it

    real = toolcall.fill_bitmasks
    monkeypatch.setattr(toolcall, "fill_bitmasks",
                        lambda cons, bitmask, executor=None: ["GrammarError: lexer error: too many expressions"] * len(cons))
    failed = llm.chat([{"role": "user", "content": "list"}], sampling_params=params)
    assert failed.finish_reason == "error" and "too many expressions" in failed.error
    assert params.tool_grammar not in compiler._cache

    monkeypatch.setattr(toolcall, "fill_bitmasks", real)
    again = llm.chat([{"role": "user", "content": "list"}], sampling_params=params)
    assert again.error is None and again.tool_calls
    assert compiler.stats.compiles == compiles + 1  # compiled afresh, not copied from the failed one
    assert compiler.forget(params.tool_grammar) and not compiler.forget(params.tool_grammar)
