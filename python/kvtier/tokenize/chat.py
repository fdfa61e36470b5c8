"""The Kimi K2 chat template (K2-0905 style, and the K2-Thinking variant) as plain Python.

Each message renders ``<|im_X|>{name}<|im_middle|>{body}<|im_end|>`` (X = user, assistant or
system; tool results and the tool declaration are system turns); no BOS, no separators. See
docs/kimi.md, "Chat template". :func:`render_messages` returns one string per rendered part so the
session encoder can compare turns without re-scanning the whole conversation.

Messages are OpenAI-style dicts:

- ``{"role": "system"|"user", "content": str, "name"?: str}``
- ``{"role": "assistant", "content": str | None, "tool_calls"?: [{"id": str, "type": "function",
  "function": {"name": str, "arguments": str | dict}}], "reasoning_content"?: str}``,
  where ``arguments`` is a JSON object given as JSON text or as a dict (OpenAI-style tool calls)
- ``{"role": "tool", "tool_call_id": str, "content": str, "name"?: str}``

``content`` may also be a list of ``{"type": "text", "text": str}`` parts (joined).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from kvtier.jsontypes import json_type_name

DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."
GENERATION_PROMPT = "<|im_assistant|>assistant<|im_middle|>"
_ROLE_TAG = {"user": "<|im_user|>", "assistant": "<|im_assistant|>", "system": "<|im_system|>",
             "tool": "<|im_system|>"}


def _bad(index: int, field: str, what: str) -> ValueError:
    return ValueError(f"messages[{index}].{field}: {what}")


def _text(msg: dict, index: int, field: str = "content", required: bool = True) -> str:
    value = msg.get(field)
    if value is None:
        if required and field not in msg:
            raise _bad(index, field, "missing (a string is required)")
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and field == "content":
        parts = []
        for k, part in enumerate(value):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise _bad(index, f"{field}[{k}]", f"expected {{'type': 'text', 'text': str}}, got {part!r:.80}")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(index, field, f"expected a string, got {type(value).__name__}")


def _arguments(call: dict, index: int, k: int) -> str:
    field = f"tool_calls[{k}].function.arguments"
    args = call["function"].get("arguments")
    if isinstance(args, str):
        try:
            value = json.loads(args)
        except json.JSONDecodeError as e:
            raise _bad(index, field, f"not valid JSON ({e.msg} at char {e.pos}): {args[:60]!r}") from None
        except RecursionError:  # nesting deeper than Python's stack
            raise _bad(index, field, f"JSON nested too deeply to read: {args[:60]!r}") from None
        except ValueError as e:  # e.g. an integer longer than Python converts (sys.get_int_max_str_digits)
            raise _bad(index, field, f"JSON that cannot be read: {e}: {args[:60]!r}") from None
        if not isinstance(value, dict):
            raise _bad(index, field, f"expected a JSON object, got a JSON {json_type_name(value)}: {args[:60]!r}")
        return args
    if isinstance(args, dict):
        try:
            return json.dumps(args, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError) as e:  # e.g. a set, a cycle, deep nesting
            raise _bad(index, field, f"a dict that is not JSON: {type(e).__name__}: {e}") from None
    raise _bad(index, field, f"expected a JSON object (as a string or a dict), got {type(args).__name__}")


def _tool_calls(msg: dict, index: int, call_counter: list[int]) -> str:
    calls = msg["tool_calls"]
    if not isinstance(calls, list):
        raise _bad(index, "tool_calls", f"expected a list, got {type(calls).__name__}")
    out = ["<|tool_calls_section_begin|>"]
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(index, f"tool_calls[{k}].function", "expected {'name': str, 'arguments': ...}")
        call_id = call.get("id")
        if call_id is None:
            call_id = f"functions.{fn['name']}:{call_counter[0]}"
        elif not isinstance(call_id, str):
            raise _bad(index, f"tool_calls[{k}].id", f"expected a string, got {type(call_id).__name__}")
        call_counter[0] += 1
        out.append(f"<|tool_call_begin|>{call_id}<|tool_call_argument_begin|>{_arguments(call, index, k)}"
                   "<|tool_call_end|>")
    out.append("<|tool_calls_section_end|>")
    return "".join(out)


def _last_final_answer(messages: Sequence[dict]) -> int:
    """Index of the last assistant message without tool calls (-1: none)."""
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if isinstance(m, dict) and m.get("role") == "assistant" and not m.get("tool_calls"):
            return i
    return -1


def _render_one(msg: dict, index: int, thinking: bool, history: bool, call_counter: list[int]) -> str:
    if not isinstance(msg, dict):
        raise ValueError(f"messages[{index}]: expected a dict, got {type(msg).__name__}")
    role = msg.get("role")
    if not isinstance(role, str) or role not in _ROLE_TAG:
        raise _bad(index, "role", f"unknown role {role!r}; expected one of {sorted(_ROLE_TAG)}")
    name = msg.get("name") or role
    if not isinstance(name, str):
        raise _bad(index, "name", f"expected a string, got {type(name).__name__}")
    if role == "tool":
        call_id = _text(msg, index, "tool_call_id")
        body = f"## Return of {call_id}\n{_text(msg, index)}"
    elif role == "assistant":
        has_calls = bool(msg.get("tool_calls"))
        body = _text(msg, index, required=not has_calls)
        if thinking:
            reasoning = "" if history else _text(msg, index, "reasoning_content", required=False)
            body = f"<think>{reasoning}</think>{body}"
        if has_calls:
            body += _tool_calls(msg, index, call_counter)
    else:
        body = _text(msg, index)
    return f"{_ROLE_TAG[role]}{name}<|im_middle|>{body}<|im_end|>"


def render_tools(tools: Sequence[dict] | None) -> str:
    """The tool-declaration turn (``""`` without tools)."""
    if not tools:
        return ""
    if not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools):
        raise ValueError("tools: expected a list of tool objects ({'type': 'function', 'function': {...}})")
    return f"<|im_system|>tool_declare<|im_middle|>{json.dumps(list(tools), ensure_ascii=False, separators=(',', ':'))}<|im_end|>"


def header_parts(messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[str]:
    """The parts before the first message: [tool declaration][default system turn]."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages: expected a list of dicts, got {type(messages).__name__}")
    parts = [render_tools(tools)] if tools else []
    if messages and not (isinstance(messages[0], dict) and messages[0].get("role") == "system"):
        parts.append(f"<|im_system|>system<|im_middle|>{DEFAULT_SYSTEM}<|im_end|>")
    return parts


