"""OpenAI response bodies and streaming chunks built from :class:`Delta` / :class:`Final` events."""

from __future__ import annotations

import json
import uuid

from kvtier.serve.api.jobs import Delta, Final


def usage(f: Final) -> dict:
    """OpenAI usage, with ``prompt_tokens_details.cached_tokens`` and kvtier's split by tier
    (``cached_tokens_by_tier``: ``{"device", "host", "disk"}`` tokens, plus ``remote`` with a
    remote tier) and ``kv_last_block``: hex of the prompt's last full block hash (None without
    one), which a router looks up in the workers' KV events; ``engine_steps``: the engine steps
    completed from the request's arrival to its finish (its wait and run, counted in steps)."""
    return {"prompt_tokens": f.prompt_tokens, "completion_tokens": f.completion_tokens,
            "total_tokens": f.prompt_tokens + f.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": f.cached_tokens},
            "cached_tokens_by_tier": dict(f.cached_tokens_by_tier),
            "kv_last_block": f.last_prompt_block.hex() if f.last_prompt_block else None,
            "engine_steps": f.engine_steps}


def tool_call(c: dict) -> dict:
    """A parsed call as an OpenAI ``tool_calls`` entry (with its ``index``)."""
    return {"index": c["index"], "id": c["id"], "type": "function",
            "function": {"name": c["name"], "arguments": c["arguments"]}}


def _token_bytes(tokenizer, i: int) -> bytes:
    return tokenizer.special_ids.get(i, "").encode() or tokenizer.decode_bytes([i])


def chat_logprobs(tokenizer, ids, lps, tops=None) -> dict | None:
    """``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
    "bytes"}, ...]}]}``; ``tops``: per token ``(token_id, logprob)`` alternatives (None: none)."""
    if lps is None:
        return None
    content = []
    for k, (i, lp) in enumerate(zip(ids, lps)):
        b = _token_bytes(tokenizer, i)
        alts = []
        for j, alt_lp in (tops[k] if tops and k < len(tops) else ()):
            ab = _token_bytes(tokenizer, j)
            alts.append({"token": ab.decode("utf-8", "replace"), "logprob": alt_lp, "bytes": list(ab)})
        content.append({"token": b.decode("utf-8", "replace"), "logprob": lp, "bytes": list(b), "top_logprobs": alts})
    return {"content": content}


def text_logprobs(tokenizer, ids, lps, tops=None) -> dict | None:
    """A completion's ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``;
    ``top_logprobs``: per token ``{token: logprob}`` of the alternatives asked for (None when
    none were)."""
    if lps is None:
        return None
    tokens = [_token_bytes(tokenizer, i).decode("utf-8", "replace") for i in ids]
    top = None
    if tops:
        top = [{_token_bytes(tokenizer, j).decode("utf-8", "replace"): alt_lp for j, alt_lp in alts} for alts in tops]
    return {"tokens": tokens, "token_logprobs": list(lps), "top_logprobs": top, "text_offset": None}


def chat_completion(rid: str, created: int, model: str, f: Final, tokenizer) -> dict:
    message = {"role": "assistant", "content": f.content if f.content or not f.tool_calls else None}
    if f.reasoning:
        message["reasoning_content"] = f.reasoning
    if f.tool_calls:
        message["tool_calls"] = [{k: v for k, v in tool_call(c).items() if k != "index"} for c in f.tool_calls]
    choice = {"index": 0, "message": message,
              "logprobs": chat_logprobs(tokenizer, f.token_ids, f.logprobs, f.top_logprobs),
              "finish_reason": f.finish_reason}
    if f.tool_call_problems:
        choice["tool_call_problems"] = f.tool_call_problems
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": [choice],
            "usage": usage(f)}


def text_completion(rid: str, created: int, model: str, f: Final, tokenizer) -> dict:
    lps = text_logprobs(tokenizer, f.token_ids, f.logprobs, f.top_logprobs)
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": f.content, "logprobs": lps, "finish_reason": f.finish_reason}],
            "usage": usage(f)}


