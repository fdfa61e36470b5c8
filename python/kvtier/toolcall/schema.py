"""The JSON-schema subset Kimi's API accepts for tool ``parameters`` ("Moonshot Flavored JSON
Schema", MFJS), as a validator with clear errors.

The rules follow the behaviour pinned by Moonshot's validator test set
(``../shared/toolcalls/walle/testdata/validator_cases``, run at its test level with a nesting
limit of 5): keywords ``type`` (a type or a list of types), ``properties``, ``required``,
``additionalProperties``, ``items``, ``enum``, ``anyOf``, ``$defs`` (root only), ``$ref``
(``#`` or ``#/$defs/...``), ``$id`` (root only), ``minLength``/``maxLength``/``pattern``,
``minimum``/``maximum``, ``minItems``/``maxItems`` and the annotations ``description``,
``title``, ``default``. Each type admits only its own keywords; ``anyOf`` and ``$ref`` admit no
sibling keywords but annotations; a ``$ref`` chain reached through required properties must be
able to terminate. See docs/kimi.md, "Tool-call schemas".

Beyond Moonshot's rules, a ``pattern`` must be a regular expression that the tool-grammar
compiler, llguidance, accepts, so that a bad one is a schema error here rather than a grammar
error later. That is llguidance's dialect, not Python's ``re``: Rust ``regex`` syntax
(``\\p{L}``, ``(?<name>...)``, ``a**`` are accepted) without look-around, backreferences,
``\\b`` or ``\\Z``, and with ``^``/``$`` only at the start/end of a match (``a$b`` is
rejected). llguidance itself does the check.

Errors are :class:`ToolSchemaError` (a ``ValueError``) whose message starts with the JSON path
of the offending schema, e.g. ``tools[0].function.parameters.properties.user: $ref must be a
string``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from kvtier.toolcall.schema_values import _check_enum, _check_pattern, _check_ranges
from kvtier.toolcall.schema_refs import (
    ANNOTATIONS,
    check_recursion,
    def_depths,
    resolve_ref,
    terminates,
    types_of,
)

TYPES = ("string", "number", "integer", "boolean", "null", "array", "object")
ROOT_ONLY = frozenset({"$defs", "$id"})
SUPPORTED = frozenset(
    {
        "type",
        "properties",
        "additionalProperties",
        "items",
        "enum",
        "required",
        "anyOf",
        "description",
        "$defs",
        "$ref",
        "title",
        "$id",
        "default",
        "maxLength",
        "minLength",
        "maximum",
        "minimum",
        "maxItems",
        "minItems",
        "pattern",
    }
)
_KEYWORDS_OF_TYPE = {
    "object": {
        "type",
        "properties",
        "required",
        "additionalProperties",
        "$ref",
        "anyOf",
        "default",
    },
    "array": {"type", "items", "minItems", "maxItems", "$ref", "default"},
    "string": {"type", "minLength", "maxLength", "pattern", "enum", "default"},
    "number": {"type", "minimum", "maximum", "enum", "default"},
    "integer": {"type", "minimum", "maximum", "enum", "default"},
    "boolean": {"type", "enum", "default"},
    "null": {"type", "enum", "default"},
}
RESERVED_PROPERTY_NAMES = frozenset(
    {"$defs", "$ref", "anyOf", "required", "additionalProperties"}
)


class ToolSchemaError(ValueError):
    """A schema outside the accepted subset. ``unparsable`` is True when the text is not a JSON
    object at all (Moonshot's "JSON schema parsing error")."""

    def __init__(self, message: str, path: str = "", unparsable: bool = False):
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path
        self.unparsable = unparsable


@dataclass(frozen=True)
class SchemaLimits:
    """Size limits of an accepted schema (defaults: Moonshot's validator test configuration).

    Attributes:
        max_depth: nesting levels of ``properties`` (a ``$ref`` adds its target's depth).
        max_anyof_items: branches of one ``anyOf``.
        max_enum_items: values of one ``enum``.
        max_enum_string_length: total characters of an ``enum`` with more than
            ``enum_string_check_threshold`` string or number values.
        enum_string_check_threshold: see ``max_enum_string_length``.
        max_schema_size: characters of the compact JSON text.
        max_total_property_keys: ``properties`` entries over the whole schema.

    Raises:
        ValueError: a limit below 1.
    """

    max_depth: int = 5
    max_anyof_items: int = 500
    max_enum_items: int = 1000
    max_enum_string_length: int = 75000
    enum_string_check_threshold: int = 2500
    max_schema_size: int = 120000
    max_total_property_keys: int = 3000

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"SchemaLimits.{name} must be an int >= 1, got {value!r}"
                )


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _parse_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text} overflows a 64-bit float")
    return value


