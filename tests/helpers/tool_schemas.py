"""Tool schemas shared by the tool-call tests."""


SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {"queries": {"type": "array", "items": {"type": "string"}}},
            "required": ["queries"],
        },
    },
}
LS = {
    "type": "function",
    "function": {
        "name": "ls",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "depth": {"type": "integer", "minimum": 0, "maximum": 3},
            },
            "required": ["path"],
            "additionalProperties": False,
        },
    },
}