def sse(obj) -> bytes:
    """One server-sent event line pair."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


class ChunkWriter:
    """Streaming chunks of one request (chat or text completion)."""

    def __init__(self, kind: str, rid: str, created: int, model: str, tokenizer, include_usage: bool):
        self.kind, self.rid, self.created, self.model = kind, rid, created, model
        self.tokenizer, self.include_usage = tokenizer, include_usage
        self.object = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def _chunk(self, choice: dict | None, **extra) -> bytes:
        obj = {"id": self.rid, "object": self.object, "created": self.created, "model": self.model,
               "choices": [choice] if choice is not None else []}
        obj.update(extra)
        return sse(obj)

    def first(self) -> bytes | None:
        if self.kind != "chat":
            return None
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})

    def delta(self, d: Delta, logprobs: bool) -> list[bytes]:
        """Chunks of one delta event: text (and reasoning), then each complete tool call."""
        out = []
        if self.kind != "chat":
            lps = text_logprobs(self.tokenizer, d.token_ids, d.logprobs, d.top_logprobs) if logprobs else None
            return [self._chunk({"index": 0, "text": d.text, "logprobs": lps, "finish_reason": None})]
        if d.text or d.reasoning or d.token_ids:
            delta = {"content": d.text}
            if d.reasoning:
                delta["reasoning_content"] = d.reasoning
            lps = chat_logprobs(self.tokenizer, d.token_ids, list(d.logprobs), d.top_logprobs) if logprobs else None
            out.append(self._chunk({"index": 0, "delta": delta, "logprobs": lps, "finish_reason": None}))
        for c in d.tool_calls:
            out.append(self._chunk({"index": 0, "delta": {"tool_calls": [tool_call(c)]}, "logprobs": None,
                                    "finish_reason": None}))
        return out

    def final(self, f: Final) -> list[bytes]:
        choice = ({"index": 0, "delta": {}, "logprobs": None, "finish_reason": f.finish_reason}
                  if self.kind == "chat" else {"index": 0, "text": "", "logprobs": None,
                                               "finish_reason": f.finish_reason})
        out = [self._chunk(choice)]
        if self.include_usage:
            out.append(self._chunk(None, usage=usage(f)))
        return out

    def error(self, err) -> list[bytes]:
        """The chunk of an error that ended the stream (an :class:`ApiError`)."""
        return [sse(err.body())]

    def end(self) -> bytes:
        return b"data: [DONE]\n\n"


class OpenAIFormat:
    """How chat and text completions answer: the id, the body, the stream writer. Each API's
    format has these three methods (see ``app._serve``)."""

    def __init__(self, kind: str, include_usage: bool):
        self.kind, self.include_usage = kind, include_usage

    def new_id(self) -> str:
        return f"{'chatcmpl' if self.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"

    def body(self, rid: str, created: int, model: str, f: Final, tokenizer) -> dict:
        return (chat_completion(rid, created, model, f, tokenizer) if self.kind == "chat"
                else text_completion(rid, created, model, f, tokenizer))

    def writer(self, rid: str, created: int, model: str, tokenizer, prompt_tokens: int) -> ChunkWriter:
        """``prompt_tokens``: the prompt's length (the engine accepted it)."""
        return ChunkWriter(self.kind, rid, created, model, tokenizer, self.include_usage)


def assistant_message(f: Final) -> dict:
    """The model's turn as a chat message (for a conversation the server keeps): its text, its
    reasoning and its calls with their ids and arguments as generated."""
    msg = {"role": "assistant", "content": f.content}
    if f.reasoning:
        msg["reasoning_content"] = f.reasoning
    if f.tool_calls:
        msg["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["name"], "arguments": c["arguments"]}} for c in f.tool_calls]
    return msg
