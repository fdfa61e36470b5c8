"""render_chat: exact K2 template strings, the thinking variant, and errors that name the field."""

import pytest

from kvtier.tokenize import DEFAULT_SYSTEM, render_chat

SYS = f"<|im_system|>system<|im_middle|>{DEFAULT_SYSTEM}<|im_end|>"
GEN = "<|im_assistant|>assistant<|im_middle|>"
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "运行命令",
                                           "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]


def test_default_system_and_generation_prompt():
    assert render_chat([{"role": "user", "content": "hi"}]) == SYS + "<|im_user|>user<|im_middle|>hi<|im_end|>" + GEN
    assert render_chat([{"role": "system", "content": "S"}, {"role": "user", "content": ""}],
                       add_generation_prompt=False) == (
        "<|im_system|>system<|im_middle|>S<|im_end|><|im_user|>user<|im_middle|><|im_end|>")
    assert render_chat([]) == GEN


def test_tool_round_trip():
    msgs = [{"role": "user", "content": "ls", "name": "dev"},
            {"role": "assistant", "content": "Running.", "tool_calls": [
                {"id": "functions.bash:3", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}},
                {"type": "function", "function": {"name": "bash", "arguments": {"cmd": "pwd"}}}]},
            {"role": "tool", "tool_call_id": "functions.bash:3", "content": "a.py\nb.py", "name": "bash"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "x:1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    decl = ('<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"bash",'
            '"description":"运行命令","parameters":{"type":"object","properties":{"cmd":{"type":"string"}}}}}]<|im_end|>')
    assert render_chat(msgs, tools=TOOLS, add_generation_prompt=False) == (
        decl + SYS + "<|im_user|>dev<|im_middle|>ls<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>Running.<|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.bash:3<|tool_call_argument_begin|>{"cmd": "ls"}<|tool_call_end|>'
        '<|tool_call_begin|>functions.bash:1<|tool_call_argument_begin|>{"cmd": "pwd"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
        "<|im_system|>bash<|im_middle|>## Return of functions.bash:3\na.py\nb.py<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|><|tool_call_begin|>x:1"
        "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|><|im_end|>")


def test_thinking_drops_reasoning_before_last_final_answer():
    call = {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    msgs = [{"role": "user", "content": "q1"},
            {"role": "assistant", "content": "", "reasoning_content": "r1", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "functions.f:0", "content": "out"},
            {"role": "assistant", "content": "a1", "reasoning_content": "r2"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "", "reasoning_content": "r3", "tool_calls": [call]}]
    out = render_chat(msgs, thinking=True)
    assert "r1" not in out and "r2" not in out and "<think></think>a1" in out
    assert "<think>r3</think><|tool_calls_section_begin|>" in out
    assert render_chat(msgs[:3], thinking=True).count("<think>r1</think>") == 1  # no final answer yet


@pytest.mark.parametrize("msgs, match", [
    ([{"role": "robot", "content": "x"}], r"messages\[0\]\.role: unknown role 'robot'"),
    ([{"role": "user", "content": "x"}, {"role": "user", "content": 5}], r"messages\[1\]\.content: expected a string, got int"),
    ([{"role": "user"}], r"messages\[0\]\.content: missing"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], r"messages\[0\]\.content\[0\]"),
    ([{"role": "tool", "content": "x"}], r"messages\[0\]\.tool_call_id"),
    ([{"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "function": {"name": "f", "arguments": "{bad"}}]}], r"messages\[0\]\.tool_calls\[0\]\.function\.arguments: not valid JSON"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"id": "a"}]}], r"messages\[0\]\.tool_calls\[0\]\.function"),
    ([{"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "function": {"name": "f", "arguments": 3}}]}], r"arguments: expected a JSON object \(as a string or a dict\), got int"),
    (["hello"], r"messages\[0\]: expected a dict"),
])
def test_bad_input_names_index_and_field(msgs, match):
    with pytest.raises(ValueError, match=match):
        render_chat(msgs)


@pytest.mark.parametrize("arguments, got", [
    ("[1]", "array"), ("3", "number"), ("2.5", "number"), ('"x"', "string"), ("true", "boolean"), ("null", "null")])
def test_arguments_must_be_a_json_object(arguments, got):
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "a", "function": {"name": "f", "arguments": "{}"}},
                {"id": "b", "function": {"name": "f", "arguments": arguments}}]}]
    with pytest.raises(ValueError) as e:
        render_chat(msgs)
    assert str(e.value) == (
        f"messages[1].tool_calls[1].function.arguments: expected a JSON object, got a JSON {got}: {arguments!r}")


@pytest.mark.parametrize("arguments, message", [
    ("[" * 100_000, "JSON nested too deeply to read"),
    ({"s": {1, 2}}, "a dict that is not JSON: TypeError: Object of type set is not JSON serializable"),
    ('{"n": ' + "1" * 5000 + "}", "JSON that cannot be read: Exceeds the limit"),
])
def test_unreadable_arguments_are_value_errors(arguments, message):
    msgs = [{"role": "assistant", "content": "", "tool_calls": [{"id": "a", "function": {"name": "f",
                                                                                       "arguments": arguments}}]}]
    with pytest.raises(ValueError, match=f"messages\\[0\\].tool_calls\\[0\\].function.arguments: {message}"):
        render_chat(msgs, add_generation_prompt=False)


def test_object_arguments_as_text_or_dict():
    def rendered(arguments):
        msgs = [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "function": {"name": "f", "arguments": arguments}}]}]
        out = render_chat(msgs, add_generation_prompt=False)
        return out.split("<|tool_call_argument_begin|>")[1].split("<|tool_call_end|>")[0]

    assert rendered({"q": "東京", "n": [1, {"x": None}]}) == '{"q": "東京", "n": [1, {"x": null}]}'
    assert rendered({}) == "{}"
    assert rendered(' {"a":1} ') == ' {"a":1} '  # text is rendered as given


def test_content_parts_join():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert render_chat([{"role": "user", "content": parts}]) == render_chat([{"role": "user", "content": "ab"}])
