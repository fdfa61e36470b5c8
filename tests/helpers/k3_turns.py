"""K3 assistant turns as the model writes them, rendered per ``../shared/docs/K3.md`` ("An
assistant turn"), for the output parser's tests: what follows the generation prompt, as segments
(control tokens apart from text) and as text."""

from __future__ import annotations

import json

OPEN, CLOSE, SEP, END = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"


def _attr_value(value) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def _open(tag: str, attrs=()) -> list[tuple[str, bool]]:
    head = tag + "".join(f' {k}="{_attr_value(v)}"' for k, v in attrs)
    return [(OPEN, True), (head, False), (SEP, True)]


def _close(tag: str) -> list[tuple[str, bool]]:
    return [(CLOSE, True), (tag, False), (SEP, True)]


def _text(text: str) -> list[tuple[str, bool]]:
    return [(text, False)] if text else []


def xtml_type(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", dict: "object"}.get(type(value), "array")


def turn_segments(message: dict, thinking: bool) -> list[tuple[str, bool]]:
    """The whole assistant message (``<|open|>message role="assistant"<|sep|>`` ... ``<|end_of_msg|>``)
    as ``(text, is_control)`` segments. ``message``: ``reasoning_content``, ``content``,
    ``tool_calls`` (``[{"name", "arguments"}]``, arguments a JSON string or not JSON)."""
    segs = _open("message", [("role", "assistant")])
    if thinking:
        reasoning = message.get("reasoning_content") or ""
        segs += _open("think") + (_text(reasoning) if reasoning.strip() else []) + _close("think")
    segs += _open("response") + _text(message.get("content") or "") + _close("response")
    calls = message.get("tool_calls") or []
    if calls:
        segs += _open("tools")
        for i, call in enumerate(calls, start=1):
            segs += _open("call", [("tool", call["name"]), ("index", i)])
            try:
                args = json.loads(call["arguments"])
            except ValueError:
                segs += _open("json", [("type", "object")]) + _text(call["arguments"]) + _close("json")
            else:
                for key, value in args.items():
                    raw = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
                    segs += _open("argument", [("key", key), ("type", xtml_type(value))]) + _text(raw)
                    segs += _close("argument")
            segs += _close("call")
        segs += _close("tools")
    return segs + _close("message") + [(END, True)]


def generated(message: dict, thinking: bool) -> list[tuple[str, bool]]:
    """The segments the model generates for ``message``: :func:`turn_segments` after the
    generation prompt (``<|open|>message role="assistant"<|sep|><|open|>think|response<|sep|>``)."""
    return turn_segments(message, thinking)[6:]


def as_text(segments) -> str:
    return "".join(text for text, _ in segments)


def as_ids(segments, tokenizer) -> list[int]:
    """Control segments as their ids, each text segment encoded on its own (specials disallowed)."""
    ids: list[int] = []
    for text, control in segments:
        ids += [tokenizer.token_id(text)] if control else tokenizer.encode(text, allow_special=False)
    return ids
