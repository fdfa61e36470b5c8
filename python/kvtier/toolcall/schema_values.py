"""The value checks of :mod:`kvtier.toolcall.schema`'s walk: counts (``minLength``...), numeric
bounds and their ranges, ``enum`` values against the schema's types and size limits, and
``pattern`` against llguidance's regex syntax. Each reports through the walk's
``fail(message, path)``."""

from __future__ import annotations

import math
from typing import Any, NoReturn, Protocol

from kvtier.toolcall.schema_refs import types_of


class _Walk(Protocol):
    """What the checks use of the schema walk (:class:`kvtier.toolcall.schema` ``_Walk``)."""

    limits: Any  # kvtier.toolcall.schema.SchemaLimits

    def fail(self, message: str, path: str) -> NoReturn: ...


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_count(w: _Walk, s: dict, path: str, name: str) -> None:
    v = s[name]
    if _is_number(v):
        if v < 0:
            w.fail(f"{name} must be non-negative, got {v}", path)
        if v != math.floor(v):
            w.fail(f"{name} {v} is not a valid integer", path)
    else:
        w.fail(f"{name} must be an integer, got {v!r}", path)


def _check_bound(w: _Walk, s: dict, path: str, name: str, integer: bool) -> None:
    v = s[name]
    kind = "an integer" if integer else "a number"
    if not _is_number(v):
        w.fail(f"{name} must be {kind}, got {v!r}", path)
    if integer and v != math.floor(v):
        w.fail(f"{name} {v} is not a valid integer", path)
    if not integer and not math.isfinite(v):
        w.fail(f"{name} is not a valid number: {v}", path)


def _check_ranges(w: _Walk, s: dict, path: str, allowed: set, integer: bool) -> None:
    for lo, hi, check in (
        ("minLength", "maxLength", _check_count),
        ("minItems", "maxItems", _check_count),
        ("minimum", "maximum", None),
    ):
        if lo not in allowed or not (lo in s or hi in s):
            continue
        for name in (lo, hi):
            if name in s and s[name] is not None:
                check(w, s, path, name) if check else _check_bound(
                    w, s, path, name, integer
                )
        if s.get(lo) is not None and s.get(hi) is not None and s[lo] > s[hi]:
            w.fail(f"{lo} ({s[lo]}) cannot be greater than {hi} ({s[hi]})", path)


def _check_enum(w: _Walk, s: dict, path: str) -> None:
    enum = s["enum"]
    if not isinstance(enum, list):
        w.fail(f"enum must be an array, got {type(enum).__name__}", path)
    if not enum:
        w.fail("enum array cannot be empty", path)
    if len(enum) > w.limits.max_enum_items:
        w.fail(
            f"enum array cannot have more than {w.limits.max_enum_items} items", path
        )
    if "type" not in s:
        w.fail("type is not defined (enum needs a type)", path)
    types = types_of(s)
    if types is None:
        w.fail("type array must be an array of strings", path)
    if len(types) > 2 or (len(types) == 2 and "null" not in types):
        w.fail(
            "when type is array and enum is specified, only 2 types are supported: null and one of "
            "string/integer/number/boolean",
            path,
        )
    for value in enum:
        if not any(_enum_value_matches(w, value, t, path) for t in types):
            w.fail(f"enum value ({value!r}) does not match any type in {types}", path)
    if (
        any(t in types for t in ("string", "number", "integer"))
        and len(enum) > w.limits.enum_string_check_threshold
    ):
        total = sum(
            len(v) if isinstance(v, str) else len(str(v)) if _is_number(v) else 0
            for v in enum
        )
        if total > w.limits.max_enum_string_length:
            w.fail(
                f"total string length of enum values ({total}) exceeds maximum limit of "
                f"{w.limits.max_enum_string_length} characters",
                path,
            )


def _enum_value_matches(w: _Walk, value, t: str, path: str) -> bool:
    if t in ("number", "integer"):
        if not _is_number(value):
            w.fail(f"enum value {value!r} is not a valid {t}", path)
        if not math.isfinite(value):
            w.fail(f"enum value {value!r} is not a valid number: NaN or Infinity", path)
        if t == "integer" and value != math.floor(value):
            w.fail(f"enum value {value!r} is not a valid integer", path)
        return True
    return {
        "string": lambda: isinstance(value, str),
        "boolean": lambda: isinstance(value, bool),
        "null": lambda: value is None,
        "array": lambda: isinstance(value, list),
        "object": lambda: isinstance(value, dict),
    }[t]()


def _pattern_error(pattern: str) -> str | None:
    """llguidance's reason for rejecting ``pattern`` (the last line of its message, e.g.
    ``unclosed group``), or None when it accepts it.

    The check is llguidance's JSON-schema compiler (the one that compiles tool arguments) on a
    schema holding ``pattern`` in an optional property, so that a valid pattern no string matches
    (``[^\\s\\S]``) is not rejected here: llguidance drops an unsatisfiable optional property,
    and a required one fails when the turn grammar is compiled, like an unreachable
    ``minLength``.
    """
    from llguidance import LLMatcher

    probe = {"type": "object", "properties": {"p": {"type": "string", "pattern": pattern}}}
    try:
        grammar = LLMatcher.grammar_from_json_schema(probe)
    except ValueError as e:  # e.g. a lone surrogate ("\ud800"), which no UTF-8 text can hold
        return str(e)
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if not failed:
        return None
    lines = [line.strip() for line in messages[0].splitlines() if line.strip()] or ["rejected"]
    return lines[-1].removeprefix("error: ")


def _check_pattern(w: _Walk, pattern: str, path: str) -> None:
    reason = _pattern_error(pattern)
    if reason is not None:
        w.fail(f"pattern {pattern!r:.80} is not a valid regular expression: {reason}", path)
