"""Text chat sessions as a workload: ``kvtier bench --conversations PATH``.

A JSONL file, one JSON value per line, in either of two shapes (they may be mixed):

- **A whole conversation**: a list of OpenAI-style messages, or an object with ``messages``
  (and optionally ``tools`` and ``max_tokens``: an OpenAI chat-completions request) and no
  ``session_id``. It becomes one session. Each assistant message is the response of one turn
  whose prompt is every message before it; a conversation that ends with a non-assistant
  message has a last turn answering it. Think times are not in the text: a turn waits the
  median think time of the coding-agent traces (docs/workload.md: 9 s after a response with tool
  calls, 132 s after one without), times ``time_scale``, capped at ``max_think_s``.
- **One turn**: an object with ``session_id`` (a string) and ``messages``, the whole
  conversation as sent for that request; optional ``tools``, ``think_time_s`` (seconds before
  this turn, before scaling), ``output_tokens``. Lines with the same ``session_id`` are the
  turns of one session, in file order.

Response lengths: the recorded assistant message's rendered tokens (role header included), else
``output_tokens``, else the request's ``max_tokens``, else ``default_output_tokens``. During
the replay the model generates that many tokens (end-of-sequence ignored); the next turn's
prompt is the recorded conversation, encoded then by the session's
:class:`kvtier.tokenize.SessionEncoder` (timed inside TTFT), whose token buffer hands the block
hashes to the prefix lookup.

The role ``_input`` is read as ``system``, as the K2-Vendor-Verifier evaluation does with its
request files (``../shared/toolcalls/SOURCE.md``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from kvtier.bench.workload import (
    THINK_AFTER_END_TURN_Q,
    THINK_AFTER_TOOL_USE_Q,
    Session,
    TraceError,
    Turn,
    Workload,
)
from kvtier.tokenize import KimiTokenizer, SessionEncoder, render_messages

DEFAULT_OUTPUT_TOKENS = 64
_ROLE_ALIASES = {"_input": "system"}


@dataclass(frozen=True)
class ChatTurn:
    """The text of one turn: the conversation sent (OpenAI messages) and the tool declarations."""

    messages: tuple[dict, ...]
    tools: tuple[dict, ...] | None = None


@dataclass
class _TextTurn:
    chat: ChatTurn
    think_s: float | None  # None: from the previous turn's response (median think time)
    output_tokens: int | None
    response: dict | None  # the recorded assistant message, when there is one


def _fail(path: Path, line: int, what: str) -> TraceError:
    return TraceError(f"{path}:{line}: {what}")


def _messages(obj, path: Path, line: int) -> list[dict]:
    if not isinstance(obj, list) or not all(isinstance(m, dict) for m in obj):
        raise _fail(path, line, "messages must be a list of message objects")
    if not obj:
        raise _fail(path, line, "messages is empty")
    return [dict(m, role=_ROLE_ALIASES[m["role"]]) if _ROLE_ALIASES.get(str(m.get("role"))) else m for m in obj]


def _tools(doc: dict, path: Path, line: int) -> tuple[dict, ...] | None:
    tools = doc.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _fail(path, line, f"tools must be a list, got {type(tools).__name__}")
    return tuple(tools)


def _opt_number(doc: dict, key: str, path: Path, line: int, kind=float, minimum=0):
    value = doc.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, kind | int) or not minimum <= value < math.inf:
        raise _fail(path, line, f"{key} must be a finite number >= {minimum}, got {value!r}")
    return kind(value)


def _split_conversation(msgs: list[dict], tools, max_tokens: int | None) -> list[_TextTurn]:
    """One turn per assistant message (prompt = the messages before it), plus a final open turn."""
    turns = []
    for i, m in enumerate(msgs):
        if m.get("role") == "assistant" and i > 0:
            turns.append(_TextTurn(ChatTurn(tuple(msgs[:i]), tools), None, None, m))
    if msgs[-1].get("role") != "assistant":
        turns.append(_TextTurn(ChatTurn(tuple(msgs), tools), None, max_tokens, None))
    return turns


def _read(path: Path) -> list[tuple[str, list[_TextTurn]]]:
    sessions: dict[str, list[_TextTurn]] = {}
    auto_ids: set[str] = set()
    with open(path, "rb") as f:
        for line, text in _lines(f, path):
            if not text.strip():
                continue
            try:
                doc = json.loads(text)
            except json.JSONDecodeError as e:
                raise _fail(path, line, f"not JSON ({e.msg})") from None
            if isinstance(doc, list):
                doc = {"messages": doc}
            if not isinstance(doc, dict) or "messages" not in doc:
                raise _fail(path, line, "expected a list of messages or an object with 'messages'")
            msgs, tools = _messages(doc["messages"], path, line), _tools(doc, path, line)
            sid = doc.get("session_id")
            if sid is None:
                turns = _split_conversation(msgs, tools, _opt_number(doc, "max_tokens", path, line, int, 1))
                if turns:
                    sid = f"{path.stem}:{line}"
                    if sid in sessions:
                        raise _fail(path, line, f"the conversation's session id {sid!r} is taken by an earlier session_id")
                    sessions[sid] = turns
                    auto_ids.add(sid)
                continue
            if not isinstance(sid, str) or not sid:
                raise _fail(path, line, f"session_id must be a non-empty string, got {sid!r}")
            if sid in auto_ids:
                raise _fail(path, line, f"session_id {sid!r} is the id of the whole conversation on an earlier line")
            turn = _TextTurn(ChatTurn(tuple(msgs), tools), _opt_number(doc, "think_time_s", path, line),
                             _opt_number(doc, "output_tokens", path, line, int, 1), None)
            sessions.setdefault(sid, []).append(turn)
    return list(sessions.items())


def _lines(f, path: Path):
    """``(line number, text)`` of a file opened in binary; undecodable UTF-8 names its line."""
    for line, raw in enumerate(f, 1):
        try:
            yield line, raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _fail(path, line, f"not UTF-8 ({e.reason} at byte {e.start} of the line)") from None


class _BlockIds:
    """Dense workload block ids from chained block hashes: equal prefix pages, equal ids."""

    def __init__(self) -> None:
        self._ids: dict[bytes, int] = {}
        self._next = 0

    def fresh(self) -> int:
        self._next += 1
        return self._next - 1

    def of(self, hashes: list[bytes], num_tokens: int, page_size: int) -> tuple[int, ...]:
        ids = [self._ids.setdefault(h, self._next + i) for i, h in enumerate(hashes)]
        self._next = max(self._next, max(ids, default=-1) + 1)
        if num_tokens % page_size:
            ids.append(self.fresh())  # a partial last page is never shared
        return tuple(ids)


def _response_tokens(tok: KimiTokenizer, response: dict | None) -> int | None:
    if response is None:
        return None
    part = render_messages([response], add_generation_prompt=False)[-1]
    return max(1, len(tok.encode(part)))


def load_conversations(path, tokenizer: KimiTokenizer, *, page_size: int = 16, time_scale: float = 1.0,
                       max_think_s: float = float("inf"), max_sessions: int | None = None,
                       max_turns: int | None = None, max_input_tokens: int | None = None,
                       default_output_tokens: int = DEFAULT_OUTPUT_TOKENS,
                       max_output_tokens: int | None = None) -> Workload:
    """Read text sessions (see the module notes) and encode them into a replayable workload.

    Every turn is encoded once here (incrementally, per session) to size the run and derive
    block ids; each :class:`~kvtier.bench.workload.Turn` keeps its text in ``chat`` so the
    replay encodes it again, as a server would.

    Args:
        path: a ``.jsonl`` file.
        tokenizer: the Kimi tokenizer.
        page_size: tokens per KV page (= ``Workload.block_size``).
        time_scale, max_think_s: as for traces (``think_time * time_scale``, capped; seconds).
        max_sessions: keep the first N sessions; max_turns: the first N turns of each.
        max_input_tokens: a session ends before its first turn with a longer prompt.
        default_output_tokens: response length when the file gives none.
        max_output_tokens: cap on every response length (requests often ask for 16K tokens).

    Returns:
        Workload with ``format == "conversations"``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        TraceError: malformed JSON or fields, or messages/tools the chat template rejects; the
            message names the file and line (or session and turn).
        ValueError: a scale or limit out of range.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"conversations file not found: {path}")
    if page_size < 1 or default_output_tokens < 1 or time_scale < 0 or max_think_s < 0:
        raise ValueError("need page_size >= 1, default_output_tokens >= 1, time_scale >= 0 and max_think_s >= 0")
    if max_output_tokens is not None and max_output_tokens < 1:
        raise ValueError(f"max_output_tokens must be >= 1, got {max_output_tokens}")
    block_ids, sessions = _BlockIds(), []
    for sid, text_turns in _read(path):
        if max_sessions is not None and len(sessions) >= max_sessions:
            break
        turns = _encode_session(sid, text_turns[:max_turns], tokenizer, page_size, block_ids, time_scale,
                                max_think_s, max_input_tokens, default_output_tokens, max_output_tokens)
        if turns:
            sessions.append(Session(sid, tuple(turns)))
    if not sessions:
        raise TraceError(f"{path}: no session with a turn that fits")
    return Workload(name=path.stem, source=str(path), format="conversations", block_size=page_size,
                    token_scale=1.0, time_scale=time_scale, max_think_s=max_think_s, sessions=tuple(sessions))


