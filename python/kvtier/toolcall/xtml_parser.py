"""Streaming parser of Kimi K3 assistant output (XTML): reasoning, content and typed tool calls.

K3 writes an assistant turn as channels between its control tokens ``<|open|>``, ``<|close|>``
and ``<|sep|>`` (``docs/k3.md``, "Chat format (XTML)")::

    <|open|>think<|sep|>REASONING<|close|>think<|sep|>
    <|open|>response<|sep|>CONTENT<|close|>response<|sep|>
    <|open|>tools<|sep|>
      <|open|>call tool="NAME" index="1"<|sep|>
        <|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|> ...
      <|close|>call<|sep|> ...
    <|close|>tools<|sep|>
    <|close|>message<|sep|><|end_of_msg|>

The generation prompt already opens ``think`` (thinking on) or ``response`` (thinking off), so
the output usually starts inside that channel: :meth:`XtmlParser.for_prompt` reads which from
the prompt's last tag. A ``type="string"`` value is raw text; any other type is JSON
(``json.loads``; text that is not JSON stays a string, so a cut value never raises). Attribute
values are unescaped (``&quot;`` -> ``"``, then ``&amp;`` -> ``&``: the inverse of the
renderer's ``&`` then ``"``). A call whose arguments the renderer could not parse as JSON is
written ``<|open|>json type="object"<|sep|>RAW<|close|>json<|sep|>`` instead of argument blocks;
that block is read back as the call's arguments text.

Events are those of the K2 parser (:mod:`kvtier.toolcall.parser`): :class:`ContentDelta`,
:class:`ReasoningDelta`, each :class:`ToolCall` when its ``<|close|>call<|sep|>`` arrives, and
:class:`ToolCallProblem` s (``bad_id``: a call without a ``tool`` name; ``invalid_arguments``:
a json block that is not a JSON object; ``incomplete``: the output or the tools channel ended
inside a call; ``unexpected_marker``: a tag out of place, ignored). A call's ``arguments`` is
``json.dumps(args, ensure_ascii=False)`` of its decoded arguments (what an OpenAI client reads
back), its ``id`` ``functions.NAME:I`` with ``I`` its position among this output's calls.

Token ids in (:meth:`XtmlParser.feed_ids`): only K3's control ids are structure; a control
token's spelling written as ordinary text (``"<|sep|>"`` as bytes) stays text. Text in
(:meth:`XtmlParser.feed_text`): the spellings are the markers. Inside a value (reasoning,
content, an argument), a tag that does not end that value is kept as text; the first
``<|close|>call<|sep|>`` ends a call even inside an argument (an argument left open is dropped),
as vLLM's ``kimi_k3`` parser reads it. How the input is cut into chunks never changes the result.

Example:
    >>> p = XtmlParser(channel="response")
    >>> events = p.feed_text('Looking.<|close|>response<|sep|><|open|>tools<|sep|>'
    ...     '<|open|>call tool="ls" index="1"<|sep|><|open|>argument key="depth" type="number"<|sep|>'
    ...     '2<|close|>argument<|sep|><|close|>call<|sep|>')
    >>> [type(e).__name__ for e in events]
    ['ContentDelta', 'ToolCall']
    >>> p.tool_calls[0].to_dict()
    {'id': 'functions.ls:0', 'name': 'ls', 'arguments': '{"depth": 2}'}
"""

from __future__ import annotations

import codecs
import json
import re
from dataclasses import dataclass, field

from kvtier.jsontypes import json_type_name
from kvtier.tokenize.xtml import escape_attr
from kvtier.toolcall.parser import ContentDelta, ParsedOutput, ReasoningDelta, ToolCall, ToolCallProblem

OPEN, CLOSE, SEP = "<|open|>", "<|close|>", "<|sep|>"
END_OF_MSG = "<|end_of_msg|>"
EOS = "[EOS]"
CONTROL = (OPEN, CLOSE, SEP, END_OF_MSG, EOS)
_CONTROL_RE = re.compile("|".join(re.escape(m) for m in CONTROL))
_PREFIXES = frozenset(m[:i] for m in CONTROL for i in range(1, len(m)))
_MAX_MARKER = max(map(len, CONTROL))
_ATTR_RE = re.compile(r'(?P<k>\w+)="(?P<v>[^"]*)"')
_WITH_ATTRS = re.compile(r"\s*(?P<name>call|argument|json)\s+(?P<attrs>.*)", re.DOTALL)

