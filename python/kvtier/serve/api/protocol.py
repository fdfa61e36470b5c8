"""OpenAI request bodies (validated with pydantic), their sampling parameters, and the error
shape.

Fields are typed strictly: a wrong type or a non-finite number (NaN, Infinity) is a 400 naming
the field (``max_tokens: Input should be a valid integer``), never a silent conversion. Unknown
fields are ignored, as OpenAI-style servers do (clients send vendor extensions). kvtier's
extensions: ``session_id`` (or the header ``X-Session-Id``), ``expected_tool_wait_s`` (or the
header ``X-Expected-Tool-Wait-S``, which the Messages and Responses APIs take too: a hint of how
long the tools of this turn will run), ``ignore_eos`` (as vLLM has it: generate
``max_tokens`` tokens whatever the model says; what replay clients send) and ``cache_salt``.

``presence_penalty`` and ``frequency_penalty`` (in [-2, 2]) are applied as OpenAI defines them,
over the tokens this request generated. A ``max_tokens`` (or ``max_completion_tokens``) that with
the prompt exceeds the model's context is a 400 naming both numbers (as vLLM answers); without
one, the output is at most 256 tokens and stops at the context's end.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvtier.serve.params import MAX_PENALTY, SamplingParams

DEFAULT_MAX_TOKENS = 256
SESSION_ID_MAX = 256  # characters of a session id (body field or header)
TOOL_WAIT_HEADER = "x-expected-tool-wait-s"


def tool_wait_hint(header: str | None) -> float | None:
    """Seconds of the ``X-Expected-Tool-Wait-S`` header (how long the tools this turn calls will
    run, as the body field ``expected_tool_wait_s``); None when absent or empty.

    Raises:
        ApiError: 400 naming ``expected_tool_wait_s`` when it is not a finite number >= 0.
    """
    if header is None or not header.strip():
        return None
    try:
        seconds = float(header)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ApiError(400, f"expected_tool_wait_s: the X-Expected-Tool-Wait-S header must be a finite number of "
                       f"seconds >= 0, got {header!r}", "expected_tool_wait_s")
    return seconds


class ApiError(Exception):
    """A request the server refuses: HTTP ``status`` and an OpenAI error body.

    Attributes:
        status: 400 bad request, 404 unknown model or session, 503 overloaded.
        message: what was wrong, naming the field.
        param: the offending field's path (``messages[0].role``), or None.
        type: OpenAI's error type: ``not_found_error`` (404), ``service_unavailable_error`` (503),
            ``invalid_request_error`` (other 4xx), ``server_error`` (5xx).
    """

    def __init__(self, status: int, message: str, param: str | None = None, type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        default = "invalid_request_error" if 400 <= status < 500 else "server_error"
        self.type = type or {404: "not_found_error", 503: "service_unavailable_error"}.get(status, default)

    def body(self) -> dict:
        """``{"error": {"message", "type", "param", "code"}}`` (OpenAI's shape)."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _is_union_tag(part) -> bool:
    """A loc part pydantic adds for a member of a union (``str``, ``list[int]``,
    ``literal['auto','none']``): not a field the client wrote."""
    return isinstance(part, str) and (not part.isidentifier() or part in _TYPE_TAGS)


def _loc(loc) -> str:
    out = ""
    for part in loc:
        if part == "body" or _is_union_tag(part):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _problem(error: dict) -> tuple:
    """The field an error is about: for a union member's error, the union field itself (so the
    errors of every member count as one problem)."""
    loc = tuple(error.get("loc", ()))
    tags = [i for i, part in enumerate(loc) if _is_union_tag(part)]
    return loc[:tags[0]] if tags else loc


def validation_error(e: ValidationError | list) -> ApiError:
    """A pydantic (or FastAPI) validation error as a 400 naming the first bad field.

    A field of several types (``stop``: a string or a list of strings) that matches none is one
    problem: the message is the most specific one (deepest path, e.g. ``stop[0]``), and when its
    members fail equally deep, what each expected."""
    errors = e.errors() if isinstance(e, ValidationError) else e
    first = errors[0]
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}",
                        "body")
    key = _problem(first)
    group = [x for x in errors if _problem(x) == key]
    depth = {id(x): sum(p != "body" and not _is_union_tag(p) for p in x.get("loc", ())) for x in group}
    deepest = [x for x in group if depth[id(x)] == max(depth.values())]
    msgs = list(dict.fromkeys(x["msg"] for x in deepest))
    param = _loc(deepest[0].get("loc", ())) or "body"
    others = len({_problem(x) for x in errors} - {key})
    more = f" (and {others} more problem(s))" if others else ""
    return ApiError(400, f"{param}: {' or '.join(msgs)}{more}", param)