def parse_schema(text: str):
    """Parse schema text strictly (no NaN/Infinity, no overflowing numbers).

    Raises:
        ToolSchemaError: ``unparsable=True`` when the text is not JSON or not an object.
    """
    try:
        value = json.loads(
            text, parse_constant=_reject_constant, parse_float=_parse_float
        )
    except ValueError as e:
        raise ToolSchemaError(
            f"JSON schema parsing error: {e}", unparsable=True
        ) from None
    if value is not None and not isinstance(value, dict):
        raise ToolSchemaError(
            f"JSON schema parsing error: expected an object, got {type(value).__name__}",
            unparsable=True,
        )
    return value


@dataclass
class _Walk:
    root: dict
    limits: SchemaLimits
    base: str
    refs: dict[str, str] = field(default_factory=dict)  # ref -> path of its first use
    def_depths: dict[str, int] = field(default_factory=dict)
    total_props: int = 0

    def fail(self, message: str, path: str):
        raise ToolSchemaError(message, path or self.base)

    def join(self, path: str, *parts: str) -> str:
        return ".".join([path or self.base, *parts])


def _check_types(w: _Walk, s: dict, path: str, root: bool) -> None:
    """``type`` values and the keywords the types admit."""
    t = s.get("type")
    if isinstance(t, str):
        if t not in TYPES:
            w.fail(f"invalid type: {t!r}; expected one of {list(TYPES)}", path)
        types = [t]
    elif isinstance(t, list):
        if not all(isinstance(x, str) and x in TYPES for x in t):
            w.fail(
                f"invalid type in type array {t!r}; expected strings from {list(TYPES)}",
                path,
            )
        if not t:
            w.fail("type array cannot be empty", path)
        types = t
    else:
        return  # reported by the keyword check
    enum_pair = False
    if len(types) > 1:
        if len(types) == 2 and "enum" in s:
            if "object" in types or "array" in types:
                w.fail(
                    "object and array cannot be used in combination with multiple types",
                    path,
                )
            enum_pair = True
        extra = ROOT_ONLY | ANNOTATIONS if root else ANNOTATIONS
        for k in sorted(s):
            if k != "type" and k not in extra and not enum_pair:
                w.fail(
                    f"keyword {k} is not allowed in combination with multiple types",
                    path,
                )
    if not root:
        for k in sorted(s):
            if k in ROOT_ONLY:
                w.fail(f"keyword {k} must be at root level", path)
    allowed = (
        set.intersection(*(_KEYWORDS_OF_TYPE[x] for x in types))
        | ANNOTATIONS
        | (ROOT_ONLY if root else set())
    )
    invalid = sorted(set(s) - allowed)
    if invalid:
        w.fail(
            f"invalid keywords: {', '.join(invalid)} (not allowed with type {t!r})",
            path,
        )
    _check_ranges(w, s, path, allowed, "integer" in types)


def _check_siblings(w: _Walk, s: dict, path: str, keyword: str, root: bool) -> None:
    """``anyOf`` and ``$ref`` take no sibling keywords but annotations (and, at the root, ``$defs``/``$id``)."""
    for k in sorted(s):
        if k != keyword and k not in ANNOTATIONS and not (root and k in ROOT_ONLY):
            w.fail(f"keyword '{k}' is not allowed at the same level as {keyword}", path)


def _check_required(w: _Walk, s: dict, path: str) -> None:
    req = s["required"]
    if not isinstance(req, list):
        w.fail("required must be an array", path)
    if not req:
        return
    if not all(isinstance(r, str) for r in req):
        w.fail("items in required array must be strings", path)
    if "" in req:
        w.fail("property names in required array cannot be empty", path)
    dupes = sorted({r for r in req if req.count(r) > 1})
    if dupes:
        w.fail(f"duplicate items in required array: {', '.join(dupes)}", path)
    if types_of(s) != ["object"]:
        w.fail("required keyword must be used with object", path)
    props = s.get("properties")
    if not isinstance(props, dict):
        w.fail("required specified but 'properties' keyword is missing", path)
    for r in req:
        if r not in props:
            w.fail(f"required property '{r}' is not defined in properties", path)


