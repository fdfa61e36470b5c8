"""Grammars of a Kimi K3 assistant turn (XTML), compiled with llguidance like K2's
(:mod:`kvtier.toolcall.grammar`).

The turn, from the channel the generation prompt opened (``docs/k3.md``, "Chat
format (XTML)")::

    start:    think? response tools? <|close|>message<|sep|>        (then <|end_of_msg|> or [EOS])
    think:    <|open|>think<|sep|> TEXT? <|close|>think<|sep|>
    response: <|open|>response<|sep|> (TEXT? | %json{response schema}) <|close|>response<|sep|>
    tools:    <|open|>tools<|sep|> call_1 call_2? ... <|close|>tools<|sep|>
    call_k:   <|open|>call tool="NAME" index="k"<|sep|> arguments(NAME) <|close|>call<|sep|>

The prompt's own tail (``<|open|>think<|sep|>`` or ``<|open|>response<|sep|>``) is fed to the
matcher before the first sampled token (:meth:`kvtier.toolcall.ToolCallConstraint.prime`), so
one grammar serves thinking on and off. Calls are numbered as K3's renderer numbers them
(``index`` 1, 2, ... within the turn; exact up to :data:`EXACT_CALL_INDEXES`, any number after).

A tool's arguments follow its ``parameters`` (the schema subset of
:mod:`kvtier.toolcall.schema`): one ``<|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|>``
per property, in the schema's order, required ones always and the others optionally, never a
key the schema does not declare. ``type`` is K3's type of the value (``integer`` is
``number``); a string value is raw text (its ``enum``, ``minLength``/``maxLength`` and
``pattern``, anchored, as a regular expression over the raw text), any other value JSON with
``", "`` / ``": "`` separators (as K3's renderer writes it) under llguidance's JSON-schema
compiler. A property that admits several types (a ``type`` list, ``anyOf``, no ``type``) is
the union of one argument per type. ``$ref`` pointers keep working inside the embedded
schemas (``$defs`` and the root are carried along).

``tool_choice``: ``"none"`` allows no tools channel, ``"auto"`` an optional one, ``"required"``
and a named tool a mandatory one (only that tool's calls when named; one call when
``parallel_tool_calls`` is False). ``response_format`` puts its JSON schema on the response
channel (``{"type": "object"}`` for ``json_object``): with ``"none"`` or no tools the answer is
an instance; with ``"auto"`` an instance (calls optional) or an empty response channel and
calls; with calls required the response channel is free text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from kvtier.tokenize.xtml import escape_attr, xtml_type
from kvtier.toolcall.schema_refs import resolve_ref, types_of
from kvtier.toolcall.tools import ToolSpec

EXACT_CALL_INDEXES = 16  # calls whose index attribute the grammar pins (1..16); later ones: any number
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # json.dumps' default
_TYPES = ("string", "number", "boolean", "null", "object", "array")  # K3's type attribute values
_MAX_REF_DEPTH = 8  # $ref-only chains followed at a property's top before it is embedded as is
_ROOT = "__k3_root"  # the $defs entry the tool's root schema is carried in, for "#..." pointers


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _tag(name: str, attrs: str = "") -> str:
    """``<|open|>NAME attrs<|sep|>`` as a grammar sequence."""
    return f"<|open|> {_lit(name + attrs)} <|sep|>"


def _close(name: str) -> str:
    return f"<|close|> {_lit(name)} <|sep|>"


class _Rules:
    """Grammar lines under construction, with fresh rule names."""

    def __init__(self):
        self.lines: list[str] = []
        self._n = 0

    def add(self, body: str, terminal: bool = False) -> str:
        self._n += 1
        name = f"T{self._n}" if terminal else f"r{self._n}"
        self.lines.append(f"{name}: {body}")
        return name


def _rewrite_refs(schema, has_root: list):
    """``schema`` with pointers into the tool's root (``#``, ``#/properties/...``) redirected to
    ``#/$defs/__k3_root...``; sets ``has_root[0]`` when there was one."""
    if isinstance(schema, dict):
        out = {}
        for k, v in schema.items():
            into_root = isinstance(v, str) and (v == "#" or (v.startswith("#/") and not v.startswith("#/$defs/")))
            if k == "$ref" and into_root:
                has_root[0] = True
                out[k] = f"#/$defs/{_ROOT}" + v[1:]
            else:
                out[k] = _rewrite_refs(v, has_root)
        return out
    if isinstance(schema, list):
        return [_rewrite_refs(x, has_root) for x in schema]
    return schema


