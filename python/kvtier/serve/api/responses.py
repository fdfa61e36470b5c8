"""OpenAI Responses requests (``POST /v1/responses``) translated into the chat request the OpenAI
chat endpoint builds, and the responses the server keeps for ``previous_response_id``.

The translation is pure (:func:`to_chat`): ``instructions`` becomes the system turn; ``input``
(a string: one user turn; or items) maps item by item: ``message`` (roles user, assistant,
system, developer -> system; ``input_text`` / ``output_text`` parts) to chat turns, consecutive
``function_call`` items (with the assistant message before them) to one assistant turn's
``tool_calls``, each ``function_call_output`` to a ``tool`` turn, a ``reasoning`` item to the next
assistant turn's reasoning. Function tools are flat (``{"type": "function", "name",
"parameters"}``) and become chat function tools, constrained as chat tool calls are;
``tool_choice`` ``{"type": "function", "name"}`` selects one (a root ``$schema`` is dropped). Call ids are K2's
(``functions.NAME:IDX``), passed back unchanged.

Validated as OpenAI's API does: unknown fields are a 400 (fields kvtier has no use for are
accepted and ignored: ``user``, ``safety_identifier``, ``service_tier``, ``truncation``,
``reasoning`` (except its ``effort`` for a K3 model, whose prompt it shapes), ``include``, ``stream_options``, ``prompt_cache_retention``, ``prompt_cache_options``,
``max_tool_calls``, ``context_management``, ``background_options``, ``access_programs``,
``image``, ``moderation``),
and so are a ``function_call_output`` whose ``call_id`` no earlier ``function_call`` has, a
``function_call`` left without output, non-function tools, images and files (a text model),
``item_reference`` items, ``conversation``, ``prompt``, background mode and structured outputs.

The output items the official SDK returns are accepted back as it gives them (``model_dump()``,
with or without ``None`` fields, by alias or not, its objects, or their JSON): every field of its
items and parts (``caller``, ``namespace``, ``phase``, ``parsed_arguments``, ``async`` (or its
Python name ``async_``, one of the two) ...; what does not change the prompt is ignored).
``tests/serve/api/test_sdk_fields.py`` checks these field sets against the installed SDK's types.

Conversation state: a response the server keeps (``store``, default true) can be continued with
``previous_response_id``: its turns (input and output, not its instructions, as OpenAI's API
has it) come before the new input. Kept responses expire after the session TTL. Session: the
``X-Session-Id`` header, else the previous response's session, else ``prompt_cache_key``, else
(a kept response) a session of its own, so each chain of responses has one incremental encoder
and its tool waits are told to the pool as chat sessions' are.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvtier.serve.api.protocol import SESSION_ID_MAX, ApiError
from kvtier.serve.api.protocol import validate_nested as _validate

PATH = "/v1/responses"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class ResponsesRequest(_Strict):
    """``POST /v1/responses``; ``input`` items are checked by :func:`to_chat`."""

    model: str
    input: str | list[Any]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = Field(default=None, min_length=1, max_length=SESSION_ID_MAX)
    text: dict[str, Any] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=0)
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    # accepted and ignored
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    stream_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)
    prompt_cache_options: dict[str, Any] | None = None
    context_management: list[dict[str, Any]] | None = None
    background_options: dict[str, Any] | None = None
    access_programs: Any = None
    image: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None

    def echo(self) -> dict:
        """The request's settings as a response object repeats them."""
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "parallel_tool_calls": self.parallel_tool_calls is not False,
                "previous_response_id": self.previous_response_id,
                "temperature": 1.0 if self.temperature is None else self.temperature,
                "top_p": 1.0 if self.top_p is None else self.top_p,
                "tool_choice": self.tool_choice or "auto", "tools": list(self.tools or []),
                "store": self.store is not False, "metadata": dict(self.metadata or {}),
                "text": self.text or {"format": {"type": "text"}}, "truncation": self.truncation or "disabled",
                "reasoning": self.reasoning or {"effort": None, "summary": None}, "user": self.user}