# channels (where text goes) and the structural states between them
TOP, THINK, RESPONSE, TOOLS, CALL, ARGUMENT, JSON_BLOCK, ENDED = (
    "top", "think", "response", "tools", "call", "argument", "json", "ended")
_VALUE_STATES = (THINK, RESPONSE, ARGUMENT, JSON_BLOCK)
_CLOSES = {THINK: "think", RESPONSE: "response", ARGUMENT: "argument", JSON_BLOCK: "json"}


def unescape_attr(value: str) -> str:
    """An attribute value as written (``&quot;`` -> ``"``, then ``&amp;`` -> ``&``)."""
    return value.replace("&quot;", '"').replace("&amp;", "&")


def attributes(text: str) -> dict[str, str]:
    """``{key: value}`` of the ``key="value"`` pairs in a tag's header, values unescaped."""
    return {m["k"]: unescape_attr(m["v"]) for m in _ATTR_RE.finditer(text)}


def decode_value(xtml_type: str, raw: str):
    """An argument's value: ``raw`` itself for ``string``, else ``json.loads(raw)`` (``raw`` when
    it is not JSON)."""
    if xtml_type == "string":
        return raw
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return raw


@dataclass
class _Call:
    name: str
    args: dict = field(default_factory=dict)
    json_block: str | None = None
    arg_key: str = ""
    arg_type: str = "string"
    value: str = ""


