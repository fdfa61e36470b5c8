"""The turns a session sampled, kept by message: what lets the next turn reuse the ids the model
generated instead of a re-encoding of the text the client sends back.

A client sends the assistant message back in its own serialisation (a re-dumped ``arguments``
string, Anthropic's ``input`` object, an SDK's ``model_dump()``); the tokens the model sampled
are the ones in the cache. :func:`message_key` is what two such messages must share to be the
same turn: the text, the reasoning, and the tool calls' names and JSON-equal arguments, in order
(call ids and field spelling left out). :class:`SampledTurns` keeps, per message index, the key of
the message a turn generated and what the session encoder needs to put its sampled ids back.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"type": "text", "text": ...}] parts
        return "".join(p.get("text", "") for p in value if isinstance(p, dict) and isinstance(p.get("text"), str))
    return repr(value)


def _arguments(args: Any) -> str:
    """Canonical JSON of a call's arguments (a JSON string or an object); text that is not JSON
    stays as it is."""
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return "raw:" + args
    try:
        return json.dumps(args, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError):
        return "raw:" + repr(args)


def message_key(msg: Any) -> tuple | None:
    """What an assistant message must equal to be the turn a session generated.

    Args:
        msg: an OpenAI-style message dict (``content`` a string, None or text parts;
            ``reasoning_content`` or ``reasoning``; ``tool_calls`` with ``function.name`` and
            ``function.arguments`` as a JSON string or an object).

    Returns:
        ``(content, reasoning, ((name, canonical arguments JSON), ...))``; None for anything that
        is not an assistant message dict. Call ids are left out.
    """
    if not isinstance(msg, dict) or msg.get("role") != "assistant":
        return None
    reasoning = msg.get("reasoning_content")
    if reasoning is None:
        reasoning = msg.get("reasoning")
    calls = []
    for call in msg.get("tool_calls") or []:
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            return None
        calls.append((fn.get("name"), _arguments(fn.get("arguments"))))
    return _text(msg.get("content")), _text(reasoning), tuple(calls)


@dataclasses.dataclass
class SampledTurn:
    """One generated assistant message of a session.

    Attributes:
        index: its position in the conversation (``messages[index]``).
        key: :func:`message_key` of the message the API returned.
        ids: the ids of the message as the prompt holds them (the encoder decides what they span).
        text: for K2's template, the text those ids stand for (compared by the encoder).
        placed: a later prompt has held them.
    """

    index: int
    key: tuple
    ids: tuple[int, ...]
    text: str = ""
    placed: bool = False


class SampledTurns:
    """The :class:`SampledTurn` s of one session, by message index."""

    def __init__(self) -> None:
        self.turns: dict[int, SampledTurn] = {}

    def add(self, turn: SampledTurn) -> None:
        """Keep ``turn``; a turn at a later or equal index (an older future) is dropped."""
        self.drop_from(turn.index)
        self.turns[turn.index] = turn

    def match(self, index: int, msg: Any) -> SampledTurn | None:
        """The turn kept at ``index`` if ``msg`` is that turn (:func:`message_key` equal); a kept
        turn that ``msg`` does not equal is dropped with every later one."""
        turn = self.turns.get(index)
        if turn is None:
            return None
        if message_key(msg) == turn.key:
            return turn
        self.drop_from(index)
        return None

    def drop_from(self, index: int) -> None:
        """Forget the turns at ``index`` and after (their messages are rendered as text again)."""
        for i in [i for i in self.turns if i >= index]:
            del self.turns[i]

    def __len__(self) -> int:
        return len(self.turns)
