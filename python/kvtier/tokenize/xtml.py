"""Kimi K3's chat format (XTML) as segments: what K3's own renderer (``encoding_k3.py``,
``build_chat_segments``) produces, for :class:`kvtier.tokenize.formats.ChatFormat` ``K3_XTML``.

A prompt is a list of *segments* ``(text, special)``: ``special`` segments are one control token
(``<|open|>``, ``<|close|>``, ``<|sep|>``, ``<|end_of_msg|>``) encoded as its id; every other
segment (a tag name, one attribute, a message body, an argument value) is encoded on its own with
special-token spellings disallowed, so a user who types ``<|open|>`` gets its bytes, never the
control token. Empty text segments are dropped. Facts: ``docs/k3.md``, "Chat format (XTML)".

Segments are grouped into *parts* (:class:`XtmlParts`): the header (tool declaration, then the
thinking-effort message), one part per message, the tails (``tool_choice``, ``response_format``)
and the generation prompt. Every part starts with a control token, so the ids of a part depend on
that part alone: ``ids = sum(encode(part) for part in parts)``, which is what lets
:class:`kvtier.tokenize.xtml_session.XtmlSessionEncoder` re-encode only the parts that changed.

Messages are OpenAI-style dicts (as :mod:`kvtier.tokenize.chat`), plus K3's extensions:

- ``{"role": "system", "content": "" | None, "tools": [tool, ...]}``: tools declared mid-conversation
  (a dynamic ``tool-declare`` message); content must be empty.
- ``{"role": "assistant", ..., "reasoning_content": str}``: the think channel of a history turn
  (with thinking on, a turn without it renders an empty think channel).
- tool results ``{"role": "tool", "tool_call_id": str, "content": ...}``: a run of results is
  re-sorted into the order of the last assistant message's calls when every ``tool_call_id``
  resolves; each is rendered with its call's tool name and an index counted from 1 since that
  assistant message.

Example:
    >>> parts = render_xtml_parts([{"role": "user", "content": "hi"}], options=XtmlOptions(thinking=False))
    >>> "".join(t for part in parts.all() for t, _ in part)
    '<|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|><|open|>message role="assistant"<|sep|><|open|>response<|sep|>'
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from kvtier.tokenize.xtml_fields import field_error, check_response_format, check_tool_choice, check_tools

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
THINKING_EFFORTS = ("low", "high", "max")  # K3's renderer refuses "medium" (its prose still lists it)

Segment = tuple[str, bool]  # (text, special): special = one control token
Part = tuple[Segment, ...]

_TOOL_DECLARE = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{}\n```"
_DYNAMIC_TOOL_DECLARE = ("## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
                         "You have access to all existing and extended tools.\n"
                         "Here are the specs for the extended tools.\n\n```json\n{}\n```")
_THINKING_EFFORT = ("`thinking_effort` guides on how much to think in your thinking channel (not including the "
                    "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
                    "Now the system is invoked with `thinking_effort={}`.")
_TOOL_CHOICE = "The system is invoked with `tool_choice={}`.\nYou MUST {} in the next message."
_RAW_JSON = ("The system is invoked with `response_format={}`.\nYour response must be raw JSON data without "
             "markdown code blocks (```json) or any additional formatting.")
_SCHEMA = "\nThe JSON data must match the following schema:\n```json\n{}\n```"


# -- request options --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class XtmlOptions:
    """The request fields that change a K3 prompt, checked as K3's API checks them.

    Attributes:
        thinking: render the think channel of assistant turns and open it in the generation prompt.
        thinking_effort: ``low`` / ``high`` / ``max`` or None: a ``thinking-effort`` system
            message after the tool declaration (only with ``thinking``).
        tool_choice: ``auto`` / ``none`` / ``required`` or ``{"type": "function", "function":
            {"name": str}}``; ``none`` and ``required`` add a ``tool-choice`` tail message.
        response_format: None, ``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type":
            "json_schema", "json_schema": {"name": str, "schema": {...}, "strict"?: bool}}``;
            the JSON kinds add a ``response-format`` tail message.

    Raises:
        ValueError: naming the field (``thinking``, ``thinking_effort``, ``tool_choice``,
            ``response_format...``) and what was expected.
    """

    thinking: bool = True
    thinking_effort: str | None = None
    tool_choice: Any = None
    response_format: dict | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.thinking, bool):
            raise ValueError(f"thinking: expected a bool, got {type(self.thinking).__name__}")
        if self.thinking_effort is not None and self.thinking_effort not in THINKING_EFFORTS:
            raise ValueError(f"thinking_effort: expected one of {list(THINKING_EFFORTS)}, got {self.thinking_effort!r}")
        check_tool_choice(self.tool_choice)
        check_response_format(self.response_format)

    def tail_choice(self) -> str | None:
        """``required`` or ``none`` when ``tool_choice`` adds a tail message, else None."""
        return self.tool_choice if self.tool_choice in ("required", "none") else None


# -- segments -----------------------------------------------------------------------------------------
def _text(text: str) -> list[Segment]:
    return [(text, False)] if text else []


def escape_attr(value: Any) -> str:
    """An attribute value as K3's renderer writes it: ``&`` -> ``&amp;``, then ``"`` -> ``&quot;``."""
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def open_tag(tag: str, attrs: Sequence[tuple[str, Any]] = ()) -> list[Segment]:
    """``<|open|>TAG key="value"...<|sep|>``: the tag and each attribute are segments of their own."""
    out = [(OPEN, True), *_text(tag)]
    for key, value in attrs:
        out += _text(f' {key}="{escape_attr(value)}"')
    out.append((SEP, True))
    return out


