"""Streaming parser of Kimi K2 assistant output: content, reasoning and tool calls.

K2 writes a turn as ``[<think>reasoning</think>]content`` followed, when it calls tools, by
``<|tool_calls_section_begin|>`` + per call ``<|tool_call_begin|>functions.NAME:IDX
<|tool_call_argument_begin|>{JSON}<|tool_call_end|>`` + ``<|tool_calls_section_end|>`` (docs/kimi.md,
"Chat template"). The parser takes the output as token ids (:meth:`ToolCallParser.feed_ids`) or
as text chunks (:meth:`ToolCallParser.feed_text`) and returns events as soon as they are
known: :class:`ContentDelta`, :class:`ReasoningDelta`, and each :class:`ToolCall` when its
``<|tool_call_end|>`` arrives, so a client can start the tool before the turn ends.

Tolerated variants seen in the wild: the singular ``<|tool_call_section_begin|>`` /
``<|tool_call_section_end|>``, ids without the ``functions.`` prefix (``search:0``), a call
without a section marker, whitespace around ids and arguments. Problems never raise: they
become :class:`ToolCallProblem` events (``invalid_arguments``, ``bad_id``, ``incomplete``,
``unexpected_marker``). How the text is cut into chunks never changes the result.

Example:
    >>> p = ToolCallParser()
    >>> events = p.feed_text('Let me look.<|tool_calls_section_begin|><|tool_call_begin|>functions.ls:0'
    ...                      '<|tool_call_argument_begin|>{"path": "."}<|tool_call_end|>')
    >>> [type(e).__name__ for e in events]
    ['ContentDelta', 'ToolCall']
    >>> p.tool_calls[0].to_dict()
    {'id': 'functions.ls:0', 'name': 'ls', 'arguments': '{"path": "."}'}
"""

from __future__ import annotations

import codecs
import enum
import json
import re
from dataclasses import dataclass, field

from kvtier.jsontypes import json_type_name

SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
SECTION_END = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
THINK_BEGIN, THINK_END = "<think>", "</think>"
END_OF_TURN = ("<|im_end|>", "[EOS]")
MARKERS = (
    *SECTION_BEGIN,
    *SECTION_END,
    CALL_BEGIN,
    ARGUMENT_BEGIN,
    CALL_END,
    THINK_BEGIN,
    THINK_END,
    *END_OF_TURN,
)
_MARKER_RE = re.compile(
    "|".join(re.escape(m) for m in sorted(MARKERS, key=len, reverse=True))
)
_PREFIXES = frozenset(m[:i] for m in MARKERS for i in range(1, len(m)))
_MAX_MARKER = max(map(len, MARKERS))
_ID_RE = re.compile(
    r"(?:functions\.)?(?P<name>[^:\s]+?)(?::(?P<index>\d+))?", re.DOTALL
)


@dataclass(frozen=True)
class ContentDelta:
    """Answer text, in arrival order."""

    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    """Reasoning text (between ``<think>`` and ``</think>``)."""

    text: str


@dataclass(frozen=True)
class ToolCall:
    """One complete call.

    Attributes:
        index: position among this output's calls (problems count too).
        id: the call id as the model wrote it, stripped (``functions.NAME:IDX``, or a variant);
            echo it back as ``tool_call_id`` so the next prompt matches what the model saw.
        name: the function name taken from the id.
        arguments: the arguments JSON text, stripped of surrounding whitespace (a JSON object,
            as OpenAI-style tool calls require).
    """

    index: int
    id: str
    name: str
    arguments: str

    def to_dict(self) -> dict:
        """``{"id", "name", "arguments"}`` (arguments as a JSON string)."""
        return {"id": self.id, "name": self.name, "arguments": self.arguments}


@dataclass(frozen=True)
class ToolCallProblem:
    """A call that could not be returned as a :class:`ToolCall`, or a marker out of place.

    Attributes:
        kind: ``invalid_arguments`` (not a JSON object), ``bad_id`` (no function name in the id),
            ``incomplete`` (the output ended, or a new call began, inside this call),
            ``unexpected_marker`` (a marker where it cannot appear; ignored).
        message: what went wrong, for people.
        index: the call's position (as :attr:`ToolCall.index`), None for a stray marker.
        id: the raw id text seen so far ("" if none).
        arguments: the raw arguments text seen so far ("" if none).
    """

    kind: str
    message: str
    index: int | None = None
    id: str = ""
    arguments: str = ""

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "message": self.message,
            "index": self.index,
            "id": self.id,
            "arguments": self.arguments,
        }