def _check_ref(w: _Walk, s: dict, path: str, root: bool) -> None:
    ref = s["$ref"]
    if not isinstance(ref, str):
        w.fail(f"$ref must be a string, got {ref!r}", path)
    if ref != "#":
        if not ref.startswith("#/$defs/"):
            w.fail(
                f"references must start with #/$defs/ (or be '#'), got {ref!r}", path
            )
        if ref == "#/$defs/":
            w.fail("definition name cannot be empty", path)
        if "$defs" not in w.root:
            w.fail(f"$defs not found for reference: {ref}", path)
        _check_siblings(w, s, path, "$ref", root)
    w.refs.setdefault(ref, path)


def _check_anyof(w: _Walk, s: dict, path: str, root: bool) -> None:
    branches = s["anyOf"]
    if not isinstance(branches, list):
        w.fail("anyOf must be an array", path)
    if not 1 <= len(branches) <= w.limits.max_anyof_items:
        w.fail(
            f"anyOf must have 1-{w.limits.max_anyof_items} items, got {len(branches)}",
            path,
        )
    if not all(isinstance(b, dict) for b in branches):
        w.fail("schema in anyOf must be an object", path)
    _check_siblings(w, s, path, "anyOf", root)


def _slash_free(w: _Walk, node, path: str) -> None:
    for k, v in node.items():
        if "/" in k:
            w.fail(f"$defs property name '{k}' cannot contain '/' character", path)
        for child in v if isinstance(v, list) else [v]:
            if isinstance(child, dict):
                _slash_free(w, child, path)


def _check_defs(w: _Walk, s: dict, path: str) -> None:
    defs = s["$defs"]
    if not isinstance(defs, dict):
        w.fail("$defs must be an object", path)
    for name, d in defs.items():
        if not name:
            w.fail("$defs property name cannot be empty", path)
        if "/" in name:
            w.fail(f"$defs property name '{name}' cannot contain '/' character", path)
        if not isinstance(d, dict):
            w.fail(f"$defs schema must be object: {name}", path)
        _slash_free(w, d, w.join(path, "$defs", name))


def _check_properties(w: _Walk, s: dict, path: str) -> None:
    props = s["properties"]
    if not isinstance(props, dict):
        w.fail("properties must be an object", path)
    for name, sub in props.items():
        if not name:
            w.fail("property name cannot be empty", path)
        if name in RESERVED_PROPERTY_NAMES:
            w.fail(f"property name '{name}' is reserved for JSON Schema keywords", path)
        if not isinstance(sub, dict):
            w.fail(f"property schema for '{name}' must be an object", path)


def _check_keywords(w: _Walk, s: dict, path: str, root: bool) -> None:
    """Per-keyword value checks, in sorted keyword order."""
    for k in sorted(s):
        v = s[k]
        if k == "type" and isinstance(v, list):
            if len(set(v)) != len(v):
                w.fail(f"duplicate types in type array {v!r}", path)
        elif k == "type" and not isinstance(v, str):
            w.fail(f"type must be string or array of strings, got {v!r}", path)
        elif k == "properties":
            _check_properties(w, s, path)
        elif k == "required":
            _check_required(w, s, path)
        elif k == "enum":
            _check_enum(w, s, path)
        elif k == "items" and not isinstance(v, dict):
            w.fail(f"items must be an object, got {v!r}", path)
        elif k == "$ref":
            _check_ref(w, s, path, root)
        elif (
            k in ("description", "$id", "pattern")
            and not isinstance(v, str)
            and not (k != "description" and v is None)
        ):
            w.fail(f"{k} must be a string, got {v!r}", path)
        elif k == "pattern" and v is not None:
            _check_pattern(w, v, path)
        elif k == "anyOf":
            _check_anyof(w, s, path, root)
        elif k == "additionalProperties" and not isinstance(v, (bool, dict)):
            w.fail(
                f"additionalProperties must be a boolean or an object, got {v!r}", path
            )
        elif k == "$defs":
            _check_defs(w, s, path)


def _check_anyof_conflicts(w: _Walk, s: dict, path: str) -> None:
    for branch in s.get("anyOf") or []:
        both = sorted(set(branch) & (set(s) - {"anyOf"}))
        if both:
            w.fail(
                f"conflicting keywords found in anyOf with parent: keywords ({', '.join(both)}) are defined "
                "on the parent schema and inside anyOf",
                path,
            )


