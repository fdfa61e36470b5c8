"""Each request through ``kvtier serve`` is parsed for tool calls once: by the engine's parser of
the request, whose events the chat, Messages and Responses APIs (streamed or not) consume. A spy
on :class:`kvtier.toolcall.ToolCallParser` counts the parsers built while one request runs."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.helpers.tool_schemas import LS, SEARCH

ASK = [{"role": "user", "content": "list the repository"}]
LS_SCHEMA = LS["function"]["parameters"]


@pytest.fixture(scope="module")
def url(tok_dir):
    """An in-process server on a free loopback port (its engine thread runs in this process, so
    the spy sees every parser it builds)."""
    import uvicorn

    from kvtier.serve.api.server import listen, make_app

    app = make_app("tiny", tokenizer=str(tok_dir), num_device_pages=256)
    sock = listen("127.0.0.1", 0)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        yield base
    finally:
        server.should_exit = True
        thread.join(30)


def _post(url: str, path: str, body: dict, stream: bool) -> str:
    """The whole response body (every SSE event when streamed), after checking the status."""
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": stream}, timeout=300) as r:
        text = r.read().decode()
        assert r.status_code == 200, text
    return text


def _sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


CHAT = "/v1/chat/completions"
TOOLS = dict(model="tiny", messages=ASK, tools=[SEARCH, LS], tool_choice="required", max_tokens=48, temperature=0,
             seed=3)
CASES = {
    "chat": (CHAT, dict(model="tiny", messages=ASK, max_tokens=8, temperature=0, ignore_eos=True)),
    "chat_tools": (CHAT, TOOLS),
    "chat_tools_cut": (CHAT, {**TOOLS, "max_tokens": 6}),  # ends inside a call: an incomplete problem
    "messages_tools": ("/v1/messages", dict(
        model="tiny", max_tokens=48, messages=[{"role": "user", "content": "list"}], temperature=0,
        tools=[{"name": "ls", "input_schema": LS_SCHEMA}], tool_choice={"type": "any"})),
    "responses_tools": ("/v1/responses", dict(
        model="tiny", input="list", max_output_tokens=48, temperature=0, tool_choice="required",
        tools=[{"type": "function", "name": "ls", "parameters": LS_SCHEMA}])),
    "completion": ("/v1/completions", dict(model="tiny", prompt="hello", max_tokens=8, temperature=0,
                                           ignore_eos=True)),
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("case", list(CASES))
def test_one_parser_per_request(url, tool_call_parsers, case, stream):
    path, body = CASES[case]
    text = _post(url, path, body, stream)
    assert len(tool_call_parsers) == 1, f"{case}: {len(tool_call_parsers)} parsers for one request"
    if case in ("chat_tools", "messages_tools", "responses_tools"):  # the one parser's calls reached the client
        assert ("functions.ls:" in text) or ("functions.search:" in text), text[:2000]
    if case == "chat_tools_cut" and not stream:
        assert json.loads(text)["choices"][0]["tool_call_problems"][0]["kind"] == "incomplete"


def test_a_stop_string_cut_is_parsed_once(url, tool_call_parsers):
    body = dict(model="tiny", messages=ASK, max_tokens=24, temperature=0, ignore_eos=True)
    content = json.loads(_post(url, CHAT, body, False))["choices"][0]["message"]["content"]
    assert len(content) >= 8 and len(tool_call_parsers) == 1
    tool_call_parsers.clear()
    stop = content[4:7]
    events = _sse(_post(url, CHAT, {**body, "stop": [stop]}, True))
    streamed = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert streamed == content[:content.index(stop)] and events[-1]["choices"][0]["finish_reason"] == "stop"
    assert len(tool_call_parsers) == 1


def test_streamed_tool_calls_equal_the_whole_answer(url, tool_call_parsers):
    whole = json.loads(_post(url, CHAT, TOOLS, False))["choices"][0]
    calls = {}
    for e in _sse(_post(url, CHAT, TOOLS, True)):
        for c in e["choices"]:
            for tc in c["delta"].get("tool_calls") or []:
                calls[tc["index"]] = {"id": tc["id"], "name": tc["function"]["name"],
                                      "arguments": tc["function"]["arguments"]}
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["tool_calls"]
    assert [calls[i] for i in sorted(calls)] == [
        {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in whole["message"]["tool_calls"]]
    assert len(tool_call_parsers) == 2  # one per request