@dataclass
class XtmlParser(ParsedOutput):
    """Incremental parser of one K3 assistant output (see the module docstring).

    Args:
        control_ids: ``{id: spelling}`` of K3's control tokens (``<|open|>``, ``<|close|>``,
            ``<|sep|>``, ``<|end_of_msg|>``, ``[EOS]``); needed by :meth:`feed_ids`. Other ids are
            text, decoded with ``decode_bytes``.
        decode_bytes: ``ids -> bytes`` for the other ids (``KimiTokenizer.decode_bytes``).
        channel: where the output starts: ``"think"`` or ``"response"`` (the generation prompt
            opened it) or ``"top"`` (before any channel; text there is content until one opens).

    Attributes (accumulated):
        content, reasoning: the text so far.
        tool_calls: complete calls, in order; problems: :class:`ToolCallProblem` s, in order.

    Raises:
        ValueError: ``channel`` is not one of the three.
    """

    control_ids: dict[int, str] | None = None
    decode_bytes: object = None
    channel: str = TOP
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    problems: list[ToolCallProblem] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.channel not in (TOP, THINK, RESPONSE):
            raise ValueError(f"channel must be 'top', 'think' or 'response', got {self.channel!r}")
        self._state = self.channel
        self._seen_channel = self.channel != TOP  # text at the top level is content until a channel opens
        self._tag: tuple[str, str] | None = None  # (OPEN or CLOSE, header so far) of a tag being read
        self._pending = ""  # feed_text: text that may be the start of a marker
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._call: _Call | None = None
        self._index = 0  # calls and call problems so far

    @classmethod
    def for_tokenizer(cls, tokenizer, prompt_ids=(), **kwargs) -> XtmlParser:
        """A parser that can :meth:`feed_ids` for ``tokenizer`` (K3's control tokens among its
        ``special_tokens``), starting in the channel the prompt's last tag opened."""
        controls = {tokenizer.special_tokens[s]: s for s in CONTROL if s in tokenizer.special_tokens}
        kwargs.setdefault("channel", opened_channel(prompt_ids, tokenizer))
        return cls(control_ids=controls, decode_bytes=tokenizer.decode_bytes, **kwargs)

    # -- input -----------------------------------------------------------------------------------
    def feed_ids(self, ids) -> list:
        """Feed generated token ids; returns the events they complete.

        Raises:
            ValueError: the parser was built without ``control_ids`` / ``decode_bytes``.
        """
        if self.control_ids is None or self.decode_bytes is None:
            raise ValueError("feed_ids needs control_ids and decode_bytes (use XtmlParser.for_tokenizer)")
        events: list = []
        text = ""
        for i in ids:
            control = self.control_ids.get(i)
            if control is None:
                text += self._utf8.decode(self.decode_bytes([i]))
                continue
            self._text(text + self._utf8.decode(b"", final=True), events)
            self._utf8.reset()
            text = ""
            self._control(control, events)
        self._text(text, events)
        return events

    def feed_text(self, text: str) -> list:
        """Feed a chunk of output text (control tokens as their spellings); returns new events."""
        events: list = []
        buf, self._pending = self._pending + text, ""
        pos = 0
        for m in _CONTROL_RE.finditer(buf):
            self._text(buf[pos:m.start()], events)
            self._control(m.group(), events)
            pos = m.end()
        tail = buf[pos:]
        keep = next((k for k in range(min(len(tail), _MAX_MARKER - 1), 0, -1) if tail[-k:] in _PREFIXES), 0)
        self._text(tail[:len(tail) - keep], events)
        self._pending = tail[len(tail) - keep:]
        return events

    def finish(self) -> list:
        """End of output: flush held-back text and report a call left open as ``incomplete``."""
        events: list = []
        self._text(self._pending + self._utf8.decode(b"", final=True), events)
        self._pending = ""
        self._end(events)
        return events

    # -- results ---------------------------------------------------------------------------------
    # -- machinery -------------------------------------------------------------------------------
    def _text(self, text: str, events: list) -> None:
        if not text:
            return
        if self._tag is not None:
            self._tag = (self._tag[0], self._tag[1] + text)
            return
        self._emit_text(text, events)

    def _emit_text(self, text: str, events: list) -> None:
        s = self._state
        if s == RESPONSE or (s == TOP and not self._seen_channel):
            self.content += text
            events.append(ContentDelta(text))
        elif s == THINK:
            self.reasoning += text
            events.append(ReasoningDelta(text))
        elif s == ARGUMENT or s == JSON_BLOCK:
            self._call.value += text
        # TOOLS, CALL, TOP after a channel: text between tags is dropped; ENDED: after the turn

    def _control(self, control: str, events: list) -> None:
        if self._state == ENDED:
            return
        if control in (END_OF_MSG, EOS):
            self._flush_tag(events)
            self._end(events)
        elif control in (OPEN, CLOSE):
            self._flush_tag(events)
            self._tag = (control, "")
        elif self._tag is None:  # a <|sep|> that ends no tag
            self._stray(SEP, events)
        else:
            kind, header = self._tag
            self._tag = None
            self._on_tag(kind, header, events)

    def _flush_tag(self, events: list) -> None:
        """A tag cut short by another control token: text inside a value, else a problem."""
        if self._tag is not None:
            kind, header = self._tag
            self._tag = None
            self._stray(kind + header, events)

    def _stray(self, spelling: str, events: list) -> None:
        if self._state in _VALUE_STATES:
            self._emit_text(spelling, events)
        else:
            self._problem(events, ToolCallProblem(
                "unexpected_marker", f"{spelling!r} in state {self._state}; ignored"))

    def _on_tag(self, kind: str, header: str, events: list) -> None:
        s, name = self._state, header.strip()
        if kind == CLOSE and name == "call" and s in (CALL, ARGUMENT, JSON_BLOCK):
            self._close_call(events)
        elif kind == CLOSE and name == "tools" and s in (TOOLS, CALL, ARGUMENT, JSON_BLOCK):
            self._incomplete(events, "the tools channel closed inside a call")
            self._state = TOP
        elif s in _VALUE_STATES:
            self._in_value(kind, name, header, events)
        elif kind == OPEN and s == TOP and name in ("think", "response", "tools"):
            self._state = {"think": THINK, "response": RESPONSE, "tools": TOOLS}[name]
            self._seen_channel = True
        elif kind == CLOSE and s == TOP and name in ("message", "think", "response"):
            pass  # the message's end (before <|end_of_msg|>), or a channel the prompt opened
        elif kind == OPEN and s == TOOLS and (m := _WITH_ATTRS.fullmatch(header)) and m["name"] == "call":
            self._open_call(m["attrs"], events)
        elif kind == OPEN and s == CALL and (m := _WITH_ATTRS.fullmatch(header)) and m["name"] != "call":
            attrs = attributes(m["attrs"])
            self._call.arg_key, self._call.arg_type = attrs.get("key", ""), attrs.get("type", "string")
            self._call.value = ""
            self._state = ARGUMENT if m["name"] == "argument" else JSON_BLOCK
        else:
            self._stray(kind + header + SEP, events)

    def _in_value(self, kind: str, name: str, header: str, events: list) -> None:
        s = self._state
        if kind == CLOSE and name == _CLOSES[s]:
            if s == ARGUMENT:
                self._call.args[self._call.arg_key] = decode_value(self._call.arg_type, self._call.value)
            elif s == JSON_BLOCK:
                self._call.json_block = self._call.value
            self._state = CALL if s in (ARGUMENT, JSON_BLOCK) else TOP
        elif s == RESPONSE and kind == OPEN and name == "tools":
            self._state = TOOLS  # an unclosed response ends where the tools channel begins
        elif s == RESPONSE and kind == CLOSE and name == "message":
            self._state = TOP
        else:
            self._emit_text(kind + header + SEP, events)

    def _open_call(self, attrs: str, events: list) -> None:
        self._call = _Call(attributes(attrs).get("tool", ""))
        self._state = CALL

    def _close_call(self, events: list) -> None:
        call, self._call = self._call, None
        self._state = TOOLS
        index, self._index = self._index, self._index + 1
        if not call.name:
            self._problem(events, ToolCallProblem(
                "bad_id", "a call without a tool=\"NAME\" attribute", index, "", json.dumps(call.args)))
            return
        call_id = f"functions.{call.name}:{index}"
        if call.json_block is not None and not call.args:
            wrong = _not_an_object(call.name, call.json_block)
            if wrong is not None:
                self._problem(events, ToolCallProblem("invalid_arguments", wrong, index, call_id, call.json_block))
                return
            arguments = call.json_block
        else:
            arguments = json.dumps(call.args, ensure_ascii=False)
        done = ToolCall(index, call_id, call.name, arguments)
        self.tool_calls.append(done)
        events.append(done)

    def _incomplete(self, events: list, why: str) -> None:
        if self._call is None:
            return
        call, self._call = self._call, None
        self._problem(events, ToolCallProblem(
            "incomplete", why, self._index, f"functions.{call.name}:{self._index}" if call.name else "",
            json.dumps(call.args, ensure_ascii=False)))
        self._index += 1

    def _end(self, events: list) -> None:
        if self._tag is not None:
            self._flush_tag(events)
        self._incomplete(events, "the output ended inside a tool call (no <|close|>call<|sep|>)")
        self._state = ENDED

    def _problem(self, events: list, problem: ToolCallProblem) -> None:
        self.problems.append(problem)
        events.append(problem)


