"""Anthropic Messages answers built from the chat path's :class:`Delta` / :class:`Final` events:
the message body and the stream of server-sent events.

Stream order (Anthropic's): ``message_start`` (input tokens known so far), ``ping``, then per
content block ``content_block_start`` / ``content_block_delta`` (``thinking_delta``,
``text_delta``, ``input_json_delta``) / ``content_block_stop``, then ``message_delta`` (stop
reason and the final usage) and ``message_stop``. A ``tool_use`` block is sent whole (start, its
complete input as one ``input_json_delta``, stop) as soon as the model closes the call.

Usage: ``input_tokens`` counts the prompt tokens not read from kvtier's cache,
``cache_read_input_tokens`` those read from it (device, host or disk tier), so their sum is the
prompt (Anthropic's convention); ``cache_creation_input_tokens`` is 0 (every full page is cached
without being asked).
"""

from __future__ import annotations

import json
import uuid

from kvtier.serve.api.jobs import Delta, Final
from kvtier.serve.api.messages import MessagesRequest, error_body, rename_fields, to_chat
from kvtier.serve.api.protocol import ApiError, ChatRequest, parse

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def event(name: str, data: dict) -> bytes:
    """One server-sent event with an ``event:`` line (Anthropic's framing)."""
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def usage(f: Final) -> dict:
    return {"input_tokens": f.prompt_tokens - f.cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": f.cached_tokens, "output_tokens": f.completion_tokens}


def stop_reason(f: Final) -> str:
    return "stop_sequence" if f.stop_sequence is not None else STOP_REASONS.get(f.finish_reason, "end_turn")


def tool_use(c: dict) -> dict:
    """A parsed call as a ``tool_use`` block (arguments are a JSON object: the grammar and the
    parser see to it)."""
    return {"type": "tool_use", "id": c["id"], "name": c["name"], "input": json.loads(c["arguments"])}


def message(rid: str, model: str, f: Final) -> dict:
    content = []
    if f.reasoning:
        content.append({"type": "thinking", "thinking": f.reasoning, "signature": ""})
    if f.content:
        content.append({"type": "text", "text": f.content})
    content.extend(tool_use(c) for c in f.tool_calls)
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason(f), "stop_sequence": f.stop_sequence, "usage": usage(f)}


class MessagesWriter:
    """The event stream of one request; tracks the open content block."""

    def __init__(self, rid: str, model: str, prompt_tokens: int):
        self.rid, self.model, self.prompt_tokens = rid, model, prompt_tokens
        self.index = -1  # the last block's index
        self.open: str | None = None  # the open block's type ("thinking" or "text"), None: none open

    def first(self) -> bytes:
        start = {"id": self.rid, "type": "message", "role": "assistant", "model": self.model, "content": [],
                 "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": self.prompt_tokens, "cache_creation_input_tokens": 0,
                           "cache_read_input_tokens": 0, "output_tokens": 0}}
        return event("message_start", {"type": "message_start", "message": start}) + \
            event("ping", {"type": "ping"})

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _start(self, block: dict) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        return out + [event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                    "content_block": block})]

    def _text(self, kind: str, text: str) -> list[bytes]:
        out = [] if self.open == kind else self._start(
            {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""})
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta", "text": text}
        return out + [event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})]

    def delta(self, d: Delta, logprobs: bool = False) -> list[bytes]:
        out = []
        if d.reasoning:
            out += self._text("thinking", d.reasoning)
        if d.text:
            out += self._text("text", d.text)
        for c in d.tool_calls:
            out += self._start({"type": "tool_use", "id": c["id"], "name": c["name"], "input": {}})
            out.append(event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                     "delta": {"type": "input_json_delta",
                                                               "partial_json": c["arguments"]}}))
            out += self._close()
        return out

    def final(self, f: Final) -> list[bytes]:
        return self._close() + [
            event("message_delta", {"type": "message_delta",
                                    "delta": {"stop_reason": stop_reason(f), "stop_sequence": f.stop_sequence},
                                    "usage": usage(f)}),
            event("message_stop", {"type": "message_stop"})]

    def error(self, err) -> list[bytes]:
        return [event("error", error_body(err))]

    def end(self) -> bytes:
        return b""


def prepare(body, header: str | None):
    """A request body as (chat request, sampling parameters, session id, format).

    Raises:
        ApiError: 400 naming the field.
    """
    m = parse(MessagesRequest, body)
    req = parse(ChatRequest, to_chat(m))
    try:
        params = req.params()
    except ApiError as e:
        raise rename_fields(e) from None
    return req, params, m.session(header), MessagesFormat()


class MessagesFormat:
    """The Messages API's answers for ``app._serve`` (see :class:`kvtier.serve.api.chat_completions.OpenAIFormat`)."""

    rename = staticmethod(rename_fields)  # an error of the chat request in this API's field names

    def new_id(self) -> str:
        return f"msg_{uuid.uuid4().hex}"

    def body(self, rid: str, created: int, model: str, f: Final, tokenizer) -> dict:
        return message(rid, model, f)

    def writer(self, rid: str, created: int, model: str, tokenizer, prompt_tokens: int) -> MessagesWriter:
        return MessagesWriter(rid, model, prompt_tokens)