def close_tag(tag: str) -> list[Segment]:
    """``<|close|>TAG<|sep|>``."""
    return [(CLOSE, True), *_text(tag), (SEP, True)]


def _message(attrs: Sequence[tuple[str, Any]], body: list[Segment]) -> Part:
    return tuple(open_tag("message", attrs) + body + close_tag("message") + [(END_OF_MSG, True)])


def _system(kind: str, body: str) -> Part:
    return _message([("role", "system"), ("type", kind)], _text(body.strip()))


def deep_sorted(value: Any) -> Any:
    """``value`` with the keys of every nested object sorted (lists keep their order)."""
    if isinstance(value, dict):
        return {k: deep_sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [deep_sorted(v) for v in value]
    return value


def compact_json(value: Any) -> str:
    """Compact JSON (``","`` and ``":"``, non-ASCII kept), the form of K3's declarations."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _tool_declaration(tools: Sequence[dict], dynamic: bool) -> Part:
    return _system("tool-declare", (_DYNAMIC_TOOL_DECLARE if dynamic else _TOOL_DECLARE).format(
        compact_json(deep_sorted(list(tools)))))


# -- message checks -------------------------------------------------------------------------------------
def _content(msg: dict, where: str) -> str:
    value = msg.get("content")
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, list):
        out = []
        for k, part in enumerate(value):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise field_error(f"{where}.content[{k}]", f"expected {{'type': 'text', 'text': str}}, got {part!r:.80}")
            out.append(part["text"])
        return "".join(out)
    raise field_error(f"{where}.content", f"expected a string or a list of text parts, got {type(value).__name__}")


def _check_message(msg: Any, i: int, seen: dict[str, str]) -> str:
    """The role of ``messages[i]`` after checking its shape; dynamic tools join ``seen``."""
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise field_error(where, f"expected a dict, got {type(msg).__name__}")
    role = msg.get("role")
    if role not in ("system", "user", "assistant", "tool"):
        raise field_error(f"{where}.role", f"expected one of ['assistant', 'system', 'tool', 'user'], got {role!r:.60}")
    if msg.get("tools") is not None:
        if role != "system":
            raise field_error(f"{where}.tools", f"tools may only be declared on a system message, not on a {role} message")
        if _content(msg, where):
            raise field_error(f"{where}.tools", "a system message that declares tools must have empty content")
        check_tools(msg["tools"], f"{where}.tools", seen)
    name = msg.get("name")
    if name is not None and not isinstance(name, str):
        raise field_error(f"{where}.name", f"expected a string, got {type(name).__name__}")
    return role


# -- assistant turns ----------------------------------------------------------------------------------
def xtml_type(value: Any) -> str:
    """The ``type`` attribute K3 writes for a JSON value: string, number, boolean, null, object or array."""
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def _arguments(args: Any, where: str) -> tuple[dict, str | None]:
    """(arguments as an object, raw text when they are not JSON: rendered as a ``json`` block)."""
    if args is None:
        return {}, None
    if isinstance(args, dict):
        return args, None
    if not isinstance(args, str):
        raise field_error(where, f"expected a JSON object (as a string or a dict), got {type(args).__name__}")
    if not args.strip():
        return {}, None
    try:
        value = json.loads(args)
    except (ValueError, RecursionError):
        return {}, args  # K3 renders unparseable arguments as they are, in a json block
    if not isinstance(value, dict):
        raise field_error(where, f"expected a JSON object, got {args[:60]!r}")
    return value, None


def _call(call: Any, index: int, where: str) -> list[Segment]:
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise field_error(f"{where}.function", "expected {'name': str, 'arguments': ...}")
    args, raw = _arguments(fn.get("arguments"), f"{where}.function.arguments")
    out = open_tag("call", [("tool", fn["name"]), ("index", index)])
    if raw is not None:
        out += open_tag("json", [("type", "object")]) + _text(raw) + close_tag("json")
    for key, value in args.items():
        try:
            rendered = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError) as e:
            raise field_error(f"{where}.function.arguments.{key}", f"not JSON: {type(e).__name__}: {e}") from None
        out += open_tag("argument", [("key", key), ("type", xtml_type(value))]) + _text(rendered)
        out += close_tag("argument")
    return out + close_tag("call")


def _assistant(msg: dict, where: str, thinking: bool) -> list[Segment]:
    out: list[Segment] = []
    if thinking:
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        if reasoning is not None and not isinstance(reasoning, str):
            raise field_error(f"{where}.reasoning_content", f"expected a string, got {type(reasoning).__name__}")
        out += open_tag("think") + (_text(reasoning) if reasoning and reasoning.strip() else []) + close_tag("think")
    out += open_tag("response") + _text(_content(msg, where)) + close_tag("response")
    calls = msg.get("tool_calls") or []
    if not isinstance(calls, list):
        raise field_error(f"{where}.tool_calls", f"expected a list, got {type(calls).__name__}")
    if calls:
        out += open_tag("tools")
        for k, call in enumerate(calls):
            out += _call(call, k + 1, f"{where}.tool_calls[{k}]")
        out += close_tag("tools")
    return out


# -- tool results -------------------------------------------------------------------------------------
def _call_names(msg: dict) -> list[str | None]:
    out = []
    for call in msg.get("tool_calls") or []:
        fn = call.get("function", call) if isinstance(call, dict) else None
        out.append(fn.get("name") if isinstance(fn, dict) else None)
    return out


def result_order(messages: Sequence[dict]) -> list[tuple[int, str | None]]:
    """The order K3 renders ``messages`` in, with the tool name of each tool result.

    A run of tool messages is sorted into the order of the last assistant message's
    ``tool_calls`` when every ``tool_call_id`` of the run names one of them (then each takes its
    call's name); otherwise the run keeps its order and each result takes its own ``name`` or the
    name of the call at its position.

    Returns:
        ``[(index into messages, tool name or None for a non-tool message)]``.
    """
    out: list[tuple[int, str | None]] = []
    positions: dict[str, tuple[int, str | None]] = {}
    names: list[str | None] = []
    i = 0
    while i < len(messages):
        msg = messages[i]
        if msg.get("role") != "tool":
            if msg.get("role") == "assistant":
                names = _call_names(msg)
                ids = [c.get("id") if isinstance(c, dict) else None for c in msg.get("tool_calls") or []]
                positions = {}
                for k, call_id in enumerate(ids):
                    if call_id is not None:
                        positions.setdefault(str(call_id), (k, names[k]))
            out.append((i, None))
            i += 1
            continue
        j = i
        while j < len(messages) and messages[j].get("role") == "tool":
            j += 1
        call_ids = [messages[k].get("tool_call_id", messages[k].get("id")) for k in range(i, j)]
        found = [None if c is None else positions.get(str(c)) for c in call_ids]
        if all(f is not None for f in found):
            ordered = sorted(range(i, j), key=lambda k: found[k - i][0])  # stable: ties keep their order
            out.extend((k, found[k - i][1]) for k in ordered)
        else:
            out.extend((k, None) for k in range(i, j))
        i = j
    named, names, seen_calls = [], [], 0
    for idx, name in out:  # unresolved: the message's own name, else the call's at its position
        msg = messages[idx]
        if msg.get("role") == "assistant":
            names, seen_calls = _call_names(msg), 0
        elif msg.get("role") == "tool":
            seen_calls += 1
            if name is None:
                name = msg.get("name")
                if name is None and seen_calls <= len(names):
                    name = names[seen_calls - 1]
        named.append((idx, name))
    return named


# -- the prompt -----------------------------------------------------------------------------------------
@dataclasses.dataclass
class XtmlParts:
    """A K3 prompt as parts of segments (see the module docstring).

    Attributes:
        header: the tool declaration and the thinking-effort message (each one part, if present).
        messages: one part per rendered message, in K3's order (tool results re-sorted).
        tails: the ``tool-choice`` and ``response-format`` messages (each one part, if present).
        generation: the generation prompt (``()`` without it).
    """

    header: list[Part]
    messages: list[Part]
    tails: list[Part]
    generation: Part

    def all(self) -> list[Part]:
        """Every part in prompt order (empty ones left out)."""
        return [p for p in (*self.header, *self.messages, *self.tails, self.generation) if p]

    def text(self) -> str:
        """The prompt as text (control tokens spelled): for reading, never for encoding."""
        return "".join(t for part in self.all() for t, _ in part)


def render_xtml_parts(messages: Sequence[dict], tools: Sequence[dict] | None = None,
                      options: XtmlOptions | None = None, add_generation_prompt: bool = True) -> XtmlParts:
    """Render a conversation in K3's format.

    Args:
        messages: OpenAI-style messages with K3's extensions (module docstring); at least one.
        tools: OpenAI tool declarations (``{"type": "function", "function": {...}}``), declared
            first as deep-sorted compact JSON; None: no declaration. An empty list is an error.
        options: :class:`XtmlOptions` (default: thinking on, no effort, no tails).
        add_generation_prompt: end with ``<|open|>message role="assistant"<|sep|>`` and the
            think channel's (thinking) or the response channel's opening.

    Returns:
        :class:`XtmlParts`.

    Raises:
        ValueError: naming the field: ``messages[i].role`` / ``.content`` / ``.tools`` /
            ``.tool_calls[k]...`` (a malformed message, tools on a non-system message or beside
            content), ``tools[i]...`` (a malformed tool, a name declared twice), ``tool_choice``
            (``required`` without any tool).
    """
    options = options if options is not None else XtmlOptions()
    if not isinstance(options, XtmlOptions):
        raise ValueError(f"options: expected an XtmlOptions, got {type(options).__name__}")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages: expected a non-empty list of message dicts")
    seen: dict[str, str] = {}
    if tools is not None:
        check_tools(list(tools) if isinstance(tools, tuple) else tools, "tools", seen)
    roles = [_check_message(m, i, seen) for i, m in enumerate(messages)]
    if options.tool_choice == "required" and not seen:
        raise ValueError("tool_choice: 'required' needs tools (none are declared)")
    header = [_tool_declaration(tools, dynamic=False)] if tools else []
    if options.thinking and options.thinking_effort:
        header.append(_system("thinking-effort", _THINKING_EFFORT.format(options.thinking_effort)))
    parts = []
    tool_index = 0
    for i, tool_name in result_order(messages):
        msg, role, where = messages[i], roles[i], f"messages[{i}]"
        if role == "system" and msg.get("tools"):
            parts.append(_tool_declaration(msg["tools"], dynamic=True))
        elif role in ("user", "system"):
            attrs = [("role", role)] + ([("name", msg["name"])] if msg.get("name") else [])
            parts.append(_message(attrs, _text(_content(msg, where))))
        elif role == "assistant":
            tool_index = 0
            parts.append(_message([("role", "assistant")], _assistant(msg, where, options.thinking)))
        else:
            tool_index += 1
            if tool_name is None:
                raise field_error(f"{where}.tool_call_id", "names no call of the last assistant message, and the message "
                           "has no 'name' to render it with")
            parts.append(_message([("role", "tool"), ("tool", tool_name), ("index", tool_index)],
                                  _text(_content(msg, where))))
    generation = generation_prompt(options.thinking) if add_generation_prompt else ()
    return XtmlParts(header, parts, _tails(options), generation)


def _tails(options: XtmlOptions) -> list[Part]:
    tails = []
    choice = options.tail_choice()
    if choice is not None:
        must = "call tools" if choice == "required" else "NOT call any tools"
        tails.append(_system("tool-choice", _TOOL_CHOICE.format(choice, must)))
    kind = (options.response_format or {}).get("type")
    if kind == "json_object":
        tails.append(_system("response-format", _RAW_JSON.format(kind)))
    elif kind == "json_schema":
        schema = compact_json(deep_sorted(options.response_format["json_schema"]["schema"]))
        tails.append(_system("response-format", _RAW_JSON.format(kind) + _SCHEMA.format(schema)))
    return tails


def generation_prompt(thinking: bool) -> Part:
    """``<|open|>message role="assistant"<|sep|>`` + ``<|open|>think<|sep|>`` (thinking) or
    ``<|open|>response<|sep|>``."""
    return tuple(open_tag("message", [("role", "assistant")]) + open_tag("think" if thinking else "response"))


def encode_part(tokenizer, part: Sequence[Segment]) -> list[int]:
    """The ids of ``part``: a special segment is its control id, text is encoded with special
    spellings as text (``KimiTokenizer.encode_segment``).

    Raises:
        KeyError: a special segment the tokenizer does not have (a K2 tokenizer given a K3 prompt).
    """
    ids: list[int] = []
    for text, special in part:
        if special:
            ids.append(tokenizer.token_id(text))
        else:
            ids.extend(tokenizer.encode_segment(text))
    return ids


def encode_xtml(tokenizer, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                options: XtmlOptions | None = None, add_generation_prompt: bool = True) -> list[int]:
    """The ids of a K3 prompt: :func:`render_xtml_parts`, each part encoded by :func:`encode_part`.

    Raises:
        ValueError: as :func:`render_xtml_parts`.
    """
    parts = render_xtml_parts(messages, tools, options, add_generation_prompt)
    return [i for part in parts.all() for i in encode_part(tokenizer, part)]
