"""Grammars of a Kimi K2 assistant turn with tools, compiled with llguidance.

One grammar covers the whole turn, in K2's token format (docs/kimi.md, "Chat template")::

    start:   TEXT? section?          (tool_choice "auto"; TEXT is any text without special tokens)
    section: <|tool_calls_section_begin|> call+ <|tool_calls_section_end|>
    call:    <|tool_call_begin|> ("functions.NAME:" IDX <|tool_call_argument_begin|> %json{parameters})
             <|tool_call_end|>

``"none"`` allows content only; ``"required"`` and a named function allow calls only (one call
when ``parallel_tool_calls`` is False). The turn ends with an end-of-turn token
(``<|im_end|>`` or the model's EOS), which llguidance allows once the grammar is complete.
Arguments are compact JSON matching each tool's schema (llguidance's JSON-schema compiler).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvtier.toolcall.tools import ToolSpec

IM_END = "<|im_end|>"
CALL_INDEX = "/0|[1-9][0-9]{0,5}/"  # K2 numbers calls across the conversation: functions.NAME:IDX


class GrammarError(ValueError):
    """A grammar llguidance could not compile (the message carries llguidance's reason)."""


def turn_grammar(
    specs: Sequence[ToolSpec], choice: str, parallel_tool_calls: bool = True
) -> str:
    """The Lark (llguidance dialect) grammar of an assistant turn.

    Args:
        specs: the declared tools (from :func:`kvtier.toolcall.tools.normalize_tools`).
        choice: ``"auto"``, ``"none"``, ``"required"`` or a tool name
            (:func:`kvtier.toolcall.tools.normalize_tool_choice`).
        parallel_tool_calls: allow more than one call in the section.

    Returns:
        the grammar text for ``llguidance.grammar_from("lark", ...)``.
    """
    lines = ["%llguidance {}", "TEXT: /(?s:.+)/"]
    if choice == "none" or not specs:
        return "\n".join([*lines, "start: TEXT?"])
    names = [s for s in specs if choice in ("auto", "required") or s.name == choice]
    repeat = "+" if parallel_tool_calls else ""
    start = "start: TEXT? section?" if choice == "auto" else "start: section"
    lines += [
        start,
        f"section: <|tool_calls_section_begin|> call{repeat} <|tool_calls_section_end|>",
        "call: <|tool_call_begin|> ("
        + " | ".join(f"fn_{i}" for i in range(len(names)))
        + ") <|tool_call_end|>",
    ]
    for i, s in enumerate(names):
        lines.append(
            f"fn_{i}: {json.dumps(f'functions.{s.name}:')} {CALL_INDEX} <|tool_call_argument_begin|> args_{i}"
        )
        try:
            schema = json.dumps(s.grammar_schema(), ensure_ascii=False)
        except RecursionError:
            raise ValueError(
                f"tools[{specs.index(s)}].function.parameters: nested too deeply to process"
            ) from None
        lines.append(f"args_{i}: %json {schema}")
    return "\n".join(lines)


class GrammarCompiler:
    """Compiles turn grammars for one tokenizer and keeps the compiled ones (LRU).

    Args:
        tokenizer: the :class:`~kvtier.tokenize.KimiTokenizer` whose ids the model samples.
        end_of_turn_ids: ids that end a turn (``<|im_end|>`` plus the model's EOS ids).
        cache_size: compiled grammars kept; a hit costs one matcher copy instead of a compile.

    Building the llguidance tokenizer takes about a second (it indexes all 163,840 tokens).
    """

    def __init__(self, tokenizer, end_of_turn_ids: Sequence[int], cache_size: int = 64):
        import llguidance
        from llguidance.tiktoken import lltokenizer_from_encoding

        self._llg = llguidance
        self.tokenizer = tokenizer
        self.end_of_turn_ids = tuple(dict.fromkeys(end_of_turn_ids))
        self.ll_tokenizer = lltokenizer_from_encoding(
            tokenizer._enc,
            n_vocab=tokenizer.n_vocab,
            eos_token=list(self.end_of_turn_ids),
        )
        self.vocab_size = tokenizer.n_vocab
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, lark: str):
        """Compile ``lark`` into a new ``llguidance.LLMatcher`` (no cache; drops the GIL).

        Raises:
            GrammarError: llguidance rejected the grammar.
        """
        matcher = self._llg.LLMatcher(
            self.ll_tokenizer, self._llg.grammar_from("lark", lark), log_level=0
        )
        if matcher.is_error():
            raise GrammarError(
                f"the tool grammar does not compile: {matcher.get_error()}"
            )
        return matcher

    def matcher(self, lark: str):
        """A fresh ``llguidance.LLMatcher`` for grammar ``lark`` (compiled once, then copied).

        Raises:
            GrammarError: llguidance rejected the grammar (e.g. a pattern it cannot compile).
        """
        with self._lock:
            pristine = self._cache.get(lark)
            if pristine is not None:
                self._cache.move_to_end(lark)
                return pristine.deep_copy()
        pristine = self.compile(lark)
        with self._lock:
            self._cache[lark] = pristine
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return pristine.deep_copy()
