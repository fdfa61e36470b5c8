"""Tool schemas whose instances are huge, or whose grammars are costly, all inside the schema
subset Kimi's validator accepts: the regression set for grammar limits (each must be answered
within a bound set by ``max_tokens`` and the limits, while other requests go on)."""

from __future__ import annotations


def _tool(parameters: dict, name: str = "f") -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def _one(prop: dict, **root) -> dict:
    return {"type": "object", "properties": {"x": prop}, "required": ["x"], **root}


def _ref_chain(n: int) -> dict:
    """``x`` reaches its schema through ``n`` definitions that only refer to the next one."""
    defs = {f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(n)}
    defs[f"a{n}"] = {"type": "array", "items": {"type": "string", "minLength": 5000}, "minItems": 100000}
    return _one({"$ref": "#/$defs/a0"}, **{"$defs": defs})


def _nested_refs() -> dict:
    """Objects nested through ``$ref`` down to the depth limit (5), a huge array at the bottom."""
    defs = {f"d{i}": {"type": "object", "properties": {"n": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["n"]}
            for i in range(3)}
    defs["d3"] = {"type": "array", "items": {"type": "string", "pattern": "^(xy|zw){200,4000}$"}, "minItems": 10**6}
    return _one({"$ref": "#/$defs/d0"}, **{"$defs": defs})


# name -> tool; every one valid per kvtier.toolcall.validate_schema
PATHOLOGICAL = {
    "min_items": _tool(_one({"type": "array", "items": {"type": "string"}, "minItems": 1000000})),  # the probe
    "min_length": _tool(_one({"type": "string", "minLength": 10**9})),
    "max_items": _tool(_one({"type": "array", "minItems": 5000, "maxItems": 10**9, "items": {
        "type": "object", "properties": {"a": {"type": "string", "minLength": 50}, "b": {"type": "integer"}},
        "required": ["a", "b"]}})),
    "nested_min_items": _tool(_one({"type": "array", "minItems": 1000, "items": {"type": "array", "minItems": 1000,
                                    "items": {"type": "string", "minLength": 1000}}})),
    "any_of_explosion": _tool(_one({"anyOf": [{"anyOf": [
        {"type": "array", "items": {"type": "string", "pattern": f"^p{i}_{j}[a-z]{{3,40}}$"}, "minItems": 50}
        for j in range(10)]} for i in range(10)]})),  # 100 branches: the prompt that declares it fits 8K tokens
    "repeated_pattern": _tool(_one({"type": "string", "pattern": "^([a-z]{1,20}[0-9]{1,20}){500,5000}$"})),
    "alternation_pattern": _tool(_one({"type": "string", "pattern": "^(ab|cd|ef|gh){1000,9000}$"})),
    "ref_chain": _tool(_ref_chain(40)),
    "nested_refs": _tool(_nested_refs()),
}
# valid schemas whose grammar llguidance refuses: a 400 naming this keyword (below "tools[0].function.parameters")
REFUSED = {
    "float_range": (_tool(_one({"type": "number", "minimum": -1.5e300, "maximum": 1.5e300})), ".properties.x"),
    "length_and_pattern": (_tool(_one({"type": "string", "pattern": "(a|aa|aaa)*b", "minLength": 100000})),
                           ".properties.x.minLength"),
}