def validate_nested(model: type[BaseModel], raw, where: str):
    """``raw`` (a JSON object found at ``where`` in a request) as a ``model`` instance.

    Raises:
        ApiError: 400 when ``raw`` is not an object, or when ``model`` rejects it, the message and
            ``param`` prefixed with ``where`` (``messages[2].content[0].type``).
    """
    if not isinstance(raw, dict):
        raise ApiError(400, f"{where}: expected an object, got {type(raw).__name__}", where)
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        inner = validation_error(e)
        raise ApiError(400, f"{where}.{inner.message}", f"{where}.{inner.param}") from None

def value_error(e: ValueError) -> ApiError:
    """A ``ValueError`` from kvtier's checks (messages start with the field) as a 400."""
    msg = str(e)
    head = msg.split(":", 1)[0].split(" ", 1)[0]
    return ApiError(400, msg, head if head and head[0].isalpha() else None)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    presence_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    stop: str | list[str] | None = None
    stream: bool | None = False  # null (OpenAI allows it here, on n, logprobs, echo): the default
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=1, ge=1, le=1)
    ignore_eos: bool = False
    session_id: str | None = Field(default=None, min_length=1, max_length=SESSION_ID_MAX)
    cache_salt: str | None = Field(default=None, max_length=256)
    expected_tool_wait_s: float | None = Field(default=None, ge=0)

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ApiError(400, "stop: at most 4 non-empty strings", "stop")
        return stops

    def session(self, header: str | None) -> str | None:
        """The request's session id: the body's ``session_id``, else the ``X-Session-Id`` header
        (empty: none), which must then be 1-256 characters as the body field."""
        if self.session_id is not None or not header:
            return self.session_id
        if len(header) > SESSION_ID_MAX:
            raise ApiError(400, f"session_id: the X-Session-Id header has {len(header)} characters; "
                           f"at most {SESSION_ID_MAX}", "session_id")
        return header

    def tool_wait(self, header: str | None) -> float | None:
        """The client's tool-wait hint in seconds: the body's ``expected_tool_wait_s``, else the
        ``X-Expected-Tool-Wait-S`` header (:func:`tool_wait_hint`, checked even where the body's
        wins), else None."""
        from_header = tool_wait_hint(header)
        return self.expected_tool_wait_s if self.expected_tool_wait_s is not None else from_header

    def include_usage(self) -> bool:
        """``stream_options.include_usage``; ``stream_options`` without ``stream`` is a 400 (as
        OpenAI and vLLM answer)."""
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options: only allowed when stream is true", "stream_options")
        return bool(self.stream_options and self.stream_options.include_usage)

    def max_new_tokens(self) -> int:
        return self.max_tokens if self.max_tokens is not None else DEFAULT_MAX_TOKENS

    def max_tokens_given(self) -> bool:
        """Whether the client set the output's maximum (then prompt + maximum over the context
        is a 400, as vLLM answers; else the output stops at the context's end)."""
        return self.max_tokens is not None

    def sampling(self, **extra) -> SamplingParams:
        """The engine's :class:`SamplingParams`; bad combinations are a 400 naming the field."""
        try:
            return SamplingParams(max_tokens=self.max_new_tokens(),
                                  temperature=1.0 if self.temperature is None else self.temperature,
                                  top_p=1.0 if self.top_p is None else self.top_p, seed=self.seed,
                                  ignore_eos=self.ignore_eos, presence_penalty=self.presence_penalty or 0.0,
                                  frequency_penalty=self.frequency_penalty or 0.0,
                                  refuse_past_context=self.max_tokens_given(), **extra)
        except ValueError as e:
            raise value_error(e) from None


class ChatRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)  # OpenAI's range; needs logprobs
    # K3's prompt fields (kvtier.serve.chat.chat_prompt_options); a K2 model's template takes none
    thinking: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    response_format: dict[str, Any] | None = None

    def max_new_tokens(self) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return super().max_new_tokens()

    def max_tokens_given(self) -> bool:
        return self.max_completion_tokens is not None or super().max_tokens_given()

    def params(self) -> SamplingParams:
        """Sampling parameters with this request's tools, ``tool_choice`` and parallelism."""
        from kvtier.serve.chat import chat_sampling_params

        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
        base = self.sampling(logprobs=bool(self.logprobs), top_logprobs=self.top_logprobs or 0,
                             parallel_tool_calls=self.parallel_tool_calls)
        if self.tool_choice is not None and not self.tools and self.tool_choice != "none":
            raise ApiError(400, f"tool_choice: {self.tool_choice!r:.60} needs tools", "tool_choice")
        try:
            return chat_sampling_params(base, self.tools or None, self.tool_choice if self.tools else None,
                                        self.response_format)
        except ValueError as e:
            raise value_error(e) from None

    def prompt_options(self, chat_format, params: SamplingParams):
        """The prompt's options for a model speaking ``chat_format`` (K3: ``thinking``,
        ``reasoning_effort``, ``tool_choice``, ``response_format``, checked as K3's API checks
        them; K2: None). A bad field is a 400 naming it."""
        from kvtier.serve.chat import chat_prompt_options

        try:
            return chat_prompt_options(chat_format, params, tools=self.tools, tool_choice=self.tool_choice,
                                       thinking=self.thinking, reasoning_effort=self.reasoning_effort,
                                       response_format=self.response_format)
        except ValueError as e:
            raise value_error(e) from None


class CompletionRequest(_Common):
    """``POST /v1/completions``: ``prompt`` is text or token ids (one prompt per request).

    With a session (``session_id`` or ``X-Session-Id``), ``expected_tool_wait_s`` declares that the
    session waits on a tool for about that long once this turn ends (a client that parses the text
    itself knows it called one): the next request of the session ends the wait and is a resume, as
    on chat (:class:`kvtier.serve.api.sessions.SessionStore`).
    """

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)  # alternatives per token (OpenAI's range)
    echo: bool | None = False

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ApiError(400, f"prompt: {len(p)} prompts in one request; send one per request", "prompt")
            p = p[0]
        if self.echo:
            raise ApiError(400, "echo: not supported", "echo")
        if not p:
            raise ApiError(400, "prompt: empty; a prompt needs at least one token", "prompt")
        return p

    def params(self) -> SamplingParams:
        return self.sampling(logprobs=self.logprobs is not None, top_logprobs=self.logprobs or 0)


DEFAULT_MAX_REQUEST_BYTES = 32 << 20  # room for a 1M-token prompt as JSON text (about 4 bytes a token)


def _too_large(size: int, max_bytes: int, at_least: bool) -> ApiError:
    return ApiError(413, f"body: the request body has {'more than ' if at_least else ''}{size} bytes; this server "
                    f"takes at most {max_bytes} (kvtier serve --max-request-bytes)", "body")


async def read_body(request, max_bytes: int | None = None) -> bytes:
    """The raw body of ``request`` (a starlette/FastAPI ``Request``), refused before it is
    decoded when over ``max_bytes`` (None: no limit).

    Raises:
        ApiError: 413 on ``body`` as soon as the declared ``Content-Length`` or the bytes
            received so far exceed ``max_bytes``; the rest is not read. 400 on ``body`` when the
            client closes the connection before its whole body arrived (no one reads the answer;
            it keeps a client's upload cut short out of the server log as a stack trace).
    """
    from starlette.requests import ClientDisconnect

    try:
        if max_bytes is None:
            return await request.body()
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            raise _too_large(int(declared), max_bytes, False)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(max_bytes, max_bytes, True)
            chunks.append(chunk)
        return b"".join(chunks)
    except ClientDisconnect:
        raise ApiError(400, "the client closed the connection before the whole request body arrived", "body") from None


async def json_body(request, max_bytes: int | None = None) -> Any:
    """The body of ``request`` (see :func:`read_body`: a 413 over ``max_bytes``) decoded as
    JSON; a 400 on ``body`` when it is not valid JSON (nesting too deep for the decoder
    included)."""
    raw = await read_body(request, max_bytes)
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", "body") from None


def parse(model: type[BaseModel], body: Any) -> BaseModel:
    """``body`` (decoded JSON) as ``model``; a 400 naming the first bad field otherwise."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}", "body")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None