def _not_an_object(name: str, raw: str) -> str | None:
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as e:
        return f"the json block of {name!r} is not valid JSON: {type(e).__name__}: {e}"
    if not isinstance(value, dict):
        return f"the json block of {name!r} must be a JSON object, got a JSON {json_type_name(value)}"
    return None


def channel_opening(prompt_ids, tokenizer) -> list[int]:
    """The ids of the tag a K3 prompt ends with when it opens the ``think`` or ``response``
    channel (``<|open|>think<|sep|>``, ``<|open|>response<|sep|>``: the generation prompt's
    last tag), else ``[]``. The turn grammar is primed with them.

    Args:
        prompt_ids: the prompt's token ids (only the last few are read).
        tokenizer: a tokenizer with K3's control tokens in ``special_tokens``.
    """
    specials = tokenizer.special_tokens
    if OPEN not in specials or SEP not in specials:
        return []
    tail = [int(i) for i in prompt_ids[-8:]]
    if len(tail) < 3 or tail[-1] != specials[SEP] or specials[OPEN] not in tail:
        return []
    start = len(tail) - 1 - tail[::-1].index(specials[OPEN])
    name = tokenizer.decode(tail[start + 1:-1]).strip()
    return tail[start:] if name in (THINK, RESPONSE) else []


def opened_channel(prompt_ids, tokenizer) -> str:
    """The channel a K3 prompt leaves open at its end: ``"think"`` or ``"response"`` when it ends
    with ``<|open|>think<|sep|>`` / ``<|open|>response<|sep|>`` (the generation prompt), else
    ``"top"`` (see :func:`channel_opening`)."""
    tag = channel_opening(prompt_ids, tokenizer)
    return tokenizer.decode(tag[1:-1]).strip() if tag else TOP


__all__ = ["XtmlParser", "attributes", "channel_opening", "decode_value", "escape_attr", "opened_channel",
           "unescape_attr"]
