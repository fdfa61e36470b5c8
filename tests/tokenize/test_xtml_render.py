"""K3's chat format (XTML), rule by rule: kvtier's rendering of each conversation equals the prompt
written out by hand in K3's format (docs/k3.md, "Chat format (XTML)"), as text and token for
token.

The expected ids are K3's tokenizer on the hand-written prompt (control tokens at their ids, the
text between them BPE-encoded), built without the renderer; one prompt is checked against K3's
published token ids (147 ids and their SHA-256) and the user-typed control spellings against a
piecewise encoding.
"""

import hashlib
import struct

import pytest

from kvtier.tokenize.xtml import XtmlOptions, encode_xtml, render_xtml_parts

# -- the format, written from K3.md ---------------------------------------------------------------------
GEN_THINK = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
GEN_RESPONSE = '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'


def M(attrs: str, body: str) -> str:
    return f"<|open|>message {attrs}<|sep|>{body}<|close|>message<|sep|><|end_of_msg|>"


def U(body: str) -> str:
    return M('role="user"', body)


def A(body: str) -> str:
    return M('role="assistant"', body)


def THINK(text: str) -> str:
    return f"<|open|>think<|sep|>{text}<|close|>think<|sep|>"


def RESP(text: str) -> str:
    return f"<|open|>response<|sep|>{text}<|close|>response<|sep|>"


def CALLS(*calls: str) -> str:
    return "<|open|>tools<|sep|>" + "".join(calls) + "<|close|>tools<|sep|>"


def CALL(name: str, index: int, body: str) -> str:
    return f'<|open|>call tool="{name}" index="{index}"<|sep|>{body}<|close|>call<|sep|>'


def ARG(key: str, kind: str, value: str) -> str:
    return f'<|open|>argument key="{key}" type="{kind}"<|sep|>{value}<|close|>argument<|sep|>'


def TOOL(name: str, index: int, body: str) -> str:
    return M(f'role="tool" tool="{name}" index="{index}"', body)


def SYS(kind: str, body: str) -> str:
    return M(f'role="system" type="{kind}"', body)


def DECLARE(tools_json: str) -> str:
    return SYS("tool-declare", "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
               + tools_json + "\n```")


def DYNAMIC(tools_json: str) -> str:
    return SYS("tool-declare", "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
               "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n"
               "```json\n" + tools_json + "\n```")


def EFFORT(effort: str) -> str:
    return SYS("thinking-effort", "`thinking_effort` guides on how much to think in your thinking channel (not "
               "including the response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
               f"Now the system is invoked with `thinking_effort={effort}`.")


CHOICE_REQUIRED = SYS("tool-choice", "The system is invoked with `tool_choice=required`.\n"
                      "You MUST call tools in the next message.")
CHOICE_NONE = SYS("tool-choice", "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the "
                  "next message.")
RAW = "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting."
FORMAT_OBJECT = SYS("response-format", "The system is invoked with `response_format=json_object`.\n" + RAW)


def FORMAT_SCHEMA(schema_json: str) -> str:
    return SYS("response-format", "The system is invoked with `response_format=json_schema`.\n" + RAW
               + "\nThe JSON data must match the following schema:\n```json\n" + schema_json + "\n```")


# -- tools, written out by hand -------------------------------------------------------------------------
BASH = {"type": "function", "function": {"name": "bash", "description": "Run a shell command",
                                         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                                                        "required": ["cmd"]}}}
BASH_JSON = ('{"function":{"description":"Run a shell command","name":"bash","parameters":{"properties":{"cmd":'
             '{"type":"string"}},"required":["cmd"],"type":"object"}},"type":"function"}')
READ = {"type": "function", "function": {"name": "read_file", "description": "读取文件 — “quoted”",
                                         "parameters": {"type": "object", "required": ["path"],
                                                        "properties": {"path": {"type": "string"},
                                                                       "limit": {"type": "integer"}}}}}
READ_JSON = ('{"function":{"description":"读取文件 — “quoted”","name":"read_file","parameters":{"properties":'
             '{"limit":{"type":"integer"},"path":{"type":"string"}},"required":["path"],"type":"object"}},'
             '"type":"function"}')
GREP = {"type": "function", "function": {"name": "grep", "parameters": {"type": "object", "properties": {}}}}
GREP_JSON = '{"function":{"name":"grep","parameters":{"properties":{},"type":"object"}},"type":"function"}'


def call(call_id: str, name: str, arguments) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def result(call_id: str, content: str, **extra) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": content, **extra}


