"""Anthropic Messages requests (``POST /v1/messages``) translated into the chat request the
OpenAI chat endpoint builds, and Anthropic's error shape.

The translation is pure (:func:`to_chat`): ``system`` becomes a system turn (so does a message of
role ``system``, text only, where it stands); ``tool_use`` blocks become the assistant turn's
``tool_calls`` (their ``input`` as compact JSON, as the model writes arguments, so a replayed
turn renders as it was generated); each ``tool_result`` block
becomes a ``tool`` turn; tools with ``input_schema`` become function tools, whose calls are
schema-constrained as chat tool calls are (a root ``$schema``, the dialect's name, is dropped).
``tool_choice``: ``auto`` -> ``auto``, ``any`` ->
``required``, ``tool`` -> that function, ``none`` -> ``none``; ``disable_parallel_tool_use`` ->
``parallel_tool_calls: false``. Tool-use ids are K2's call ids (``functions.NAME:IDX``), passed
back unchanged.

Validated as Anthropic's API does: unknown fields are a 400 (a few fields kvtier has no use for
are accepted and ignored: ``thinking`` (except by a K3 model, whose prompt it shapes:
``kvtier.serve.chat.chat_prompt_options``), ``service_tier``, ``cache_control``,
``context_management``, ``inference_geo``, ``speed``, ``container``, ``diagnostics``,
``user_profile_id``, ``workspace_id``, ``output_config`` without ``format``), and
so are content blocks in the wrong place (``tool_use`` from the user, ``tool_result`` from the
assistant), a ``tool_result`` with no ``tool_use`` of that id in the message before, and a
``tool_use`` with no ``tool_result`` in the message after. Images and documents are refused (a
text model).

What the official SDK returns is accepted back as it gives it (``model_dump()``, with or without
``None`` fields, its objects, or their JSON): every field of its content blocks (``toolset_name``,
``caller``, ``citations``, ``parsed_output``; what does not change the prompt is ignored), and an
assistant turn that is a whole returned message (``messages.append(message.model_dump())``: its
``id``, ``model``, ``stop_reason``, ``usage`` ... are ignored). ``tests/serve/api/test_sdk_fields.py``
checks these field sets against the installed SDK's types. A final assistant turn (prefill) is refused: K2's template opens a new turn.
``temperature`` and ``top_p`` (which the newest SDKs send only as extra body fields) are
honoured; ``top_k`` is refused.

Session: the ``X-Session-Id`` header, else ``metadata.user_id``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvtier.serve.api.protocol import SESSION_ID_MAX, ApiError
from kvtier.serve.api.protocol import validate_nested as _validate

PATH = "/v1/messages"
MAX_STOP_SEQUENCES = 4  # what the server's stop filter takes (as chat's ``stop``)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 529: "overloaded_error"}


def error_body(e: ApiError) -> dict:
    """``{"type": "error", "error": {"type", "message"}}`` (Anthropic's shape)."""
    default = "invalid_request_error" if 400 <= e.status < 500 else "api_error"
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(e.status, default), "message": e.message}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[dict[str, Any]] | None = None
    parsed_output: Any = None  # the SDK's ParsedTextBlock (structured outputs): not sent to the model


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[dict[str, Any]] = ""
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None
    toolset_name: str | None = None


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str


_BLOCKS = {"user": {"text": TextBlock, "tool_result": ToolResultBlock}, "system": {"text": TextBlock},
           "assistant": {"text": TextBlock, "tool_use": ToolUseBlock, "thinking": ThinkingBlock,
                         "redacted_thinking": RedactedThinkingBlock}}
_UNSUPPORTED = ("image", "document", "search_result", "container_upload")


class Message(_Strict):
    role: Literal["user", "assistant", "system"]
    content: str | list[Any]


class ReturnedMessage(Message):
    """An assistant turn sent back as the whole message the API returned: the fields besides
    ``role`` and ``content`` are ignored."""

    role: Literal["assistant"]
    id: str | None = None
    type: Literal["message"] | None = None
    model: str | None = None
    stop_reason: str | None = None
    stop_sequence: str | None = None
    stop_details: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
    container: dict[str, Any] | None = None
    diagnostics: dict[str, Any] | None = None


class Metadata(_Strict):
    user_id: str | None = Field(default=None, max_length=SESSION_ID_MAX)


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Tool(_Strict):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None
    input_examples: list[dict[str, Any]] | None = None
    eager_input_streaming: bool | None = None
    allowed_callers: list[str] | None = None
    defer_loading: bool | None = None