class ParsedOutput:
    """What a streaming output parser has accumulated: ``content``, ``reasoning``,
    ``tool_calls`` and ``problems`` (attributes the parser keeps), read as one dict."""

    content: str
    reasoning: str
    tool_calls: list[ToolCall]
    problems: list[ToolCallProblem]

    def result(self) -> dict:
        """``{"content", "reasoning_content", "tool_calls", "tool_call_problems"}`` so far
        (calls and problems as dicts)."""
        return {
            "content": self.content,
            "reasoning_content": self.reasoning,
            "tool_calls": [c.to_dict() for c in self.tool_calls],
            "tool_call_problems": [p.to_dict() for p in self.problems],
        }


class _State(enum.Enum):
    CONTENT = "content"
    REASONING = "reasoning"
    SECTION = "section"
    CALL_ID = "call_id"
    ARGUMENTS = "arguments"
    ENDED = "ended"


def parse_call(
    index: int, raw_id: str, raw_arguments: str
) -> ToolCall | ToolCallProblem:
    """Turn the raw id and arguments text of one call into a :class:`ToolCall` or a problem.

    Args:
        index: the call's position among this output's calls.
        raw_id: the id text between ``<|tool_call_begin|>`` and ``<|tool_call_argument_begin|>``.
        raw_arguments: the arguments text; it must be a JSON object (OpenAI-style tool calls).

    Returns:
        A :class:`ToolCall`, or a :class:`ToolCallProblem` of kind ``bad_id`` (no function name
        in the id) or ``invalid_arguments`` (not JSON, or JSON that is not an object). Never raises.
    """
    m = _ID_RE.fullmatch(raw_id.strip())
    if m is None:
        return ToolCallProblem(
            "bad_id",
            f"call id {raw_id.strip()!r} names no function (expected "
            "'functions.NAME:IDX')",
            index,
            raw_id,
            raw_arguments,
        )
    args = raw_arguments.strip()
    wrong = _arguments_error(m["name"], args)
    if wrong is not None:
        return ToolCallProblem("invalid_arguments", wrong, index, raw_id, raw_arguments)
    return ToolCall(index, raw_id.strip(), m["name"], args)


def _arguments_error(name: str, args: str) -> str | None:
    """Why ``args`` is not a JSON object, for the message of an ``invalid_arguments`` problem;
    None when it is one."""
    try:
        value = json.loads(args)
    except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than Python's stack
        return f"arguments of {name!r} are not valid JSON: {type(e).__name__}: {e}"
    if not isinstance(value, dict):
        return (
            f"arguments of {name!r} must be a JSON object, got a JSON "
            f"{json_type_name(value)}: {args[:60]!r}"
        )
    return None