class _ToolArguments:
    """The argument rules of one tool's ``parameters``."""

    def __init__(self, rules: _Rules, root: dict):
        self.rules, self.root = rules, root
        self.defs = root.get("$defs") if isinstance(root.get("$defs"), dict) else {}

    def embedded(self, schema: dict, json_type: str | None) -> str:
        """``%json`` of ``schema`` (restricted to ``json_type``) with the tool's ``$defs`` and root."""
        has_root = [False]
        doc = _rewrite_refs({k: v for k, v in schema.items() if k != "$defs"}, has_root)
        if json_type is not None:
            doc["type"] = json_type
        defs = _rewrite_refs(self.defs, has_root)
        if has_root[0]:
            defs = {**defs, _ROOT: _rewrite_refs({k: v for k, v in self.root.items() if k != "$defs"}, [False])}
        if defs:
            doc["$defs"] = defs
        doc["x-guidance"] = JSON_STYLE
        return f"%json {json.dumps(doc, ensure_ascii=False)}"

    def raw_string(self, schema: dict) -> str:
        """The raw text of a string under ``schema``'s ``enum``, length bounds and ``pattern``."""
        enum = schema.get("enum")
        if isinstance(enum, list):
            return "(" + " | ".join(_lit(v) for v in enum if isinstance(v, str)) + ")"
        lo, hi = schema.get("minLength"), schema.get("maxLength")
        parts = []
        if isinstance(lo, int) or isinstance(hi, int):
            parts.append(f"/(?s:.{{{lo or 0},{hi if isinstance(hi, int) else ''}}})/")
        pattern = schema.get("pattern")
        if isinstance(pattern, str):
            body = pattern[1:] if pattern.startswith("^") else pattern
            body = body[:-1] if body.endswith("$") and not body.endswith("\\$") else body
            parts.append("/" + body.replace("/", "\\/") + "/")
        if not parts:
            return "TEXT?"
        return self.rules.add(" & ".join(parts), terminal=True)

    def alternatives(self, schema, depth: int = 0) -> list[tuple[str, str]]:
        """``[(K3 type, value grammar)]`` of the values ``schema`` admits."""
        if schema is True or not isinstance(schema, dict):
            schema = {}
        ref = schema.get("$ref")
        if isinstance(ref, str) and "type" not in schema and "anyOf" not in schema:
            target = resolve_ref(self.root, ref)
            if target is None or depth >= _MAX_REF_DEPTH:
                return [(t, self.embedded(schema, None)) for t in _TYPES if t != "string"]
            return self.alternatives(target, depth + 1)
        if isinstance(schema.get("anyOf"), list):
            out = []
            for branch in schema["anyOf"]:
                out += [a for a in self.alternatives(branch, depth + 1) if a not in out]
            return out
        types = types_of(schema) or list(_TYPES)
        enum = schema.get("enum")
        out = []
        for t in dict.fromkeys("number" if t == "integer" else t for t in types):
            if t == "string":
                if not isinstance(enum, list) or any(isinstance(v, str) for v in enum):
                    out.append(("string", self.raw_string(schema)))
            elif isinstance(enum, list):
                values = [v for v in enum if xtml_type(v) == t]
                if values:
                    out.append((t, "(" + " | ".join(_lit(json.dumps(v, ensure_ascii=False)) for v in values) + ")"))
            else:
                json_type = "integer" if t == "number" and "integer" in types and "number" not in types else t
                out.append((t, self.embedded(schema, json_type)))
        return out

    def argument(self, key: str, schema) -> str:
        """The rule of one ``argument`` element for property ``key``."""
        head = ' key="' + escape_attr(key) + '" type="'
        alts = [f"{_tag('argument', head + t + chr(34))} {value} {_close('argument')}"
                for t, value in self.alternatives(schema)]
        return self.rules.add(" | ".join(alts) if alts else '""')

    def arguments(self, schema, depth: int = 0) -> str:
        """The sequence of argument elements of an object schema (a union for ``anyOf``)."""
        if schema is True or not isinstance(schema, dict):
            schema = {}
        ref = schema.get("$ref")
        if isinstance(ref, str) and "properties" not in schema and depth < _MAX_REF_DEPTH:
            target = resolve_ref(self.root, ref)
            if target is not None:
                return self.arguments(target, depth + 1)
        if isinstance(schema.get("anyOf"), list) and depth < _MAX_REF_DEPTH:
            branches = [self.arguments(b, depth + 1) for b in schema["anyOf"]]
            return self.rules.add(" | ".join(branches))
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = [k for k in schema.get("required") or [] if isinstance(k, str)]
        seq = [self.argument(key, sub) + ("" if key in required else "?")
               for key, sub in props.items() if sub is not False]
        seq += [self.argument(key, {}) for key in required if key not in props]
        return self.rules.add(" ".join(seq) if seq else '""')


