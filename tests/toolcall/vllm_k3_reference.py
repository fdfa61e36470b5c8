"""vLLM 0.32's Kimi K3 parsers as a reference: run in the vLLM venv (``.vllm-venv/bin/python``),
JSON cases on stdin, JSON results on stdout (one per case, in order).

A case is ``{"text": OUTPUT, "thinking": bool, "chunks": [int, ...]}``: the model's output after
the generation prompt (which opened ``think`` when ``thinking``, else ``response``) and the cut
points of a streamed run. A result is ``{"calls": [[name, arguments]], "content": str | None,
"stream_calls": [[name, arguments]]}``: ``KimiK3ReasoningParser.extract_reasoning`` splits off
the think channel, then ``KimiK3ToolParser.extract_tool_calls`` reads the rest, and the streamed
calls come from ``extract_tool_calls_streaming`` fed the rest in the given chunks.
"""

import json
import sys
from types import SimpleNamespace

from vllm.reasoning.kimi_k3_reasoning_parser import KimiK3ReasoningParser
from vllm.tool_parsers.kimi_k3_tool_parser import KimiK3ToolParser


class _Tokenizer:
    """What the parsers' constructors read of a tokenizer (these parsers work on text)."""

    def encode(self, text, add_special_tokens=False):
        return [len(part) for part in text.split("|")]

    def get_vocab(self):
        return {}


def _one(case: dict) -> dict:
    request = SimpleNamespace(tools=[{"type": "function"}], tool_choice="auto")
    text = case["text"]
    if case["thinking"]:
        _, rest = KimiK3ReasoningParser(_Tokenizer()).extract_reasoning(text, request)
        rest = rest or ""
    else:
        rest = text
    info = KimiK3ToolParser(_Tokenizer()).extract_tool_calls(rest, request)
    calls = [[c.function.name, c.function.arguments] for c in info.tool_calls]
    streamer = KimiK3ToolParser(_Tokenizer())
    stream_calls, previous = [], ""
    cuts = [c for c in case["chunks"] if 0 < c < len(rest)] + [len(rest)]
    start = 0
    for end in cuts:
        current = rest[:end]
        delta = streamer.extract_tool_calls_streaming(previous, current, rest[start:end], [], [], [], request)
        for d in (delta.tool_calls or []) if delta is not None else []:
            stream_calls.append([d.function.name, d.function.arguments])
        previous, start = current, end
    return {"calls": calls, "content": info.content, "stream_calls": stream_calls}


if __name__ == "__main__":
    json.dump([_one(c) for c in json.load(sys.stdin)], sys.stdout)