class MessagesRequest(_Strict):
    """``POST /v1/messages``; ``messages`` items are checked by :func:`to_chat`."""

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    metadata: Metadata | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    # accepted and ignored
    thinking: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None
    output_config: dict[str, Any] | None = None
    container: str | dict[str, Any] | None = None
    diagnostics: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    def session(self, header: str | None) -> str | None:
        """The ``X-Session-Id`` header (1-256 characters), else ``metadata.user_id``."""
        if header:
            if len(header) > SESSION_ID_MAX:
                raise ApiError(400, f"session: the X-Session-Id header has {len(header)} characters; "
                               f"at most {SESSION_ID_MAX}", "session_id")
            return header
        return (self.metadata.user_id or None) if self.metadata is not None else None


def _block(raw, where: str, role: str) -> BaseModel:
    if not isinstance(raw, dict):
        raise ApiError(400, f"{where}: expected a content block object, got {type(raw).__name__}", where)
    kind = raw.get("type")
    allowed = _BLOCKS[role]
    if kind not in allowed:
        why = ("this server serves a text-only model" if kind in _UNSUPPORTED else
               f"{role} messages take only {sorted(allowed)} blocks")
        raise ApiError(400, f"{where}.type: {kind!r} blocks are not accepted here: {why}", f"{where}.type")
    return _validate(allowed[kind], raw, where)


def _texts(raw: list, where: str) -> list[dict]:
    """Text blocks as chat content parts (``cache_control`` and ``citations`` dropped)."""
    parts = []
    for k, b in enumerate(raw):
        if not (isinstance(b, dict) and b.get("type") == "text"):
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise ApiError(400, f"{where}[{k}].type: expected 'text' blocks (a text-only model), got {kind!r}",
                           f"{where}[{k}].type")
        parts.append({"type": "text", "text": _validate(TextBlock, b, f"{where}[{k}]").text})
    return parts


def _tool_pairing_error(index: int, ids: list[str]) -> ApiError:
    return ApiError(400, f"messages[{index}]: tool_use ids were found without tool_result blocks immediately "
                    f"after: {', '.join(ids)}; each tool_use block needs a tool_result block in the next message",
                    f"messages[{index}]")


def _user(blocks: list, i: int, pending: dict[str, int]) -> list[dict]:
    """A user message's chat turns: one ``tool`` turn per result (results come first, each
    answering a ``tool_use`` of the message before), then the text as a user turn."""
    out, texts, seen_text, answered = [], [], False, set()
    for k, b in enumerate(blocks):
        where = f"messages[{i}].content[{k}]"
        if isinstance(b, TextBlock):
            seen_text = True
            texts.append({"type": "text", "text": b.text})
            continue
        if b.tool_use_id not in pending or b.tool_use_id in answered:
            raise ApiError(400, f"{where}.tool_use_id: unexpected tool_use_id {b.tool_use_id!r} in a tool_result "
                           "block; each tool_result block needs a tool_use block of that id in the previous message",
                           f"{where}.tool_use_id")
        if seen_text:
            raise ApiError(400, f"{where}: tool_result blocks must come before any text in the content",
                           where)
        answered.add(b.tool_use_id)
        content = b.content if isinstance(b.content, str) else "".join(
            p["text"] for p in _texts(b.content, f"{where}.content"))
        out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                    "content": f"Error: {content}" if b.is_error else content})
    missing = [t for t in pending if t not in answered]
    if missing:
        raise _tool_pairing_error(pending[missing[0]], missing)
    if texts:
        out.append({"role": "user", "content": texts})
    return out


