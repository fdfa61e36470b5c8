"""A small tool-calling conversation and its tools, for the bench trace tests."""

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a command", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}}]
CALL = {"id": "functions.bash:0", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}
CONVERSATION = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "List the files, then explain 缓存."},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "functions.bash:0", "content": "src/\ntests/\nREADME.md\n" * 20},
    {"role": "assistant", "content": "There are three entries. 缓存 means cache."},
    {"role": "user", "content": "Thanks!"},
]
