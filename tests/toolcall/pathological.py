"""Tool schemas whose instances are huge, or whose grammars are costly, all inside the schema
subset Kimi's validator accepts: the regression set for grammar limits (each must be answered
within a bound set by ``max_tokens`` and the limits, while other requests go on)."""

from __future__ import annotations


def _tool(parameters: dict, name: str = "f") -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def _one(prop: dict, **root) -> dict:
    return {"type": "object", "properties": {"x": prop}, "required": ["x"], **root}


def _words(n: int) -> str:
    """An alternation of ``n`` distinct words: ``^(w0|w1|...)$``."""
    return "^(" + "|".join(f"w{i}" for i in range(n)) + ")$"


def _ref_chain(n: int) -> dict:
    """``x`` reaches its schema through ``n`` definitions that only refer to the next one."""
    defs = {f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(n)}
    defs[f"a{n}"] = {"type": "array", "items": {"type": "string", "minLength": 5000}, "minItems": 100000}
    return _one({"$ref": "#/$defs/a0"}, **{"$defs": defs})


def _nested_refs() -> dict:
    """Objects nested through ``$ref`` down to the depth limit (5), a huge array at the bottom."""
    defs = {f"d{i}": {"type": "object", "properties": {"n": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["n"]}
            for i in range(3)}
    defs["d3"] = {"type": "array", "items": {"type": "string", "pattern": "^(xy|zw){200,2000}$"}, "minItems": 10**6}
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
    # patterns just under GrammarLimits.max_pattern_size (10,000 positions, repetitions unrolled)
    "repeated_group": _tool(_one({"type": "string", "pattern": "^([a-z]{1,9}[0-9]{1,9}){500}$"})),  # 9,000
    "nested_quantifiers": _tool(_one({"type": "string", "pattern": "^(((a|b){1,5}c){1,10}d){1,90}$"})),  # 9,990
    "long_alternation": _tool(_one({"type": "string", "pattern": _words(1500)})),  # 6,390
    "forced_pattern": _tool(_one({"type": "string", "pattern": "^(xyz){3000}$"})),  # 9,000, every byte forced
    "ref_chain": _tool(_ref_chain(40)),
    "nested_refs": _tool(_nested_refs()),
}
# valid schemas whose grammar is refused (by llguidance, or by a limit before compiling): a 400
# naming this keyword (below "tools[0].function.parameters")
REFUSED = {
    # the issue's probe: a million positions, every one forced (~90 s of GIL-held lexer work)
    "repeated_group_probe": (_tool(_one({"type": "string", "pattern": "^(a{1000}){1000}$"})), ".properties.x.pattern"),
    "repeated_pattern": (_tool(_one({"type": "string", "pattern": "^([a-z]{1,20}[0-9]{1,20}){500,5000}$"})),
                         ".properties.x.pattern"),  # 200,000
    "alternation_pattern": (_tool(_one({"type": "string", "pattern": "^(ab|cd|ef|gh){1000,9000}$"})),
                            ".properties.x.pattern"),  # 72,000
    "nested_quantifiers_over": (_tool(_one({"type": "array", "items": {
        "type": "string", "pattern": "^(?:((a|b){2,5}c{3}){10,}){1,100}$"}})), ".properties.x.items.pattern"),  # 13,000
    "long_alternation_over": (_tool(_one({"anyOf": [{"type": "integer"},
                                                    {"type": "string", "pattern": _words(3000)}]})),
                              ".properties.x.anyOf[1].pattern"),  # 13,890
    "pattern_in_defs": (_tool(_one({"$ref": "#/$defs/id"}, **{"$defs": {"id": {
        "type": "string", "pattern": "^[0-9a-f]{64}(-[0-9a-f]{64}){200}$"}}})), ".$defs.id.pattern"),  # 13,064
    "float_range": (_tool(_one({"type": "number", "minimum": -1.5e300, "maximum": 1.5e300})), ".properties.x"),
    "length_and_pattern": (_tool(_one({"type": "string", "pattern": "(a|aa|aaa)*b", "minLength": 100000})),
                           ".properties.x.minLength"),
}
