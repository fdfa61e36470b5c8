"""K3's request fields checked as K3's API checks them: ``tool_choice``, ``response_format`` and
tool declarations (the request's ``tools`` and each dynamic declaration). Each error is a
ValueError whose message starts with the field it names (``tools[2].function.name: ...``), which
the server turns into a 400 with that field as its ``param``."""

from __future__ import annotations

import re
from typing import Any

TOOL_CHOICES = ("auto", "none", "required")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's function-name rule, which K3's API applies


def check_tool_choice(tool_choice: Any) -> None:
    """``tool_choice`` is None, ``auto`` / ``none`` / ``required`` or a named function.

    Raises:
        ValueError: naming ``tool_choice`` (or ``tool_choice.function.name``).
    """
    if tool_choice is None or (isinstance(tool_choice, str) and tool_choice in TOOL_CHOICES):
        return
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if tool_choice.get("type") != "function" or not isinstance(fn, dict):
            raise ValueError("tool_choice: expected {'type': 'function', 'function': {'name': str}}, got "
                             f"{tool_choice!r:.80}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tool_choice.function.name: expected a non-empty string, got {fn.get('name')!r:.60}")
        return
    raise ValueError(f"tool_choice: expected one of {list(TOOL_CHOICES)} or a named function, got {tool_choice!r:.60}")


def check_response_format(response_format: Any) -> None:
    """``response_format`` is None or one of K3's shapes (see :class:`kvtier.tokenize.xtml.XtmlOptions`).

    Raises:
        ValueError: naming ``response_format``, ``response_format.type``,
            ``response_format.json_schema`` or its ``name`` / ``schema`` / ``strict``.
    """
    if response_format is None:
        return
    if not isinstance(response_format, dict):
        raise ValueError(f"response_format: expected an object with a 'type', got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMATS:
        raise ValueError(f"response_format.type: expected one of {list(RESPONSE_FORMATS)}, got {kind!r:.60}")
    if kind != "json_schema":
        return
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError("response_format.json_schema: required for type 'json_schema' (an object with 'name' and "
                         f"'schema'), got {spec!r:.60}")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise ValueError(f"response_format.json_schema.name: expected a non-empty string, got {spec.get('name')!r:.60}")
    if not isinstance(spec.get("schema"), dict):
        raise ValueError("response_format.json_schema.schema: expected a JSON schema object, got "
                         f"{type(spec.get('schema')).__name__}")
    if "strict" in spec and not isinstance(spec["strict"], bool):
        raise ValueError(f"response_format.json_schema.strict: expected a bool, got {spec['strict']!r:.60}")


def field_error(where: str, what: str) -> ValueError:
    """The error for field ``where`` (``messages[3].content``): a ValueError reading ``WHERE: WHAT``."""
    return ValueError(f"{where}: {what}")


def check_tools(tools: Any, where: str, seen: dict[str, str]) -> None:
    """Each tool is ``{"type": "function", "function": {"name", "description"?, "parameters"?}}``
    with a name matching ``[A-Za-z0-9_-]{1,64}`` that no earlier declaration used.

    Args:
        tools: the declared tools.
        where: the field they came from (``tools``, ``messages[3].tools``).
        seen: names declared so far -> where; updated.

    Raises:
        ValueError: naming ``WHERE[i]...``: an empty list, a malformed tool, a bad or repeated name.
    """
    if not isinstance(tools, list) or not tools:
        raise field_error(where, f"expected a non-empty list of tools, got {tools!r:.60}")
    for i, tool in enumerate(tools):
        at = f"{where}[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else tool
        if kind != "function":
            raise field_error(f"{at}.type", f"expected 'function', got {kind!r:.60}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise field_error(f"{at}.function", f"expected an object with a 'name', got {fn!r:.60}")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise field_error(f"{at}.function.name", f"expected 1-64 characters of [A-Za-z0-9_-], got {name!r:.80}")
        if "description" in fn and not isinstance(fn["description"], str):
            raise field_error(f"{at}.function.description", f"expected a string, got {type(fn['description']).__name__}")
        params = fn.get("parameters")
        if params is not None and not (isinstance(params, dict) and params.get("type", "object") == "object"):
            raise field_error(f"{at}.function.parameters", f"expected a JSON schema of type 'object', got {params!r:.80}")
        if name in seen:
            raise field_error(f"{at}.function.name", f"{name!r} is already declared at {seen[name]}; tool names must be "
                       "unique across the request's tools and every dynamic declaration")
        seen[name] = f"{at}.function.name"