HI = [{"role": "user", "content": "hi"}]


def check(k3_tok, messages, expected: str, tools=None, add_generation_prompt: bool = True, **options) -> None:
    """kvtier's rendering equals ``expected`` as text and token for token."""
    opts = XtmlOptions(**options)
    parts = render_xtml_parts(messages, tools, opts, add_generation_prompt)
    assert parts.text() == expected
    assert encode_xtml(k3_tok, messages, tools, opts, add_generation_prompt) == k3_tok.encode(expected)


# -- one test per rule ----------------------------------------------------------------------------------
def test_published_k3_token_ids(k3_tok):
    """K3's renderer and tokenizer give this prompt in 147 ids (published with their SHA-256)."""
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Get current weather for a location",
        "parameters": {"type": "object", "properties": {"location": {"type": "string", "description": "City name"}},
                       "required": ["location"]}}}]
    messages = [{"role": "user", "content": "What's the weather in San Francisco?"}]
    opts = XtmlOptions(thinking=False, tool_choice="required")
    text = render_xtml_parts(messages, tools, opts).text()
    text_sha = "fa05c4fc98a796f387838fdef2aef89aaa5805ca2bbb1c7101ed428f80439d14"
    assert hashlib.sha256(text.encode()).hexdigest() == text_sha
    ids = encode_xtml(k3_tok, messages, tools, opts)
    packed = b"".join(struct.pack("<i", i) for i in ids)
    assert len(ids) == 147
    assert hashlib.sha256(packed).hexdigest() == "f1ed3971af8259f3b9241d92404ec8d45f34137dec027fd96bc8d23b91b9773c"


@pytest.mark.parametrize("messages, thinking, expected", [
    (HI, True, U("hi") + GEN_THINK),
    (HI, False, U("hi") + GEN_RESPONSE),
    ([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}], False,
     M('role="system"', "Be terse.") + U("2+2?") + GEN_RESPONSE),
    ([{"role": "user", "content": "  padded \n"}], True, U("  padded \n") + GEN_THINK),
    ([{"role": "user", "content": ""}], False, U("") + GEN_RESPONSE),
], ids=["user-think", "user-response", "system-user", "whitespace-kept", "empty-content"])
def test_user_and_system_messages(k3_tok, messages, thinking, expected):
    check(k3_tok, messages, expected, thinking=thinking)


@pytest.mark.parametrize("messages, expected", [
    ([{"role": "user", "name": "alice", "content": "hey"}], M('role="user" name="alice"', "hey")),
    ([{"role": "user", "name": 'a"b&c', "content": 'say "x" & <y>'}],
     M('role="user" name="a&quot;b&amp;c"', 'say "x" & <y>')),
    ([{"role": "system", "name": "&quot;", "content": "&amp;"}], M('role="system" name="&amp;quot;"', "&amp;")),
], ids=["name", "escaped-name-raw-body", "escape-ampersand-first"])
def test_attributes_are_escaped_and_bodies_are_not(k3_tok, messages, expected):
    check(k3_tok, messages, expected + GEN_RESPONSE, thinking=False)


@pytest.mark.parametrize("tools, tools_json", [
    ([BASH], f"[{BASH_JSON}]"),
    ([READ, BASH], f"[{READ_JSON},{BASH_JSON}]"),
    ([GREP], f"[{GREP_JSON}]"),
], ids=["one", "two-in-order-non-ascii", "empty-properties"])
def test_tool_declaration_is_deep_sorted_compact_json(k3_tok, tools, tools_json):
    check(k3_tok, HI, DECLARE(tools_json) + U("hi") + GEN_THINK, tools=tools)


@pytest.mark.parametrize("effort", ["low", "high", "max"])
def test_thinking_effort_message_follows_the_tools(k3_tok, effort):
    check(k3_tok, HI, DECLARE(f"[{BASH_JSON}]") + EFFORT(effort) + U("hi") + GEN_THINK, tools=[BASH],
          thinking_effort=effort)


def test_thinking_effort_without_thinking_renders_nothing(k3_tok):
    check(k3_tok, HI, U("hi") + GEN_RESPONSE, thinking=False, thinking_effort="max")