def _walk(w: _Walk, s: dict, path: str, depth: int) -> int:
    """Check ``s`` and its subschemas; returns the deepest ``properties`` nesting reached."""
    root = path == ""
    if depth > w.limits.max_depth:
        w.fail(f"schema depth exceeds maximum limit of {w.limits.max_depth}", path)
    unsupported = sorted(set(s) - SUPPORTED)
    if unsupported:
        w.fail(f"unsupported keywords: {', '.join(unsupported)}", path)
    deepest = depth
    if isinstance(s.get("$defs"), dict):
        for name in sorted(s["$defs"]):
            d = s["$defs"][name]
            if not isinstance(d, dict):
                w.fail(f"$defs schema must be object: {name}", path)
            deepest = max(deepest, _walk(w, d, w.join(path, "$defs", name), depth))
    if "type" in s:
        if "anyOf" in s:
            w.fail(
                "when using anyOf, type should be defined in anyOf items instead of the parent schema",
                path,
            )
        if "$ref" in s:
            w.fail(
                "when using $ref, type should be defined in the referenced schema instead of the parent schema",
                path,
            )
        types = types_of(s) or []
        if len(types) > 1 and "enum" in s:
            for t in types:
                if t in ("object", "array"):
                    w.fail(f"type {t} is not allowed in combination with enum", path)
    _check_types(w, s, path, root)
    _check_keywords(w, s, path, root)
    _check_anyof_conflicts(w, s, path)
    if isinstance(s.get("$ref"), str):
        deepest = max(deepest, depth + w.def_depths.get(s["$ref"], 0))
    if isinstance(s.get("properties"), dict):
        w.total_props += len(s["properties"])
        if w.total_props > w.limits.max_total_property_keys:
            w.fail(
                f"total number of properties keys ({w.total_props}) across all objects exceeds maximum "
                f"limit of {w.limits.max_total_property_keys}",
                path,
            )
        for name, sub in s["properties"].items():
            deepest = max(
                deepest, _walk(w, sub, w.join(path, "properties", name), depth + 1)
            )
    for key in ("items", "additionalProperties"):
        if isinstance(s.get(key), dict):
            deepest = max(deepest, _walk(w, s[key], w.join(path, key), depth))
    for i, branch in enumerate(s.get("anyOf") or []):
        deepest = max(deepest, _walk(w, branch, w.join(path, f"anyOf[{i}]"), depth))
    return deepest


def validate_schema(
    schema, *, limits: SchemaLimits | None = None, path: str = "schema"
) -> None:
    """Check that ``schema`` is in the subset Kimi's API accepts.

    Args:
        schema: a parsed JSON schema (dict); None is reported as not a dict. Use
            :func:`parse_schema` first for schema text.
        limits: size limits (default :class:`SchemaLimits`).
        path: how to name the schema in error messages (e.g. ``tools[0].function.parameters``).

    Raises:
        ToolSchemaError: the first rule broken, with the JSON path of the offending subschema
            (e.g. a ``pattern`` that llguidance cannot compile).

    Example:
        >>> validate_schema({"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]})
        >>> validate_schema({"type": "string", "minItems": 1})
        Traceback (most recent call last):
        ...
        kvtier.toolcall.schema.ToolSchemaError: schema: invalid keywords: minItems (not allowed with type 'string')
    """
    limits = limits or SchemaLimits()
    if schema is None:
        raise ToolSchemaError("schema must be a dict, got null", path)
    if not isinstance(schema, dict):
        raise ToolSchemaError(
            f"JSON schema parsing error: expected an object, got {type(schema).__name__}",
            path,
            unparsable=True,
        )
    if not schema:
        return
    w = _Walk(schema, limits, path)
    if (
        len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False))
        > limits.max_schema_size
    ):
        w.fail(
            f"schema exceeds maximum allowed size of {limits.max_schema_size} characters",
            "",
        )
    w.def_depths = def_depths(schema)
    if _walk(w, schema, "", 0) > limits.max_depth:
        w.fail(f"schema depth exceeds maximum limit of {limits.max_depth}", "")
    for ref, where in w.refs.items():
        if resolve_ref(schema, ref) is None:
            w.fail(f"invalid $ref path: {ref}", where)
    check_recursion(w, schema, "", not terminates(w, schema, set()))
