"""Tool declarations and ``tool_choice`` of a request, checked and normalised for grammars.

Tools are OpenAI-style ``{"type": "function", "function": {"name", "description"?,
"parameters"?}}`` dicts; ``parameters`` must be in the schema subset Kimi's API accepts
(:func:`kvtier.toolcall.schema.validate_schema`). ``tool_choice`` is ``"auto"`` (text and/or
calls), ``"none"`` (text only), ``"required"`` (one or more calls, no text) or
``{"type": "function", "function": {"name": NAME}}`` (calls of that tool only, no text).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.tokenize.xtml_fields import TOOL_CHOICES
from kvtier.toolcall.schema import SchemaLimits, validate_schema

# OpenAI's rule for function names; it also keeps Kimi call ids ``functions.NAME:IDX`` unambiguous.
NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_ANNOTATIONS = (
    "$id",
    "$schema",
)  # dropped before compiling: they name documents, not constraints


@dataclass(frozen=True)
class ToolSpec:
    """One declared tool, ready for a grammar.

    Attributes:
        name: the function name.
        parameters: its arguments' JSON schema as declared (``{}`` when none was given).
    """

    name: str
    parameters: dict

    def grammar_schema(self) -> dict:
        """``parameters`` for llguidance: ``$id`` removed (a relative ``$id`` would change how
        ``$ref`` pointers resolve) and compact JSON enforced (``{"a":1}``: no whitespace, as K2
        writes arguments). A root that names no type (``{}``: no parameters declared) is given
        ``"type": "object"``: unconstrained, it would admit any JSON value, and arguments are a
        JSON object (the tool-call parser reports anything else as ``invalid_arguments``)."""
        schema = _strip(self.parameters)
        if not any(k in schema for k in ("type", "anyOf", "$ref")):
            schema["type"] = "object"
        schema["x-guidance"] = {
            "whitespace_flexible": False,
            "item_separator": ",",
            "key_separator": ":",
        }
        return schema


def _strip(schema):
    if isinstance(schema, dict):
        return {
            k: _strip(v)
            if k not in ("properties", "$defs")
            else {n: _strip(s) for n, s in v.items()}
            for k, v in schema.items()
            if k not in _ANNOTATIONS
        }
    if isinstance(schema, list):
        return [_strip(x) for x in schema]
    return schema


def _tool_spec(tool, index: int, limits: SchemaLimits) -> ToolSpec:
    where = f"tools[{index}]"
    if not isinstance(tool, dict):
        raise ValueError(  # noqa: TRY004 - bad request input is a ValueError throughout SamplingParams
            f"{where}: expected {{'type': 'function', 'function': {{...}}}}, got {type(tool).__name__}"
        )
    if tool.get("type", "function") != "function":
        raise ValueError(
            f"{where}.type: only 'function' tools are supported, got {tool.get('type')!r}"
        )
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise ValueError(  # noqa: TRY004
            f"{where}.function: expected an object with 'name' and 'parameters', got {fn!r:.80}"
        )
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ValueError(
            f"{where}.function.name: expected 1-64 characters of [A-Za-z0-9_-], got {name!r}"
        )
    params = fn.get("parameters", {})
    validate_schema(params, limits=limits, path=f"{where}.function.parameters")
    return ToolSpec(name, params)


def _checked_spec(tool, index: int, limits: SchemaLimits) -> ToolSpec:
    """:func:`_tool_spec`, with nesting too deep for Python's stack reported as a ValueError."""
    try:
        return _tool_spec(tool, index, limits)
    except RecursionError:
        raise ValueError(f"tools[{index}].function.parameters: nested too deeply to process") from None


def normalize_tools(
    tools: Sequence[dict], limits: SchemaLimits | None = None
) -> tuple[ToolSpec, ...]:
    """Check ``tools`` and return one :class:`ToolSpec` per tool, in order.

    Raises:
        ValueError: naming ``tools[i]...``: not a list of function tools, a bad or duplicate
            name, or parameters outside the accepted schema subset
            (:class:`~kvtier.toolcall.schema.ToolSchemaError`).
    """
    if not isinstance(tools, (list, tuple)):
        raise ValueError(  # noqa: TRY004
            f"tools: expected a list of tool objects, got {type(tools).__name__}"
        )
    specs = tuple(_checked_spec(t, i, limits or SchemaLimits()) for i, t in enumerate(tools))
    seen: set[str] = set()
    for i, s in enumerate(specs):
        if s.name in seen:
            raise ValueError(
                f"tools[{i}].function.name: duplicate tool name {s.name!r}"
            )
        seen.add(s.name)
    return specs


def normalize_tool_choice(tool_choice, specs: Sequence[ToolSpec]) -> str:
    """``"auto"``, ``"none"``, ``"required"`` or the name of the one tool a named choice selects.

    Raises:
        ValueError: naming ``tool_choice``: an unknown value, or a function that is not declared.
    """
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise ValueError(
                f"tool_choice: expected one of {list(TOOL_CHOICES)} or "
                f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}"
            )
        if tool_choice == "required" and not specs:
            raise ValueError("tool_choice: 'required' needs at least one tool in tools")
        return tool_choice
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or tool_choice.get("type", "function") != "function":
        raise ValueError(
            f"tool_choice: expected {{'type': 'function', 'function': {{'name': str}}}}, "
            f"got {tool_choice!r:.80}"
        )
    if name not in {s.name for s in specs}:
        raise ValueError(
            f"tool_choice: function {name!r} is not among the declared tools "
            f"{[s.name for s in specs]}"
        )
    return name


def tools_key(specs: Sequence[ToolSpec], choice: str, parallel_tool_calls: bool) -> str:
    """A canonical string identifying the grammar of (tools, choice, parallel): the cache key."""
    return json.dumps(
        [[s.name, s.parameters] for s in specs] + [choice, parallel_tool_calls],
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