@pytest.mark.parametrize("turn, thinking, expected", [
    ({"role": "assistant", "content": "hello"}, False, A(RESP("hello"))),
    ({"role": "assistant", "content": "hello", "reasoning_content": "They greet."}, True,
     A(THINK("They greet.") + RESP("hello"))),
    ({"role": "assistant", "content": "hello"}, True, A(THINK("") + RESP("hello"))),
    ({"role": "assistant", "content": "hello", "reasoning_content": " \n "}, True, A(THINK("") + RESP("hello"))),
    ({"role": "assistant", "content": "hello", "reasoning_content": "dropped"}, False, A(RESP("hello"))),
    ({"role": "assistant", "content": None, "reasoning_content": "\nkeep  raw\n"}, True,
     A(THINK("\nkeep  raw\n") + RESP(""))),
], ids=["response-only", "reasoning-kept", "no-reasoning-empty-think", "blank-reasoning", "no-think-channel",
        "reasoning-not-stripped"])
def test_assistant_channels_and_reasoning_history(k3_tok, turn, thinking, expected):
    messages = [{"role": "user", "content": "hi"}, turn, {"role": "user", "content": "again"}]
    check(k3_tok, messages, U("hi") + expected + U("again") + (GEN_THINK if thinking else GEN_RESPONSE),
          thinking=thinking)


@pytest.mark.parametrize("arguments, rendered", [
    ('{"cmd": "ls -la"}', ARG("cmd", "string", "ls -la")),
    ({"n": 3, "x": 2.5, "neg": -1}, ARG("n", "number", "3") + ARG("x", "number", "2.5") + ARG("neg", "number", "-1")),
    ({"flag": True, "off": False, "none": None},
     ARG("flag", "boolean", "true") + ARG("off", "boolean", "false") + ARG("none", "null", "null")),
    ('{"obj": {"b": 1, "a": [1, "é"]}}', ARG("obj", "object", '{"b": 1, "a": [1, "é"]}')),
    ({"list": [1, {"k": "v"}], "empty": []}, ARG("list", "array", '[1, {"k": "v"}]') + ARG("empty", "array", "[]")),
    ({"s": "多行\n  \"quoted\" &amp;"}, ARG("s", "string", "多行\n  \"quoted\" &amp;")),
    ({'k"&': "v"}, ARG("k&quot;&amp;", "string", "v")),
], ids=["string-raw", "numbers", "booleans-null", "object-json-order-kept", "arrays", "string-not-escaped",
        "key-escaped"])
def test_tool_call_arguments_are_typed(k3_tok, arguments, rendered):
    messages = [{"role": "user", "content": "go"},
                {"role": "assistant", "content": "", "tool_calls": [call("c1", "bash", arguments)]}]
    check(k3_tok, messages, U("go") + A(RESP("") + CALLS(CALL("bash", 1, rendered))), thinking=False,
          add_generation_prompt=False)


@pytest.mark.parametrize("arguments, rendered", [
    ('{"cmd": "ls"', '<|open|>json type="object"<|sep|>{"cmd": "ls"<|close|>json<|sep|>'),
    ("not json at all", '<|open|>json type="object"<|sep|>not json at all<|close|>json<|sep|>'),
    ("", ""),
    ("   ", ""),
    (None, ""),
    ({}, ""),
], ids=["truncated-json", "free-text", "empty-string", "blank-string", "none", "empty-dict"])
def test_unparseable_and_empty_arguments(k3_tok, arguments, rendered):
    messages = [{"role": "user", "content": "go"},
                {"role": "assistant", "content": "ok", "tool_calls": [call("c1", "bash", arguments)]}]
    check(k3_tok, messages, U("go") + A(RESP("ok") + CALLS(CALL("bash", 1, rendered))) + GEN_RESPONSE,
          thinking=False)


def test_parallel_calls_with_results_sent_back_out_of_order(k3_tok):
    messages = [{"role": "user", "content": "both"},
                {"role": "assistant", "content": "", "reasoning_content": "two reads",
                 "tool_calls": [call("a", "read_file", {"path": "x.py"}), call("b", "bash", {"cmd": "pwd"}),
                                call("c", "read_file", {"path": "y.py"})]},
                result("c", "Y"), result("a", "X"), result("b", "/repo")]
    expected = (U("both") + A(THINK("two reads") + RESP("") + CALLS(
        CALL("read_file", 1, ARG("path", "string", "x.py")), CALL("bash", 2, ARG("cmd", "string", "pwd")),
        CALL("read_file", 3, ARG("path", "string", "y.py"))))
        + TOOL("read_file", 1, "X") + TOOL("bash", 2, "/repo") + TOOL("read_file", 3, "Y") + GEN_THINK)
    check(k3_tok, messages, expected)


