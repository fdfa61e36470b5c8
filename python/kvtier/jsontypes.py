"""JSON type names for error messages, shared by the chat template's input checks
(:mod:`kvtier.tokenize.chat`) and the tool-call parser (:mod:`kvtier.toolcall.parser`)."""

from __future__ import annotations

_NAMES = {
    dict: "object",
    list: "array",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
    type(None): "null",
}


def json_type_name(value: object) -> str:
    """The JSON type of a value as ``json.loads`` returns it.

    Example:
        >>> json_type_name([1]), json_type_name("x"), json_type_name(None)
        ('array', 'string', 'null')
    """
    return _NAMES[type(value)]