def history_end(messages: Sequence[dict], thinking: bool) -> int:
    """Messages ``[0, history_end)`` render without reasoning (thinking: up to the last final answer)."""
    return _last_final_answer(messages) + 1 if thinking else 0


def render_message(msg: dict, index: int, *, thinking: bool = False, history: bool = False,
                   call_index: int = 0) -> tuple[str, int]:
    """One message's part and the number of tool calls it holds (for default call ids).

    ``call_index`` counts the tool calls of earlier messages. Raises as :func:`render_chat`.
    """
    counter = [call_index]
    return _render_one(msg, index, thinking, history, counter), counter[0] - call_index


def render_messages(messages: Sequence[dict], tools: Sequence[dict] | None = None,
                    add_generation_prompt: bool = True, thinking: bool = False) -> list[str]:
    """The rendered conversation as parts: [tool declaration][default system] one per message
    [generation prompt]. ``"".join(parts) == render_chat(...)``. Raises as :func:`render_chat`."""
    parts = header_parts(messages, tools)
    n_hist = history_end(messages, thinking)
    counter = [0]
    parts.extend(_render_one(m, i, thinking, i < n_hist, counter) for i, m in enumerate(messages))
    if add_generation_prompt:
        parts.append(GENERATION_PROMPT)
    return parts


def render_chat(messages: Sequence[dict], tools: Sequence[dict] | None = None,
                add_generation_prompt: bool = True, thinking: bool = False) -> str:
    """Render an OpenAI-style conversation with the Kimi K2 template.

    Args:
        messages: list of message dicts (see the module docstring).
        tools: OpenAI tool declarations, rendered as compact JSON in a first ``tool_declare``
            system turn; None or empty: no declaration.
        add_generation_prompt: end with ``<|im_assistant|>assistant<|im_middle|>``.
        thinking: K2-Thinking rendering: assistant bodies are ``<think>{reasoning}</think>{content}``;
            reasoning of every assistant turn up to the last final answer (an assistant turn
            without tool calls) is dropped, so the rendering is not append-only.

    Returns:
        the prompt text (special tokens as strings; encode with ``KimiTokenizer.encode``).

    Raises:
        ValueError: naming ``messages[i].field``: unknown role, non-string content or name, a
            missing ``tool_call_id``, malformed ``tool_calls``, arguments that are not a JSON
            object.

    Example:
        >>> render_chat([{"role": "user", "content": "hi"}])
        '<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|><|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>'
    """
    return "".join(render_messages(messages, tools, add_generation_prompt, thinking))