def _assistant(blocks: list, i: int, pending: dict[str, int]) -> dict:
    text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
    reasoning = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    calls = []
    for k, b in enumerate(blocks):
        if isinstance(b, ToolUseBlock):
            if b.id in pending:
                raise ApiError(400, f"messages[{i}].content[{k}].id: duplicate tool_use id {b.id!r}",
                               f"messages[{i}].content[{k}].id")
            pending[b.id] = i
            calls.append({"id": b.id, "type": "function", "function": {
                "name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False, separators=(",", ":"))}})
    if calls:
        msg["tool_calls"] = calls
    if reasoning:
        msg["reasoning_content"] = reasoning
    return msg


def _messages(raw: list[dict], system) -> tuple[list[dict], bool]:
    """The chat turns, and whether any ``tool_use`` block appears."""
    out: list[dict] = []
    if isinstance(system, str) and system:
        out.append({"role": "system", "content": system})
    elif isinstance(system, list) and system:
        out.append({"role": "system", "content": _texts(system, "system")})
    pending: dict[str, int] = {}  # tool_use ids of the last assistant message -> its index
    used_tools = False
    for i, item in enumerate(raw):
        whole = isinstance(item, dict) and item.get("role") == "assistant" and set(item) - {"role", "content"}
        m = _validate(ReturnedMessage if whole else Message, item, f"messages[{i}]")
        content = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        if not content or (isinstance(m.content, str) and not m.content):
            raise ApiError(400, f"messages[{i}].content: empty; every message needs non-empty content",
                           f"messages[{i}].content")
        blocks = [_block(b, f"messages[{i}].content[{k}]", m.role) for k, b in enumerate(content)]
        if m.role == "user":
            out.extend(_user(blocks, i, pending))
            pending = {}
        elif m.role == "system":  # text only, between turns (never between a tool_use and its result)
            if pending:
                raise _tool_pairing_error(next(iter(pending.values())), list(pending))
            out.append({"role": "system", "content": [{"type": "text", "text": b.text} for b in blocks]})
        else:
            if pending:
                raise _tool_pairing_error(next(iter(pending.values())), list(pending))
            out.append(_assistant(blocks, i, pending))
            used_tools |= bool(pending)
    if raw and raw[-1].get("role") == "assistant":
        raise ApiError(400, f"messages[{len(raw) - 1}]: the conversation ends with an assistant message "
                       "(prefill), which this server does not continue; end with a user message",
                       f"messages[{len(raw) - 1}]")
    return out, used_tools


def _tools(raw: list[dict]) -> list[dict]:
    out = []
    for i, t in enumerate(raw):
        if isinstance(t, dict) and t.get("type") not in (None, "custom"):
            raise ApiError(400, f"tools[{i}].type: {t.get('type')!r} (a server tool) is not supported; "
                           "declare custom tools with name and input_schema", f"tools[{i}].type")
        tool = _validate(Tool, t, f"tools[{i}]")
        if tool.input_schema.get("type") != "object":
            raise ApiError(400, f"tools[{i}].input_schema.type: expected 'object', got "
                           f"{tool.input_schema.get('type')!r}", f"tools[{i}].input_schema.type")
        # a root "$schema" names the dialect (Claude Code sends draft-07's), not a constraint
        schema = {k: v for k, v in tool.input_schema.items() if k != "$schema"}
        fn = {"name": tool.name, "parameters": schema}
        if tool.description is not None:
            fn = {"name": tool.name, "description": tool.description, "parameters": schema}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(tc: ToolChoice | None, has_tools: bool) -> dict:
    if tc is None:
        return {}
    if tc.type == "tool" and not tc.name:
        raise ApiError(400, "tool_choice.name: required when tool_choice.type is 'tool'", "tool_choice.name")
    if tc.type != "tool" and tc.name is not None:
        raise ApiError(400, f"tool_choice.name: only for tool_choice.type 'tool', not {tc.type!r}",
                       "tool_choice.name")
    if not has_tools:
        if tc.type == "none":
            return {}
        raise ApiError(400, f"tool_choice: type {tc.type!r} needs tools", "tool_choice")
    choice = {"auto": "auto", "any": "required", "none": "none"}.get(tc.type) or \
        {"type": "function", "function": {"name": tc.name}}
    return {"tool_choice": choice, "parallel_tool_calls": not tc.disable_parallel_tool_use}


def to_chat(req: MessagesRequest) -> dict:
    """The chat-completions body of ``req`` (see the module docstring).

    Raises:
        ApiError: 400 naming the field (``messages[2].content[0].tool_use_id``).
    """
    if req.top_k is not None:
        raise ApiError(400, "top_k: not supported by this server (use temperature / top_p)", "top_k")
    if req.output_config and req.output_config.get("format") is not None:
        raise ApiError(400, "output_config.format: structured outputs are not supported", "output_config.format")
    stops = req.stop_sequences or []
    if len(stops) > MAX_STOP_SEQUENCES or not all(stops):
        raise ApiError(400, f"stop_sequences: at most {MAX_STOP_SEQUENCES} non-empty strings", "stop_sequences")
    msgs, used_tools = _messages(req.messages, req.system)
    if used_tools and not req.tools:
        raise ApiError(400, "tools: requests with tool_use blocks must declare tools", "tools")
    body: dict[str, Any] = {"model": req.model, "messages": msgs, "max_tokens": req.max_tokens,
                            "stream": req.stream}
    for key in ("temperature", "top_p"):
        if getattr(req, key) is not None:
            body[key] = getattr(req, key)
    if stops:
        body["stop"] = list(stops)
    if req.tools:
        body["tools"] = _tools(req.tools)
    body.update(_tool_choice(req.tool_choice, bool(req.tools)))
    if req.thinking is not None:
        body["thinking"] = req.thinking  # shapes a K3 prompt; K2's template ignores it
    return body


def rename_fields(e: ApiError) -> ApiError:
    """An error of the chat request's validation named in this API's fields
    (``tools[0].function.parameters`` -> ``tools[0].input_schema``, ``max_tokens`` unchanged)."""
    def fix(s):
        return s.replace(".function.parameters", ".input_schema").replace(".function.name", ".name") \
            if s else s
    return ApiError(e.status, fix(e.message), fix(e.param), e.type)