def test_results_keep_their_order_when_an_id_does_not_resolve(k3_tok):
    """The whole run stays as sent, and each result is named by its own ``name`` or else by the
    call at its position (K3's renderer: ids are not looked up once one fails)."""
    messages = [{"role": "user", "content": "both"},
                {"role": "assistant", "content": "", "tool_calls": [call("a", "read_file", {"path": "x"}),
                                                                   call("b", "bash", {"cmd": "pwd"})]},
                result("b", "/repo"), result("zzz", "X", name="grep")]
    expected = (U("both") + A(RESP("") + CALLS(CALL("read_file", 1, ARG("path", "string", "x")),
                                               CALL("bash", 2, ARG("cmd", "string", "pwd"))))
                + TOOL("read_file", 1, "/repo") + TOOL("grep", 2, "X") + GEN_RESPONSE)
    check(k3_tok, messages, expected, thinking=False)


def test_result_without_resolvable_id_takes_the_call_at_its_position(k3_tok):
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "", "tool_calls": [call("a", "grep", {}), call("b", "bash", {})]},
                result("a", "1"), result("nope", "2")]
    expected = (U("q") + A(RESP("") + CALLS(CALL("grep", 1, ""), CALL("bash", 2, "")))
                + TOOL("grep", 1, "1") + TOOL("bash", 2, "2") + GEN_RESPONSE)
    check(k3_tok, messages, expected, thinking=False)


def test_result_index_restarts_after_each_assistant_turn(k3_tok):
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "", "tool_calls": [call("a", "bash", {"cmd": "ls"})]},
                result("a", "f"),
                {"role": "assistant", "content": "", "tool_calls": [call("b", "bash", {"cmd": "pwd"})]},
                result("b", "/"),
                {"role": "assistant", "content": "done"}]
    expected = (U("q") + A(RESP("") + CALLS(CALL("bash", 1, ARG("cmd", "string", "ls")))) + TOOL("bash", 1, "f")
                + A(RESP("") + CALLS(CALL("bash", 1, ARG("cmd", "string", "pwd")))) + TOOL("bash", 1, "/")
                + A(RESP("done")))
    check(k3_tok, messages, expected, thinking=False, add_generation_prompt=False)


def test_dynamic_tools_declared_in_a_system_message(k3_tok):
    messages = [{"role": "user", "content": "load grep"},
                {"role": "system", "content": "", "tools": [GREP]},
                {"role": "user", "content": "now grep"}]
    expected = DECLARE(f"[{BASH_JSON}]") + U("load grep") + DYNAMIC(f"[{GREP_JSON}]") + U("now grep") + GEN_THINK
    check(k3_tok, messages, expected, tools=[BASH])


def test_dynamic_tools_without_request_tools(k3_tok):
    messages = [{"role": "system", "tools": [READ, GREP]}, {"role": "user", "content": "x"}]
    check(k3_tok, messages, DYNAMIC(f"[{READ_JSON},{GREP_JSON}]") + U("x") + GEN_RESPONSE, thinking=False)


@pytest.mark.parametrize("choice, tail", [("required", CHOICE_REQUIRED), ("none", CHOICE_NONE), ("auto", ""),
                                          ({"type": "function", "function": {"name": "bash"}}, "")],
                         ids=["required", "none", "auto", "named"])
def test_tool_choice_tail(k3_tok, choice, tail):
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                {"role": "user", "content": "q2"}]
    expected = DECLARE(f"[{BASH_JSON}]") + U("q") + A(THINK("") + RESP("a")) + U("q2") + tail + GEN_THINK
    check(k3_tok, messages, expected, tools=[BASH], tool_choice=choice)


@pytest.mark.parametrize("response_format, tail", [
    ({"type": "json_object"}, FORMAT_OBJECT),
    ({"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": {
        "type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}, "a": {"type": "string"}}}}},
     FORMAT_SCHEMA('{"properties":{"a":{"type":"string"},"n":{"type":"integer"}},"required":["n"],"type":"object"}')),
    ({"type": "json_schema", "json_schema": {"name": "名前", "schema": {"description": "数"}}},
     FORMAT_SCHEMA('{"description":"数"}')),
    ({"type": "text"}, ""),
], ids=["json-object", "json-schema-sorted", "json-schema-non-ascii", "text"])
def test_response_format_tail(k3_tok, response_format, tail):
    check(k3_tok, HI, U("hi") + tail + GEN_RESPONSE, thinking=False, response_format=response_format)


def test_tool_choice_tail_comes_before_response_format_tail(k3_tok):
    check(k3_tok, HI, DECLARE(f"[{BASH_JSON}]") + EFFORT("low") + U("hi") + CHOICE_NONE + FORMAT_OBJECT + GEN_THINK,
          tools=[BASH], tool_choice="none", response_format={"type": "json_object"}, thinking_effort="low")


@pytest.mark.parametrize("thinking", [True, False])
def test_no_generation_prompt(k3_tok, thinking):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "reasoning_content": "r"}]
    body = (THINK("r") if thinking else "") + RESP("yo")
    check(k3_tok, messages, U("hi") + A(body), thinking=thinking, add_generation_prompt=False)