class _Part(_Strict):
    type: Literal["input_text", "output_text", "refusal", "summary_text", "reasoning_text"]
    text: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None
    prompt_cache_breakpoint: dict[str, Any] | None = None
    parsed: Any = None  # the SDK's ParsedResponseOutputText (structured outputs): not sent to the model


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCallItem(_Strict):
    # "async" on the wire; "async_" (the SDK's Python name) in a model_dump() without by_alias
    model_config = ConfigDict(validate_by_name=True, validate_by_alias=True)

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: str | None = None
    namespace: str | None = None
    caller: dict[str, Any] | None = None
    async_: bool | None = Field(default=None, alias="async")
    parsed_arguments: Any = None  # the SDK's ParsedResponseFunctionToolCall: ``arguments`` decoded


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None
    caller: dict[str, Any] | None = None
    name: str | None = None
    namespace: str | None = None
    created_by: str | None = None


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


_ITEMS = {"message": MessageItem, "function_call": FunctionCallItem,
          "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}


def _text(content, where: str) -> str:
    """Text parts joined (images and files refused: a text-only model)."""
    if isinstance(content, str):
        return content
    out = []
    for k, raw in enumerate(content):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind in ("input_image", "input_file", "input_audio"):
            raise ApiError(400, f"{where}[{k}].type: {kind!r} is not accepted: this server serves a text-only "
                           "model", f"{where}[{k}].type")
        p = _validate(_Part, raw, f"{where}[{k}]")
        out.append(p.refusal if p.type == "refusal" else p.text or "")
    return "".join(out)


class _Turns:
    """Chat turns being built, with the calls still waiting for their output."""

    def __init__(self, history: list[dict]):
        self.turns = list(history)
        self.n_history = len(history)  # kept turns are never changed: calls join only new turns
        self.calls: dict[str, str] = {}  # call_id -> where it was declared, until its output comes
        self.reasoning = ""
        for t in history:
            for c in t.get("tool_calls") or []:
                self.calls[c["id"]] = "previous_response_id"
            if t.get("role") == "tool":
                self.calls.pop(t.get("tool_call_id"), None)

    def assistant(self, content: str, open_for_calls: bool) -> dict:
        last = self.turns[-1] if self.turns else {}
        if (open_for_calls and len(self.turns) > self.n_history and last["role"] == "assistant"
                and not self.reasoning):
            return last
        turn = {"role": "assistant", "content": content}
        if self.reasoning:
            turn["reasoning_content"], self.reasoning = self.reasoning, ""
        self.turns.append(turn)
        return turn

    def add(self, item, where: str) -> None:
        if self.reasoning and (isinstance(item, FunctionCallOutputItem)
                               or (isinstance(item, MessageItem) and item.role != "assistant")):
            self.assistant("", False)  # a turn that only reasoned (its output had no message item)
        if isinstance(item, MessageItem):
            text = _text(item.content, f"{where}.content")
            if item.role == "assistant":
                self.assistant(text, False)
            else:
                self.turns.append({"role": "system" if item.role == "developer" else item.role, "content": text})
        elif isinstance(item, FunctionCallItem):
            _check_arguments(item.arguments, f"{where}.arguments")
            if item.call_id in self.calls:
                raise ApiError(400, f"{where}.call_id: duplicate function_call call_id {item.call_id!r}",
                               f"{where}.call_id")
            turn = self.assistant("", True)
            turn["tool_calls"] = [*turn.get("tool_calls", []), {
                "id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}]
            self.calls[item.call_id] = where
        elif isinstance(item, FunctionCallOutputItem):
            if self.calls.pop(item.call_id, None) is None:
                raise ApiError(400, f"{where}.call_id: no function_call with call_id {item.call_id!r} comes before "
                               "this function_call_output", f"{where}.call_id")
            self.turns.append({"role": "tool", "tool_call_id": item.call_id,
                               "content": _text(item.output, f"{where}.output")})
        else:  # reasoning: the next assistant turn's
            parts = item.content if item.content else item.summary
            self.reasoning += _text(parts, f"{where}.{'content' if item.content else 'summary'}")


def _check_arguments(args: str, where: str) -> None:
    try:
        value = json.loads(args)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"{where}: not valid JSON ({e}): {args[:60]!r}", where) from None
    if not isinstance(value, dict):
        raise ApiError(400, f"{where}: expected a JSON object, got {args[:60]!r}", where)


def input_turns(req: ResponsesRequest, history: list[dict]) -> list[dict]:
    """``history`` (a kept response's turns) then ``req.input`` as chat turns, without
    ``instructions``.

    Raises:
        ApiError: 400 naming the item (``input[3].call_id``).
    """
    turns = _Turns(history)
    items = [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    if not items:
        raise ApiError(400, "input: empty; give a string or at least one item", "input")
    for i, raw in enumerate(items):
        where = f"input[{i}]" if not isinstance(req.input, str) else "input"
        kind = raw.get("type", "message" if "role" in raw else None) if isinstance(raw, dict) else None
        if kind not in _ITEMS:
            raise ApiError(400, f"{where}.type: {kind!r} items are not supported; expected one of "
                           f"{sorted(_ITEMS)}", f"{where}.type")
        turns.add(_validate(_ITEMS[kind], raw, where), where)
    if turns.calls:
        call_id, where = next(iter(turns.calls.items()))
        raise ApiError(400, f"input: no function_call_output for the function_call with call_id {call_id!r} "
                       f"({where}); every call needs its output before the next turn", "input")
    if not any(t["role"] == "user" or t["role"] == "tool" for t in turns.turns):
        raise ApiError(400, "input: no user message or function_call_output to answer", "input")
    return turns.turns


# a function tool's fields (others are a 400); only name, description and parameters are used
TOOL_FIELDS = frozenset({"type", "name", "description", "parameters", "strict", "defer_loading", "output_schema",
                         "allowed_callers", "async"})


def _tools(raw: list[dict]) -> list[dict]:
    out = []
    for i, t in enumerate(raw):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise ApiError(400, f"tools[{i}].type: {kind!r} tools are not supported; only 'function' tools",
                           f"tools[{i}].type")
        extra = set(t) - TOOL_FIELDS
        if extra:
            raise ApiError(400, f"tools[{i}].{min(extra)}: unknown parameter", f"tools[{i}].{min(extra)}")
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        if isinstance(fn.get("parameters"), dict) and "$schema" in fn["parameters"]:  # the dialect's name
            fn["parameters"] = {k: v for k, v in fn["parameters"].items() if k != "$schema"}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(tc) -> Any:
    if tc is None or isinstance(tc, str):
        return tc
    if tc.get("type") != "function" or not isinstance(tc.get("name"), str) or set(tc) - {"type", "name"}:
        raise ApiError(400, f"tool_choice: expected 'auto', 'none', 'required' or {{'type': 'function', 'name': str}}, "
                       f"got {tc!r:.80}", "tool_choice")
    return {"type": "function", "function": {"name": tc["name"]}}


def _refuse_unsupported(req: ResponsesRequest) -> None:
    for key, why in (("conversation", "conversation objects"), ("prompt", "prompt templates")):
        if getattr(req, key) is not None:
            raise ApiError(400, f"{key}: {why} are not supported; send input (and previous_response_id)", key)
    if req.background:
        raise ApiError(400, "background: background mode is not supported", "background")
    fmt = (req.text or {}).get("format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise ApiError(400, "text.format: only {'type': 'text'} (structured outputs are not supported)", "text.format")


def to_chat(req: ResponsesRequest, history: list[dict]) -> tuple[dict, list[dict]]:
    """The chat-completions body of ``req`` after the kept turns ``history``, and the turns to
    keep for this response (``history`` and the new input; the output is added when it ends)."""
    _refuse_unsupported(req)
    turns = input_turns(req, history)
    msgs = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + turns
    body: dict[str, Any] = {"model": req.model, "messages": msgs, "stream": req.stream}
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    for key in ("temperature", "top_p", "parallel_tool_calls"):
        if getattr(req, key) is not None:
            body[key] = getattr(req, key)
    if req.tools:
        body["tools"] = _tools(req.tools)
    choice = _tool_choice(req.tool_choice)
    if choice is not None and (req.tools or choice != "none"):
        body["tool_choice"] = choice
    effort = (req.reasoning or {}).get("effort")
    if effort is not None:
        body["reasoning_effort"] = effort  # shapes a K3 prompt; K2's template ignores it
    return body, turns


def rename_fields(e: ApiError) -> ApiError:
    """An error of the chat request's validation in this API's names (``tools[0].function.parameters``
    -> ``tools[0].parameters``, ``max_tokens`` -> ``max_output_tokens``, ``reasoning_effort`` ->
    ``reasoning.effort``, the whole ``messages`` -> ``input``)."""
    def fix(s):
        if not s:
            return s
        s = s.replace(".function.parameters", ".parameters").replace(".function.name", ".name")
        if s == "messages" or s.startswith("messages: "):
            return "input" + s[len("messages"):]
        if s.startswith("reasoning_effort"):
            return "reasoning.effort" + s[len("reasoning_effort"):]
        return s.replace("max_tokens", "max_output_tokens") if s.startswith("max_tokens") else s
    return ApiError(e.status, fix(e.message), fix(e.param), e.type)


@dataclass
class Kept:
    """A kept response: its session, and its turns after those of the response it continued."""

    session_id: str | None
    parent: Kept | None
    turns: list[dict]

    def history(self) -> list[dict]:
        chain, node = [], self
        while node is not None:
            chain.append(node.turns)
            node = node.parent
        return [t for turns in reversed(chain) for t in turns]


class ResponseStore:
    """Kept responses by id, each expiring ``ttl_s`` after it was stored (the session TTL). A kept
    response holds its parent, so a live chain stays whole. Event-loop side only (no locking).

    Args:
        ttl_s: seconds a response is kept.
        clock: seconds, monotonic.
    """

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        self.ttl_s, self.clock = ttl_s, clock
        self._kept: OrderedDict[str, tuple[float, Kept]] = OrderedDict()

    def expire(self) -> None:
        now = self.clock()
        while self._kept and next(iter(self._kept.values()))[0] <= now:
            self._kept.popitem(last=False)

    def get(self, rid: str) -> Kept:
        """The kept response ``rid``.

        Raises:
            ApiError: 400 naming ``previous_response_id`` when there is none (unknown, expired,
                or not kept: ``store`` false).
        """
        self.expire()
        entry = self._kept.get(rid)
        if entry is None:
            raise ApiError(400, f"previous_response_id: no kept response {rid!r} (unknown, stored with store=false, "
                           f"or expired: responses are kept {self.ttl_s:g} s)", "previous_response_id")
        return entry[1]

    def put(self, rid: str, kept: Kept) -> None:
        self.expire()
        self._kept[rid] = (self.clock() + self.ttl_s, kept)

    def __len__(self) -> int:
        return len(self._kept)


def session_for(header: str | None, previous: Kept | None, prompt_cache_key: str | None, rid: str,
                store: bool) -> str | None:
    """The session of a request (see the module docstring)."""
    if header:
        if len(header) > SESSION_ID_MAX:
            raise ApiError(400, f"session: the X-Session-Id header has {len(header)} characters; "
                           f"at most {SESSION_ID_MAX}", "session_id")
        return header
    if previous is not None and previous.session_id:
        return previous.session_id
    if prompt_cache_key:
        return prompt_cache_key
    return f"response:{rid}" if store else None