@dataclass
class ToolCallParser(ParsedOutput):
    """Incremental parser of one assistant output (see the module docstring).

    Args:
        special_tokens: ``{id: string}`` of the tokenizer's special tokens, needed by
            :meth:`feed_ids` (``KimiTokenizer.special_ids``); ordinary ids are decoded with
            ``decode_bytes``.
        decode_bytes: ``ids -> bytes`` for ordinary ids (``KimiTokenizer.decode_bytes``).
        in_reasoning: the prompt already opened ``<think>`` (output starts inside reasoning).

    Attributes (accumulated):
        content, reasoning: the text so far.
        tool_calls: complete calls, in order.
        problems: :class:`ToolCallProblem` s, in order.
    """

    special_tokens: dict[int, str] | None = None
    decode_bytes: object = None
    in_reasoning: bool = False
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    problems: list[ToolCallProblem] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._state = _State.REASONING if self.in_reasoning else _State.CONTENT
        self._pending = ""  # text held back: it may be the start of a marker
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._id = self._args = ""
        self._index = 0
        self._after_section = False

    @classmethod
    def for_tokenizer(cls, tokenizer, **kwargs) -> ToolCallParser:
        """A parser that can :meth:`feed_ids` for ``tokenizer`` (a :class:`~kvtier.tokenize.KimiTokenizer`)."""
        return cls(
            special_tokens=tokenizer.special_ids,
            decode_bytes=tokenizer.decode_bytes,
            **kwargs,
        )

    # -- input -----------------------------------------------------------------------------------
    def feed_ids(self, ids) -> list:
        """Feed generated token ids; returns the events they complete.

        Raises:
            ValueError: the parser was built without ``special_tokens``/``decode_bytes``.
        """
        if self.special_tokens is None or self.decode_bytes is None:
            raise ValueError(
                "feed_ids needs special_tokens and decode_bytes (use ToolCallParser.for_tokenizer)"
            )
        parts = []
        for i in ids:
            special = self.special_tokens.get(i)
            if special is not None:
                parts.append(self._utf8.decode(b"", final=True) + special)
                self._utf8.reset()
            else:
                parts.append(self._utf8.decode(self.decode_bytes([i])))
        return self.feed_text("".join(parts))

    def feed_text(self, text: str) -> list:
        """Feed a chunk of output text (special tokens as their strings); returns new events."""
        events: list = []
        buf, self._pending = self._pending + text, ""
        pos = 0
        for m in _MARKER_RE.finditer(buf):
            self._text(buf[pos : m.start()], events)
            self._marker(m.group(), events)
            pos = m.end()
        tail = buf[pos:]
        keep = next(
            (
                k
                for k in range(min(len(tail), _MAX_MARKER - 1), 0, -1)
                if tail[-k:] in _PREFIXES
            ),
            0,
        )
        self._text(tail[: len(tail) - keep], events)
        self._pending = tail[len(tail) - keep :]
        return events

    def finish(self) -> list:
        """End of output: flush held-back text and report a call left open as ``incomplete``."""
        events: list = []
        rest = self._pending + self._utf8.decode(b"", final=True)
        self._pending = ""
        self._text(rest, events)
        if self._state in (_State.CALL_ID, _State.ARGUMENTS):
            self._problem(
                events,
                ToolCallProblem(
                    "incomplete",
                    "the output ended inside a tool call (no <|tool_call_end|>)",
                    self._index,
                    self._id,
                    self._args,
                ),
            )
            self._index += 1
        self._state = _State.ENDED
        return events

    # -- results ---------------------------------------------------------------------------------
    # -- machinery -------------------------------------------------------------------------------
    def _text(self, text: str, events: list) -> None:
        if not text:
            return
        s = self._state
        if s is _State.CONTENT:
            self.content += text
            events.append(ContentDelta(text))
        elif s is _State.REASONING:
            self.reasoning += text
            events.append(ReasoningDelta(text))
        elif s is _State.CALL_ID:
            self._id += text
        elif s is _State.ARGUMENTS:
            self._args += text
        # SECTION: separators between calls are dropped; ENDED: text after the end of turn is ignored.

    def _problem(self, events: list, problem: ToolCallProblem) -> None:
        self.problems.append(problem)
        events.append(problem)

    def _unexpected(self, marker: str, events: list) -> None:
        self._problem(
            events,
            ToolCallProblem(
                "unexpected_marker", f"{marker} in state {self._state.value}; ignored"
            ),
        )

    def _close_call(self, events: list) -> None:
        outcome = parse_call(self._index, self._id, self._args)
        (
            self.tool_calls.append(outcome)
            if isinstance(outcome, ToolCall)
            else self.problems.append(outcome)
        )
        events.append(outcome)
        self._index += 1
        self._id = self._args = ""
        self._state = _State.SECTION

    def _marker(self, marker: str, events: list) -> None:
        s = self._state
        if s is _State.ENDED:
            return
        if marker in END_OF_TURN:
            events.extend(self.finish())
        elif marker == THINK_BEGIN and s is _State.CONTENT and not self.content.strip():
            self._state = _State.REASONING
        elif marker == THINK_END and s is _State.REASONING:
            self._state = _State.CONTENT
        elif marker in SECTION_BEGIN and s is _State.CONTENT:
            self._state = _State.SECTION
        elif marker in SECTION_END and s is _State.SECTION:
            self._state = _State.CONTENT
        elif marker == CALL_BEGIN and s in (
            _State.CONTENT,
            _State.SECTION,
            _State.CALL_ID,
            _State.ARGUMENTS,
        ):
            if s in (_State.CALL_ID, _State.ARGUMENTS):
                self._problem(
                    events,
                    ToolCallProblem(
                        "incomplete",
                        "a new call began before <|tool_call_end|>",
                        self._index,
                        self._id,
                        self._args,
                    ),
                )
                self._index += 1
            self._id = self._args = ""
            self._state = _State.CALL_ID
        elif marker == ARGUMENT_BEGIN and s is _State.CALL_ID:
            self._state = _State.ARGUMENTS
        elif marker == CALL_END and s in (_State.CALL_ID, _State.ARGUMENTS):
            self._close_call(events)
        else:
            self._unexpected(marker, events)
