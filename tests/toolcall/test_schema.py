"""The Kimi tool-schema subset: every case of Moonshot's validator set gets the outcome it expects."""

import json

import pytest
from kvtier.toolcall import (
    GrammarError,
    SchemaLimits,
    ToolSchemaError,
    normalize_tool_choice,
    normalize_tools,
    parse_schema,
    turn_grammar,
    validate_schema,
)


def _cases(walle_dir, kind):
    for path in sorted(walle_dir.glob(f"*/{kind}.jsonl")):
        for i, line in enumerate(path.read_text().splitlines()):
            yield f"{path.parent.name}:{i}", line


def test_every_valid_walle_schema_is_accepted(walle_dir):
    cases = list(_cases(walle_dir, "valid"))
    assert len(cases) == 213
    for name, line in cases:
        validate_schema(
            parse_schema(line), path=name
        )  # raises on a rejection, naming the case


def test_every_invalid_walle_schema_is_rejected_with_its_expected_error(walle_dir):
    cases = list(_cases(walle_dir, "invalid"))
    assert len(cases) == 182
    for name, line in cases:
        case = json.loads(line)
        with pytest.raises(ToolSchemaError) as info:
            validate_schema(parse_schema(case["schema"]))
        assert case["expect"].lower() in str(info.value).lower(), (
            name,
            case["expect"],
            str(info.value),
        )
        assert info.value.unparsable == case["unmarshal"], (name, str(info.value))


def test_errors_name_the_offending_subschema():
    schema = {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"age": {"type": "integer", "minimum": 1.5}},
            }
        },
    }
    with pytest.raises(
        ToolSchemaError,
        match=r"^tools\[2\]\.function\.parameters\.properties\.user\.properties\.age: "
        r"minimum 1\.5 is not a valid integer",
    ):
        validate_schema(schema, path="tools[2].function.parameters")


def test_limits_are_configurable_and_checked():
    deep = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "string"}}}
        },
    }
    validate_schema(deep)
    with pytest.raises(ToolSchemaError, match="depth exceeds maximum limit of 1"):
        validate_schema(deep, limits=SchemaLimits(max_depth=1))
    with pytest.raises(ValueError, match="SchemaLimits.max_depth must be an int >= 1"):
        SchemaLimits(max_depth=0)


def test_tools_and_tool_choice_errors():
    ok = {
        "type": "function",
        "function": {"name": "ls", "parameters": {"type": "object"}},
    }
    assert [s.name for s in normalize_tools([ok])] == ["ls"]
    with pytest.raises(
        ValueError, match=r"tools\[1\]\.function\.name: duplicate tool name 'ls'"
    ):
        normalize_tools([ok, ok])
    with pytest.raises(
        ValueError, match=r"tools\[0\]\.function\.name: expected 1-64 characters"
    ):
        normalize_tools([{"type": "function", "function": {"name": "a b"}}])
    with pytest.raises(
        ToolSchemaError,
        match=r"tools\[0\]\.function\.parameters: unsupported keywords: oneOf",
    ):
        normalize_tools(
            [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"oneOf": []}},
                }
            ]
        )
    specs = normalize_tools([ok])
    assert (
        normalize_tool_choice({"type": "function", "function": {"name": "ls"}}, specs)
        == "ls"
    )
    with pytest.raises(
        ValueError, match="tool_choice: function 'rm' is not among the declared tools"
    ):
        normalize_tool_choice({"type": "function", "function": {"name": "rm"}}, specs)
    with pytest.raises(ValueError, match="tool_choice: expected one of"):
        normalize_tool_choice("always", specs)
    with pytest.raises(ValueError, match="'required' needs at least one tool"):
        normalize_tool_choice("required", ())


@pytest.mark.parametrize("wrap", [lambda d: {"type": "array", "items": d}, lambda d: {"anyOf": [d, {"type": "null"}]}])
def test_schemas_nested_deeper_than_the_stack_are_a_value_error_naming_the_tool(wrap):
    from kvtier.serve import SamplingParams

    d = {"type": "string"}
    for _ in range(1500):
        d = wrap(d)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": d}}}}
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        SamplingParams(tools=[tool])


def _string_tool(pattern: str) -> dict:
    params = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}, "required": ["s"]}
    return {"type": "function", "function": {"name": "f", "parameters": params}}


@pytest.mark.parametrize(
    "pattern, reason",
    [
        ("(", "unclosed group"),
        ("[a-", "unclosed character class"),
        ("a{2,1}", "invalid repetition count range"),
        # Valid for Python's re, but not for llguidance, which compiles the grammar:
        ("(?=a)a", "look-around"),
        (r"(a)\1", "backreferences are not supported"),
        (r"\bfoo", "lookarounds not supported"),
        ("a$b", "lookarounds not supported"),
    ],
)
def test_a_pattern_llguidance_cannot_compile_is_a_schema_error_naming_its_path(pattern, reason):
    subschema = {"type": "string", "pattern": pattern}
    schema = {
        "type": "object",
        "properties": {"a": {"type": "array", "items": {"anyOf": [{"type": "null"}, subschema]}}},
        "$defs": {"d": subschema},
    }
    with pytest.raises(ToolSchemaError) as info:
        validate_schema(schema, path="tools[0].function.parameters")
    assert str(info.value).startswith(
        f"tools[0].function.parameters.$defs.d: pattern {pattern!r} is not a valid regular expression: "
    )
    assert reason in str(info.value)
    del schema["$defs"]
    with pytest.raises(ToolSchemaError) as info:
        validate_schema(schema, path="tools[0].function.parameters")
    assert info.value.path == "tools[0].function.parameters.properties.a.items.anyOf[1]"
    assert reason in str(info.value)


def test_a_long_bad_pattern_is_cut_in_the_message():
    with pytest.raises(ToolSchemaError, match="unclosed group") as info:
        validate_schema({"type": "string", "pattern": "(" + "a" * 500})
    assert len(str(info.value)) < 200


@pytest.mark.parametrize(
    "pattern",
    [
        "^[a-z]+$",
        r"\d{3}-\d{4}",
        "",
        # llguidance's dialect accepts these; Python's re does not:
        r"\p{L}+",
        "(?<word>[a-z]+)",
        "a**",
    ],
)
def test_patterns_llguidance_accepts_pass_and_compile(pattern, compiler):
    validate_schema({"type": "string", "pattern": pattern})
    validate_schema({"type": "string", "pattern": None})  # null stays allowed
    specs = normalize_tools([_string_tool(pattern)])
    assert compiler.compile(turn_grammar(specs, "required")).is_error() is False


def test_a_valid_pattern_no_string_matches_is_left_to_the_grammar(compiler):
    specs = normalize_tools([_string_tool(r"[^\s\S]")])  # valid regex, empty language
    with pytest.raises(GrammarError, match="does not compile"):
        compiler.compile(turn_grammar(specs, "required"))


def test_a_pattern_with_a_lone_surrogate_is_a_schema_error_naming_its_path():
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": "a\ud800"}}}
    with pytest.raises(ToolSchemaError) as info:
        validate_schema(schema, path="tools[0].function.parameters")
    assert info.value.path == "tools[0].function.parameters.properties.s"
    assert "is not a valid regular expression" in str(info.value)
