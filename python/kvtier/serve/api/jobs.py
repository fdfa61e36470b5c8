"""One HTTP request as the engine thread tracks it: new tokens in, events out.

A :class:`Job` turns the tokens its request generated since the last step into events for the
asyncio side: text deltas (after stop strings are cut), and for chat each tool call as soon as
the engine's streaming parser of the request sees its ``<|tool_call_end|>`` (a chat job parses
nothing itself: it consumes the parser events of :meth:`kvtier.serve.engine.Engine.take_events`
and ``RequestOutput.events``). Events are delivered with ``loop.call_soon_threadsafe`` into the
request's ``asyncio.Queue``; the last one is a :class:`Final` summary.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from kvtier.serve.params import RequestOutput, SamplingParams


@dataclass(frozen=True)
class Delta:
    """Output since the last event: answer ``text``, ``reasoning`` text, complete ``tool_calls``
    (``[{"index", "id", "name", "arguments"}]``), the ``token_ids``, their ``logprobs`` and
    ``top_logprobs`` (per token ``(token_id, logprob)`` alternatives, when asked)."""

    text: str = ""
    reasoning: str = ""
    tool_calls: tuple[dict, ...] = ()
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    top_logprobs: tuple[list[tuple[int, float]], ...] = ()


@dataclass(frozen=True)
class Final:
    """How a request ended. ``finish_reason``: ``stop``, ``length``, ``tool_calls`` or ``error``
    (``error`` then says why; ``error_status`` 400 for a request the engine refused after
    accepting it, e.g. a grammar llguidance rejects, else 500). Times in seconds."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_tokens_by_tier: dict
    content: str
    reasoning: str
    tool_calls: list[dict]
    tool_call_problems: list[dict]
    logprobs: list[float] | None
    token_ids: list[int]
    ttft_s: float | None = None
    e2e_s: float | None = None
    error: str | None = None
    error_status: int = 500
    last_prompt_block: bytes | None = None  # see RequestOutput.last_prompt_block
    engine_steps: int | None = None  # engine steps from arrival to finish (RequestMetrics.engine_steps)
    stop_sequence: str | None = None  # the stop string that ended it (None: none did)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # alternatives per token, when asked


class StopFilter:
    """Cuts text at the first of ``stops``; holds back a tail that may begin a stop string."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.buf = ""
        self.hit = False
        self.matched: str | None = None  # the stop string that was hit

    def push(self, text: str) -> str:
        """The part of ``text`` (after what was held) that is safe to emit."""
        if self.hit or not self.stops:
            return "" if self.hit else text
        self.buf += text
        found = [(i, s) for i, s in ((self.buf.find(s), s) for s in self.stops) if i >= 0]
        if found:
            at, self.matched = min(found, key=lambda x: x[0])
            out, self.buf, self.hit = self.buf[:at], "", True
            return out
        cut = max(len(self.buf) - self.hold, 0)
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


@dataclass
class Job:
    """One request handed to the engine thread.

    Attributes:
        kind: ``chat`` or ``completion``.
        params: its sampling parameters (validated).
        loop, queue: where its events go (``("accepted", prompt_tokens)``, ``("delta", Delta)``,
            ``("final", Final)`` or ``("error", ApiError)``).
        payload: ``messages``/``tools`` (chat) or ``prompt`` (completion: text or ids).
        session_id, expected_tool_wait_s: the chat session and the client's tool-time hint.
        stops: stop strings.
        cache_salt: the request's tenant salt (requests with different salts share no blocks).
        tool_matcher: its tool grammar, compiled before it was queued (None: no tools).
    """

    kind: str
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    payload: dict[str, Any]
    session_id: str | None = None
    expected_tool_wait_s: float | None = None
    stops: list[str] = field(default_factory=list)
    cache_salt: str = ""
    tool_matcher: Any = None
    # engine-thread state
    request_id: int | None = None
    encoder: Any = None  # chat: the session encoder its prompt came from (it keeps the sampled ids)
    prompt_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # its Sequence's: prompt, then output pages
    sent: int = 0
    decoder: Any = None  # StreamDecoder (completion; a chat job reads the engine's parser events)
    stop: StopFilter | None = None
    content: str = ""
    reasoning: str = ""
    calls: list[dict] = field(default_factory=list)
    problems: list[dict] = field(default_factory=list)
    done: bool = False

    def emit(self, kind: str, value) -> None:
        """Deliver an event to the asyncio side (thread-safe)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass

    def start(self, tokenizer) -> None:
        from kvtier.tokenize.tokenizer import StreamDecoder

        self.decoder = None if self.kind == "chat" else StreamDecoder(tokenizer)
        self.stop = StopFilter(self.stops)

    def feed(self, ids: list[int], logprobs: list[float], final: bool, events=(), top_logprobs=()) -> Delta:
        """The delta of ``ids`` (newly generated); ``final``: the request ended after them.

        ``events``: for chat, the engine parser's events of ``ids`` (``Engine.take_events``, or
        ``RequestOutput.events`` when ``final``); a completion decodes ``ids`` as text instead.
        """
        text, reasoning, calls = [], [], []
        if self.kind == "chat":
            for e in events:
                name = type(e).__name__
                if name == "ContentDelta":
                    text.append(self.stop.push(e.text))
                elif name == "ReasoningDelta":
                    reasoning.append(e.text)
                elif name == "ToolCall" and not self.stop.hit:
                    calls.append({"index": len(self.calls), **e.to_dict()})
                    self.calls.append(calls[-1])
                elif name == "ToolCallProblem":
                    self.problems.append(e.to_dict())
            self.reasoning += "".join(reasoning)
        else:
            text = [self.stop.push("".join(self.decoder.push(i) for i in ids))]
            if final:
                text.append(self.stop.push(self.decoder.finish()))
        if final:
            text.append(self.stop.flush())
        out = "".join(text)
        self.content += out
        return Delta(out, "".join(reasoning), tuple(calls), tuple(ids), tuple(logprobs), tuple(top_logprobs))

    def final(self, o: RequestOutput, finish_reason: str | None, error: str | None = None) -> Final:
        """The summary of a finished request from its :class:`RequestOutput` (for one a stop string
        ended, :func:`kvtier.serve.outputs.request_output` of its live ``Sequence``)."""
        ids = list(o.token_ids)
        n_out = len(ids)
        if self.stop is not None and self.stop.hit:
            finish_reason = "stop"
        elif self.calls and (finish_reason == "stop" or (finish_reason == "length" and not self.problems)):
            # whole calls, the last one closed before the budget ran out (ToolCallConstraint): the
            # client runs them; text the budget cut, or a call left open, stays "length"
            finish_reason = "tool_calls"
        status = 400 if error and error.split(":", 1)[0] in ("ValueError", "GrammarError", "GrammarLimitError") else 500
        lps = list(o.logprobs) if self.params.logprobs and o.logprobs is not None else None
        return Final(finish_reason or "stop", len(o.prompt_token_ids), n_out, o.num_cached_tokens,
                     dict(o.cached_tokens_by_tier), self.content, self.reasoning,
                     list(self.calls), list(self.problems), lps, ids, o.metrics.ttft_s, o.metrics.e2e_s,
                     error, status, o.last_prompt_block,
                     o.metrics.engine_steps, self.stop.matched if self.stop is not None else None,
                     list(o.top_logprobs) if self.params.top_logprobs and o.top_logprobs is not None else None)