def xtml_turn_grammar(specs: Sequence[ToolSpec], choice: str, parallel_tool_calls: bool = True,
                      response_schema: dict | None = None) -> str:
    """The Lark (llguidance dialect) grammar of a K3 assistant turn (see the module docstring).

    Args:
        specs: the declared tools (:func:`kvtier.toolcall.tools.normalize_tools`).
        choice: ``"auto"``, ``"none"``, ``"required"`` or a tool name
            (:func:`kvtier.toolcall.tools.normalize_tool_choice`).
        parallel_tool_calls: allow more than one call.
        response_schema: the JSON schema of the response channel's text (``response_format``),
            or None for any text.

    Returns:
        the grammar text for ``llguidance.grammar_from("lark", ...)``.

    Raises:
        ValueError: a tool's parameters nested too deeply to walk, naming ``tools[i]``.
    """
    rules = _Rules()
    named = [s for s in specs if choice in ("auto", "required") or s.name == choice]
    calls = choice != "none" and bool(named)
    content = "TEXT?" if response_schema is None or choice not in ("auto", "none") else "answer"
    lines = ["%llguidance {}", "TEXT: /(?s:.+)/",
             f"think: {_tag('think')} TEXT? {_close('think')}",
             f"response: {_tag('response')} {content} {_close('response')}"]
    if response_schema is not None:
        answer = json.dumps({**response_schema, "x-guidance": JSON_STYLE}, ensure_ascii=False)
        rules.lines.append(f"answer: %json {answer}")
    if not calls:
        lines.insert(2, f"start: think? response {_close('message')}")
        return "\n".join(lines + rules.lines)
    bodies = []
    for i, spec in enumerate(named):
        try:
            args = _ToolArguments(rules, spec.parameters).arguments(spec.parameters)
        except RecursionError:
            raise ValueError(f"tools[{specs.index(spec)}].function.parameters: nested too deeply to process") from None
        bodies.append((spec.name, args))

    def call(index: str) -> str:
        alts = [f"<|open|> {_lit('call tool=' + chr(34) + escape_attr(name) + chr(34) + ' index=' + chr(34))} "
                f"{index} {_lit(chr(34))} <|sep|> {args}" for name, args in bodies]
        return rules.add(f"({' | '.join(alts)}) {_close('call')}")

    calls = [call(_lit(str(k))) for k in range(1, (EXACT_CALL_INDEXES if parallel_tool_calls else 1) + 1)]
    chain = calls[-1] + (" " + call("/[1-9][0-9]*/") + "*" if parallel_tool_calls else "")
    for c in reversed(calls[:-1]):
        chain = f"{c} ({chain})?"
    lines.append(f"tools: {_tag('tools')} {chain} {_close('tools')}")
    if choice != "auto":
        body = "response tools"
    elif response_schema is None:
        body = "response tools?"
    else:  # the JSON answer, or calls after an empty response channel
        lines.append(f"no_answer: {_tag('response')} {_close('response')}")
        body = "(response tools? | no_answer tools)"
    lines.insert(2, f"start: think? {body} {_close('message')}")
    return "\n".join(lines + rules.lines)


__all__ = ["EXACT_CALL_INDEXES", "xtml_turn_grammar"]