def _encode_session(sid: str, text_turns: list[_TextTurn], tok: KimiTokenizer, page_size: int, block_ids: _BlockIds,
                    time_scale: float, max_think_s: float, max_input_tokens: int | None,
                    default_output_tokens: int, max_output_tokens: int | None) -> list[Turn]:
    enc = SessionEncoder(tok, page_size=page_size)
    turns: list[Turn] = []
    prev_stop = ""
    for k, t in enumerate(text_turns):
        try:
            enc.append(list(t.chat.messages), list(t.chat.tools) if t.chat.tools else None)
        except ValueError as e:
            raise TraceError(f"session {sid!r} turn {k}: {e}") from None
        n = len(enc)
        if max_input_tokens is not None and n > max_input_tokens:
            break
        out = t.output_tokens or _response_tokens(tok, t.response) or default_output_tokens
        out = min(out, max_output_tokens or out)
        if max_input_tokens is not None:  # the engine stops at the context length anyway
            out = max(1, min(out, max_input_tokens - n))
        stop = "" if t.response is None else ("tool_use" if t.response.get("tool_calls") else "end_turn")
        if k == 0:
            think = 0.0
        elif t.think_s is not None:
            think = t.think_s
        else:
            think = THINK_AFTER_TOOL_USE_Q[1] if prev_stop == "tool_use" else THINK_AFTER_END_TURN_Q[1]
        turns.append(Turn(input_tokens=n, output_tokens=out, block_ids=block_ids.of(enc.block_hashes() or [], n, page_size),
                          think_time_s=min(think * time_scale, max_think_s), stop=stop, chat=t.chat))
        prev_stop = stop
    return turns


__all__ = ["ChatTurn", "DEFAULT_OUTPUT_TOKENS", "load_conversations"]
