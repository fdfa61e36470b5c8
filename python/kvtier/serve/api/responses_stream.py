"""OpenAI Responses answers built from the chat path's :class:`Delta` / :class:`Final` events:
the response object and its stream of server-sent events.

Stream order (OpenAI's): ``response.created``, ``response.in_progress``; per output item
``response.output_item.added``, then for a message ``response.content_part.added``,
``response.output_text.delta`` ..., ``response.output_text.done``, ``response.content_part.done``
(a reasoning item: ``response.reasoning_text.delta`` / ``.done``; a function call:
``response.function_call_arguments.delta`` with the whole arguments, then ``.done``, sent as soon
as the model closes the call), ``response.output_item.done``; last ``response.completed``
(``response.incomplete`` when ``max_output_tokens`` ran out, ``response.failed`` on an error).
Every event has a ``sequence_number``; the items of the last event are those streamed (same ids).

Usage: ``input_tokens`` (the prompt), ``input_tokens_details.cached_tokens`` (read from
kvtier's cache), ``output_tokens``.
"""

from __future__ import annotations

import uuid

from kvtier.serve.api.chat_completions import assistant_message
from kvtier.serve.api.jobs import Delta, Final
from kvtier.serve.api.messages_stream import event
from kvtier.serve.api.protocol import ApiError, ChatRequest, parse
from kvtier.serve.api.responses import Kept, ResponsesRequest, ResponseStore, rename_fields, session_for, to_chat


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(f: Final) -> dict:
    return {"input_tokens": f.prompt_tokens,
            "input_tokens_details": {"cached_tokens": f.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": f.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": f.prompt_tokens + f.completion_tokens}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(iid: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": iid, "status": status, "role": "assistant",
            "content": [text_part(text)] if status != "in_progress" else []}


def reasoning_item(iid: str, text: str | None) -> dict:
    item = {"type": "reasoning", "id": iid, "summary": []}
    if text is not None:
        item["content"] = [{"type": "reasoning_text", "text": text}]
    return item


def call_item(iid: str, c: dict, status: str = "completed") -> dict:
    return {"type": "function_call", "id": iid, "call_id": c["id"], "name": c["name"],
            "arguments": c["arguments"] if status == "completed" else "", "status": status}


def output_items(f: Final) -> list[dict]:
    items = [reasoning_item(_id("rs"), f.reasoning)] if f.reasoning else []
    if f.content:
        items.append(message_item(_id("msg"), f.content, "incomplete" if f.finish_reason == "length" else "completed"))
    items.extend(call_item(_id("fc"), c) for c in f.tool_calls)
    return items


def prepare(body, store: ResponseStore, header: str | None):
    """A request body as (chat request, sampling parameters, session id, format).

    Raises:
        ApiError: 400 naming the field.
    """
    r = parse(ResponsesRequest, body)
    parent = store.get(r.previous_response_id) if r.previous_response_id else None
    history = parent.history() if parent is not None else []
    chat, turns = to_chat(r, history)
    req = parse(ChatRequest, chat)
    try:
        params = req.params()
    except ApiError as e:
        raise rename_fields(e) from None
    rid, keep = _id("resp"), r.store is not False
    sid = session_for(header, parent, r.prompt_cache_key, rid, keep)
    fmt = ResponsesFormat(rid, r.echo(), store if keep else None, sid, parent, turns[len(history):])
    return req, params, sid, fmt


class ResponsesFormat:
    """The Responses API's answers for ``app._serve``; keeps the finished response in ``store``
    (``parent``: the kept response it continues, ``new_turns``: its input after the parent's)."""

    def __init__(self, rid: str, echo: dict, store: ResponseStore | None, session_id: str | None,
                 parent: Kept | None, new_turns: list[dict]):
        self.rid, self.echo, self.store = rid, echo, store
        self.session_id, self.parent, self.new_turns = session_id, parent, new_turns

    rename = staticmethod(rename_fields)  # an error of the chat request in this API's field names

    def new_id(self) -> str:
        return self.rid

    def response(self, created: int, model: str, status: str, output: list[dict], f: Final | None = None,
                 error: dict | None = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.rid, "object": "response", "created_at": created, "status": status, "error": error,
                "incomplete_details": incomplete, "model": model, "output": output,
                "usage": usage(f) if f is not None else None, **self.echo}

    def finished(self, f: Final) -> str:
        """Keep the finished response; its status."""
        if self.store is not None:
            self.store.put(self.rid, Kept(self.session_id, self.parent, self.new_turns + [assistant_message(f)]))
        return "incomplete" if f.finish_reason == "length" else "completed"

    def body(self, rid: str, created: int, model: str, f: Final, tokenizer) -> dict:
        return self.response(created, model, self.finished(f), output_items(f), f)

    def writer(self, rid: str, created: int, model: str, tokenizer, prompt_tokens: int) -> ResponsesWriter:
        return ResponsesWriter(self, created, model)


class ResponsesWriter:
    """The event stream of one response; tracks the open output item."""

    def __init__(self, fmt: ResponsesFormat, created: int, model: str):
        self.fmt, self.created, self.model = fmt, created, model
        self.seq = 0
        self.items: list[dict] = []  # finished output items
        self.open: dict | None = None  # the open item (message or reasoning) and its text so far
        self.text = ""

    def _event(self, type_: str, **data) -> bytes:
        out = event(type_, {"type": type_, "sequence_number": self.seq, **data})
        self.seq += 1
        return out

    def first(self) -> bytes:
        r = self.fmt.response(self.created, self.model, "in_progress", [])
        return self._event("response.created", response=r) + self._event("response.in_progress", response=r)

    def _add(self, item: dict) -> bytes:
        return self._event("response.output_item.added", output_index=len(self.items), item=item)

    def _close(self, status: str = "completed") -> list[bytes]:
        """Close the open item; a message closed by the response's end takes its ``status``
        (``incomplete`` when ``max_output_tokens`` cut it), as :func:`output_items` gives it."""
        item, text = self.open, self.text
        if item is None:
            return []
        self.open, self.text = None, ""
        at = {"item_id": item["id"], "output_index": len(self.items)}
        if item["type"] == "message":
            done = message_item(item["id"], text, status)
            out = [self._event("response.output_text.done", **at, content_index=0, text=text, logprobs=[]),
                   self._event("response.content_part.done", **at, content_index=0, part=text_part(text))]
        else:
            done = reasoning_item(item["id"], text)
            out = [self._event("response.reasoning_text.done", **at, content_index=0, text=text)]
        out.append(self._event("response.output_item.done", output_index=len(self.items), item=done))
        self.items.append(done)
        return out

    def _text(self, kind: str, text: str) -> list[bytes]:
        out = []
        if self.open is None or self.open["type"] != kind:
            out += self._close()
            if kind == "message":
                self.open = message_item(_id("msg"), "", "in_progress")
                out.append(self._add(self.open))
                out.append(self._event("response.content_part.added", item_id=self.open["id"],
                                       output_index=len(self.items), content_index=0, part=text_part("")))
            else:
                self.open = reasoning_item(_id("rs"), None)
                out.append(self._add(self.open))
        self.text += text
        at = {"item_id": self.open["id"], "output_index": len(self.items), "content_index": 0}
        if kind == "message":
            out.append(self._event("response.output_text.delta", **at, delta=text, logprobs=[]))
        else:
            out.append(self._event("response.reasoning_text.delta", **at, delta=text))
        return out

    def delta(self, d: Delta, logprobs: bool = False) -> list[bytes]:
        out = []
        if d.reasoning:
            out += self._text("reasoning", d.reasoning)
        if d.text:
            out += self._text("message", d.text)
        for c in d.tool_calls:
            out += self._close()
            iid, at = _id("fc"), {"output_index": len(self.items)}
            out.append(self._add(call_item(iid, c, "in_progress")))
            out.append(self._event("response.function_call_arguments.delta", item_id=iid, **at, delta=c["arguments"]))
            out.append(self._event("response.function_call_arguments.done", item_id=iid, **at, name=c["name"],
                                   arguments=c["arguments"]))
            done = call_item(iid, c)
            out.append(self._event("response.output_item.done", **at, item=done))
            self.items.append(done)
        return out

    def final(self, f: Final) -> list[bytes]:
        status = self.fmt.finished(f)
        out = self._close("incomplete" if status == "incomplete" else "completed")
        r = self.fmt.response(self.created, self.model, status, self.items, f)
        return out + [self._event(f"response.{status}", response=r)]

    def error(self, err) -> list[bytes]:
        r = self.fmt.response(self.created, self.model, "failed", self.items,
                              error={"code": "server_error" if err.status >= 500 else "invalid_request",
                                     "message": err.message})
        return [self._event("response.failed", response=r)]

    def end(self) -> bytes:
        return b""
