"""Kimi tool calls: the accepted schema subset, streaming output parsers, and schema-constrained
decoding of whole assistant turns, in K2's format and in K3's XTML.

- :func:`validate_schema` / :class:`SchemaLimits`: the JSON-schema subset Kimi's API accepts.
- :func:`normalize_tools`, :func:`normalize_tool_choice`: request tools checked for grammars.
- :class:`ToolCallParser`: content, reasoning and each call as soon as it ends.
- :func:`turn_grammar`, :class:`GrammarCompiler`: llguidance grammars of a turn with tools,
  compiled under :class:`GrammarLimits` (a schema over a limit is traced to its keyword;
  :func:`pattern_size` bounds each ``pattern`` before compiling).
- :class:`ToolCallConstraint`, :func:`fill_bitmasks`: per-request masks, closing before max_tokens.
- :func:`closing_tokens` (:mod:`kvtier.toolcall.closing`): the short completion a turn is closed with.
- K3: :class:`kvtier.toolcall.xtml_parser.XtmlParser` (think / response / tools channels, typed
  arguments) and :func:`kvtier.toolcall.xtml_grammar.xtml_turn_grammar`; the same events,
  constraint and compiler serve both formats.
"""

from kvtier.toolcall.closing import JsonNesting, TokenTable, closing_tokens
from kvtier.toolcall.constrain import ToolCallConstraint, fill_bitmasks
from kvtier.toolcall.grammar import (
    GrammarCompiler,
    GrammarError,
    GrammarLimitError,
    GrammarLimits,
    GrammarStats,
    turn_grammar,
)
from kvtier.toolcall.parser import (
    ContentDelta,
    ReasoningDelta,
    ToolCall,
    ToolCallParser,
    ToolCallProblem,
    parse_call,
)
from kvtier.toolcall.pattern_size import pattern_size
from kvtier.toolcall.schema import (
    SchemaLimits,
    ToolSchemaError,
    parse_schema,
    validate_schema,
)
from kvtier.toolcall.tools import ToolSpec, normalize_tool_choice, normalize_tools

__all__ = [
    "ContentDelta",
    "GrammarCompiler",
    "GrammarError",
    "GrammarLimitError",
    "GrammarLimits",
    "GrammarStats",
    "JsonNesting",
    "ReasoningDelta",
    "SchemaLimits",
    "TokenTable",
    "ToolCall",
    "ToolCallConstraint",
    "ToolCallParser",
    "ToolCallProblem",
    "ToolSchemaError",
    "ToolSpec",
    "closing_tokens",
    "fill_bitmasks",
    "normalize_tool_choice",
    "normalize_tools",
    "parse_call",
    "parse_schema",
    "pattern_size",
    "turn_grammar",
    "validate_schema",
]
