"""Bad input to K3's renderer: each is a ValueError that names the field and says what was
expected (the server answers it as a 400 with that field)."""

import pytest

from kvtier.tokenize.xtml import XtmlOptions, render_xtml_parts

BASH = {"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}
HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("options, field", [
    ({"thinking": "yes"}, "thinking"),
    ({"thinking_effort": "medium"}, "thinking_effort"),
    ({"tool_choice": "any"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": ""}}}, "tool_choice.function.name"),
    ({"tool_choice": {"type": "tool", "name": "bash"}}, "tool_choice"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": []}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict"),
])
def test_options_name_the_field(options, field):
    with pytest.raises(ValueError, match=rf"^{field.replace('.', '[.]')}: "):
        XtmlOptions(**options)


@pytest.mark.parametrize("messages, tools, field", [
    ([], None, "messages"),
    (["hi"], None, r"messages\[0\]"),
    ([{"role": "developer", "content": "x"}], None, r"messages\[0\]\.role"),
    ([{"role": "user", "content": 3}], None, r"messages\[0\]\.content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], None, r"messages\[0\]\.content\[0\]"),
    ([{"role": "user", "name": 5, "content": "x"}], None, r"messages\[0\]\.name"),
    ([{"role": "user", "content": "", "tools": [BASH]}], None, r"messages\[0\]\.tools"),
    ([{"role": "assistant", "content": "", "tools": [BASH]}], None, r"messages\[0\]\.tools"),
    ([{"role": "system", "content": "also text", "tools": [BASH]}], None, r"messages\[0\]\.tools"),
    ([{"role": "system", "tools": []}], None, r"messages\[0\]\.tools"),
    ([{"role": "system", "tools": [BASH]}], [BASH], r"messages\[0\]\.tools\[0\]\.function\.name"),
    (HI, [], "tools"),
    (HI, [{"type": "retrieval"}], r"tools\[0\]\.type"),
    (HI, [{"type": "function"}], r"tools\[0\]\.function"),
    (HI, [{"type": "function", "function": {"name": "has space"}}], r"tools\[0\]\.function\.name"),
    (HI, [{"type": "function", "function": {"name": "x" * 65}}], r"tools\[0\]\.function\.name"),
    (HI, [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
     r"tools\[0\]\.function\.parameters"),
    (HI, [{"type": "function", "function": {"name": "f", "description": 1}}], r"tools\[0\]\.function\.description"),
    (HI, [BASH, BASH], r"tools\[1\]\.function\.name"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"id": "a", "function": {"name": "bash",
                                                                                     "arguments": "[1, 2]"}}]}],
     None, r"messages\[0\]\.tool_calls\[0\]\.function\.arguments"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"id": "a", "function": {"arguments": "{}"}}]}],
     None, r"messages\[0\]\.tool_calls\[0\]\.function"),
    ([{"role": "assistant", "content": "", "tool_calls": "bash"}], None, r"messages\[0\]\.tool_calls"),
    ([{"role": "assistant", "content": "", "reasoning_content": 7}], None, r"messages\[0\]\.reasoning_content"),
    ([{"role": "tool", "tool_call_id": "x", "content": "r"}], None, r"messages\[0\]\.tool_call_id"),
    ([{"role": "tool", "tool_call_id": "x", "content": "r"},
      {"role": "assistant", "content": "", "tool_calls": [{"id": "a", "function": {"name": "bash"}}]}], None,
     r"messages\[0\]\.tool_call_id"),
], ids=["no-messages", "not-a-dict", "unknown-role", "content-type", "image-part", "name-type", "tools-on-user",
        "tools-on-assistant", "tools-beside-content", "empty-dynamic-tools", "dynamic-name-repeats-request",
        "empty-tools", "tool-type", "tool-without-function", "name-pattern", "name-too-long", "parameters-not-object",
        "description-type", "repeated-name", "arguments-not-object", "call-without-name", "tool-calls-type",
        "reasoning-type", "result-of-no-call", "result-before-any-call"])
def test_messages_and_tools_name_the_field(messages, tools, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        render_xtml_parts(messages, tools)


def test_required_tool_choice_needs_a_tool():
    with pytest.raises(ValueError, match=r"^tool_choice: 'required' needs tools"):
        render_xtml_parts(HI, None, XtmlOptions(tool_choice="required"))
    dynamic = [{"role": "system", "tools": [BASH]}, *HI]  # a dynamic declaration is a tool
    assert render_xtml_parts(dynamic, None, XtmlOptions(tool_choice="required")).tails