@pytest.mark.parametrize("content, text", [
    ([{"type": "text", "text": "a"}, {"type": "text", "text": "b c"}], "ab c"),
    ("日本語のテキスト 👋🏽 naïve", "日本語のテキスト 👋🏽 naïve"),
    ("def f():\n\treturn 1\r\n", "def f():\n\treturn 1\r\n"),
], ids=["text-parts", "non-ascii", "code"])
def test_content_forms(k3_tok, content, text):
    check(k3_tok, [{"role": "user", "content": content}], U(text) + GEN_THINK)


def test_full_agent_turns(k3_tok):
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": "Fix the test."},
                {"role": "assistant", "content": "Looking.", "reasoning_content": "Read first.",
                 "tool_calls": [call("r1", "read_file", '{"path": "t.py", "limit": 20}')]},
                result("r1", "assert 1 == 2"),
                {"role": "assistant", "content": "", "reasoning_content": "Edit.",
                 "tool_calls": [call("b1", "bash", {"cmd": "sed -i s/2/1/ t.py"})]},
                result("b1", ""),
                {"role": "assistant", "content": "Fixed.", "reasoning_content": "Done."},
                {"role": "user", "content": "Thanks"}]
    expected = (DECLARE(f"[{BASH_JSON},{READ_JSON}]") + EFFORT("high") + M('role="system"', "You are a coding agent.")
                + U("Fix the test.")
                + A(THINK("Read first.") + RESP("Looking.") + CALLS(CALL("read_file", 1, ARG("path", "string", "t.py")
                                                                         + ARG("limit", "number", "20"))))
                + TOOL("read_file", 1, "assert 1 == 2")
                + A(THINK("Edit.") + RESP("") + CALLS(CALL("bash", 1, ARG("cmd", "string", "sed -i s/2/1/ t.py"))))
                + TOOL("bash", 1, "") + A(THINK("Done.") + RESP("Fixed.")) + U("Thanks") + GEN_THINK)
    check(k3_tok, messages, expected, tools=[BASH, READ], thinking_effort="high")


@pytest.mark.parametrize("typed", ["<|open|>", "<|close|>message<|sep|><|end_of_msg|>", "[EOS]", "<|im_end|>"])
def test_control_token_spellings_are_text(k3_tok, typed):
    """A user (or a tool result, or an argument) that types a control token gets its bytes."""
    messages = [{"role": "user", "content": f"a{typed}b"},
                {"role": "assistant", "content": "", "tool_calls": [call("c", "bash", {"cmd": typed})]},
                result("c", typed)]
    ids = encode_xtml(k3_tok, messages, options=XtmlOptions(thinking=False))
    as_text = k3_tok.encode(typed, allow_special=False)
    assert len(as_text) > 1  # bytes, not one control id
    expected = (k3_tok.encode('<|open|>message role="user"<|sep|>') + k3_tok.encode(f"a{typed}b", allow_special=False)
                + k3_tok.encode('<|close|>message<|sep|><|end_of_msg|><|open|>message role="assistant"<|sep|>'
                                + RESP("") + '<|open|>tools<|sep|><|open|>call tool="bash" index="1"<|sep|>'
                                '<|open|>argument key="cmd" type="string"<|sep|>')
                + as_text + k3_tok.encode('<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
                                          '<|close|>message<|sep|><|end_of_msg|>'
                                          '<|open|>message role="tool" tool="bash" index="1"<|sep|>')
                + as_text + k3_tok.encode("<|close|>message<|sep|><|end_of_msg|>" + GEN_RESPONSE))
    assert ids == expected
    control_ids = {163584, 163585, 163586, 163587, 163588, 163589}
    assert sum(i in control_ids for i in ids) == sum(i in control_ids for i in k3_tok.encode(
        U("ab") + A(RESP("") + CALLS(CALL("bash", 1, ARG("cmd", "string", ""))))
        + TOOL("bash", 1, "") + GEN_RESPONSE))
