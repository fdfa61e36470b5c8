"""Incremental, exact encoding of a growing chat session.

:class:`SessionEncoder` keeps a session's ids and, each turn, re-renders the conversation,
finds the first character where the rendering differs from what the ids encode, and re-encodes
only from the last *safe boundary* (the end of a special token) at or before it. Special tokens
split the text before BPE and the 25,000/400,000 windows restart in every segment, so the ids
after a boundary depend only on the text after it: canonical mode is exactly
``tokenizer.encode(render_chat(messages, ...))``, every turn. Edits to history, reasoning that
the thinking template drops and changed tools all move the first difference back; the ids after
the boundary are rolled back (``AppendResult.rolled_back``) and re-encoded, never kept stale.

Token-in-token-out mode ("tito") additionally keeps the ids the model sampled
(:meth:`SessionEncoder.append_generated`) for as long as the rendered conversation reproduces
their text exactly; if it does not (edited answer, dropped reasoning, a truncated turn whose
rendering differs inside it) the whole sampled turn is rolled back and re-encoded. Given the
assistant message the API returned for them, the sampled ids are kept by message instead: while
the client sends that message back (:func:`kvtier.tokenize.sampled.message_key`: same text,
reasoning, tool names and JSON-equal arguments, whatever its serialisation) after unchanged
earlier messages, it is rendered as the text of those ids, so they stay; from the first message
that differs, everything is rendered and encoded as in canonical mode.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import itertools
from collections.abc import Sequence
from typing import Literal, Protocol

from kvtier.tokenize.formats import ChatFormat
from kvtier.tokenize.chat import GENERATION_PROMPT, header_parts, history_end, render_message, render_tools
from kvtier.tokenize.sampled import SampledTurn, SampledTurns, message_key
from kvtier.tokenize.tokenizer import KimiTokenizer


class IdStore(Protocol):
    """Storage of a session's ids: what the C++ token buffer also offers."""

    def append(self, ids: Sequence[int]) -> None: ...
    def truncate(self, n: int) -> None: ...
    def ids(self) -> Sequence[int]: ...
    def __len__(self) -> int: ...


class ListIdStore:
    """:class:`IdStore` on a Python list."""

    def __init__(self) -> None:
        self._ids: list[int] = []

    def append(self, ids: Sequence[int]) -> None:
        self._ids.extend(ids)

    def truncate(self, n: int) -> None:
        if not 0 <= n <= len(self._ids):
            raise ValueError(f"truncate: n must be in [0, {len(self._ids)}], got {n}")
        del self._ids[n:]

    def ids(self) -> list[int]:
        return self._ids

    def __len__(self) -> int:
        return len(self._ids)


def default_store(page_size: int = 64, salt: bytes = b"") -> IdStore:
    """The C++ fused token buffer when the native extension has it, else a :class:`ListIdStore`."""
    try:
        from kvtier import _C

        if hasattr(_C, "TokenBuffer"):
            from kvtier.tokenize.buffer import TokenBuffer

            return TokenBuffer(page_size, salt)
    except ImportError:
        pass
    return ListIdStore()


@dataclasses.dataclass(frozen=True)
class AppendResult:
    """What one ``append`` changed: ``ids = ids[:len(ids_before) - rolled_back] + new_ids``."""

    new_ids: list[int]  # ids appended after the rollback (re-encoded ones included)
    rolled_back: int  # ids removed from the end before appending


_IMMUTABLE = (str, int, float, bool, type(None))


def _snapshot(x):
    """A deep copy of JSON-like data (dicts, lists, immutable scalars), 3-4x faster than
    ``copy.deepcopy`` on messages; anything else goes through ``copy.deepcopy``."""
    t = type(x)
    if t is dict:
        return {k: _snapshot(v) for k, v in x.items()}
    if t is list:
        return [_snapshot(v) for v in x]
    if t in _IMMUTABLE:
        return x
    return copy.deepcopy(x)


def _common_prefix_len(a: str, b: str) -> int:
    """Length of the common prefix, by bisection on C-level slice compares (O(n log n) bytes)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # invariant: a[:lo] == b[:lo] and a[:hi+1] != b[:hi+1]
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class EncodedSession:
    """A session's ids in an :class:`IdStore` (by default the C++ token buffer, which keeps the
    block-hash chain of full ``page_size`` pages salted with ``salt``): what every session encoder
    shares, whatever chat format it renders."""

    def __init__(self, store: IdStore | None, page_size: int, salt: bytes):
        self._store: IdStore = store if store is not None else default_store(page_size, salt)
        if len(self._store):
            raise ValueError("store must start empty")

    @property
    def ids(self) -> Sequence[int]:
        """All ids of the session so far, as a copy the caller owns and may keep across turns.

        [len(self)] ids: a uint32 numpy array with the default C++ store, else a list. A copy,
        because a live view of the C++ buffer would pin its storage (a later growing ``append``
        would raise ``BufferError``) and would see rolled-back positions change under it.
        Copying costs about one memcpy of the ids (~0.6 MB at 160K tokens).
        """
        return self._store.ids().copy()

    def block_hashes(self) -> list[bytes] | None:
        """Chained hashes of every full page of :attr:`ids` (16 bytes each), kept by the C++
        token buffer as ids are appended and rolled back: ``kvtier.cache.block_hashes(ids,
        page_size, salt=salt)``, at O(pages) cost and no hashing. None when the store keeps no
        hashes (a :class:`ListIdStore`)."""
        get = getattr(self._store, "block_hashes", None)
        return get() if get is not None else None

    @property
    def token_buffer(self):
        """The :class:`kvtier.tokenize.buffer.TokenBuffer` holding :attr:`ids` and their hashes,
        to hand to ``Engine.add_request(prompt_block_hashes=...)`` so that the pages hashed here
        are not hashed again; None when the store is not one (a :class:`ListIdStore`)."""
        from kvtier.tokenize.buffer import TokenBuffer

        return self._store if isinstance(self._store, TokenBuffer) else None

    def __len__(self) -> int:
        return len(self._store)


class SessionEncoder(EncodedSession):
    """Encode one chat session incrementally.

    Args:
        tokenizer: a :class:`KimiTokenizer`.
        mode: ``"canonical"``: ids always equal ``tokenizer.encode(render_chat(...))``.
            ``"tito"``: as canonical, but ids passed to :meth:`append_generated` are kept
            while the rendering reproduces their text.
        add_generation_prompt, thinking: passed to the template (see ``render_chat``).
        store: where ids live. Default: the fused C++ :class:`kvtier.tokenize.buffer.TokenBuffer`
            (keeps the block-hash chain of full ``page_size`` pages; ``ids`` is then a uint32
            numpy array) when ``kvtier._C`` has it, else a Python list.
        page_size: tokens per KV page for the default C++ buffer's hash chain.
        salt: tenant salt of that chain (an engine's ``block_hash_salt``, so that
            :meth:`block_hashes` can be handed to ``Engine.add_request``).

    Example:
        >>> enc = SessionEncoder(tok)                                         # doctest: +SKIP
        >>> r = enc.append([{"role": "user", "content": "hi"}])                  # doctest: +SKIP
        >>> enc.ids == tok.encode(render_chat([{"role": "user", "content": "hi"}]))  # doctest: +SKIP
        True
    """

    def __init__(self, tokenizer: KimiTokenizer, mode: Literal["canonical", "tito"] = "canonical", *,
                 add_generation_prompt: bool = True, thinking: bool = False, store: IdStore | None = None,
                 page_size: int = 64, salt: bytes = b""):
        if mode not in ("canonical", "tito"):
            raise ValueError(f"mode must be 'canonical' or 'tito', got {mode!r}")
        if getattr(tokenizer, "chat_format", ChatFormat.K2_TEMPLATE) is not ChatFormat.K2_TEMPLATE:
            raise ValueError(f"tokenizer: speaks {tokenizer.chat_format.value}, not K2's template; encode its sessions "
                             "with kvtier.tokenize.xtml_session.XtmlSessionEncoder (session_encoder picks one)")
        super().__init__(store, page_size, salt)
        self.tokenizer = tokenizer
        self.mode = mode
        self.add_generation_prompt = add_generation_prompt
        self.thinking = thinking
        self._parts: list[str] = []  # rendered parts the ids encode (last may hold generated text)
        self._starts: list[int] = []  # char offset of each part
        self._length = 0  # total chars of the parts
        self._n_header = 0  # parts before the first message's part (tool declaration, default system)
        self._bound_chars: list[int] = [0]  # safe boundaries: char offset ...
        self._bound_toks: list[int] = [0]  # ... and the number of ids before it
        # per message of the last call: a deep copy, its rendered part and the tool-call count
        # after it; a message equal to its copy (and all earlier ones) is not rendered again
        self._msgs: list[dict] = []
        self._msg_parts: list[str] = []
        self._msg_calls: list[int] = []
        self._n_hist = 0  # messages rendered as history (thinking: up to the last final answer)
        self._tools_copy: list | None = None  # deep copy of the last tools and ...
        self._tools_part = ""  # ... their declaration part (re-serialised only when they change)
        self.sampled = SampledTurns()  # turns kept by message (append_generated with a message)
        self._end_ids = tuple(tokenizer.token_id(t) for t in ("<|im_end|>", "[EOS]"))

    @property
    def text(self) -> str:
        """The text the ids stand for."""
        return "".join(self._parts)

    def _first_difference(self, parts: list[str], start: int) -> tuple[int, int]:
        """(index of the first differing part, char offset of the first differing char).

        ``parts[:start]`` are known to equal the old parts.
        """
        old = self._parts
        j = start
        n = min(len(old), len(parts))
        while j < n and (old[j] is parts[j] or old[j] == parts[j]):
            j += 1
        if j == len(old):
            return j, self._length
        if j == len(parts):
            return j, self._starts[j]
        return j, self._starts[j] + _common_prefix_len(old[j], parts[j])

    def _rollback_to(self, char: int) -> int:
        """Drop ids after the last safe boundary ≤ ``char``; returns that boundary's char offset."""
        k = bisect.bisect_right(self._bound_chars, char) - 1
        b_char, b_tok = self._bound_chars[k], self._bound_toks[k]
        del self._bound_chars[k + 1:], self._bound_toks[k + 1:]
        self._store.truncate(b_tok)
        return b_char

    def _tools_declaration(self, tools: Sequence[dict] | None) -> str:
        """``render_tools(tools)``, re-serialised only when ``tools`` differ from the last ones."""
        if not tools:
            return ""
        if type(tools) is not list or tools != self._tools_copy:
            part = render_tools(tools)  # validates
            self._tools_copy, self._tools_part = _snapshot(list(tools)), part
        return self._tools_part

    def _unchanged_messages(self, messages: Sequence[dict]) -> int:
        """Length of the prefix of ``messages`` equal to the copies kept from the last call."""
        old = self._msgs
        n = min(len(old), len(messages))
        head = messages[:n] if type(messages) is list else list(messages[:n])
        if (old if n == len(old) else old[:n]) == head:  # one C-level compare when append-only
            return n
        j = 0
        while old[j] == messages[j]:
            j += 1
        return j

    def _render(self, messages: Sequence[dict], tools: Sequence[dict] | None,
                redo: int | None = None) -> tuple[list[str], int, tuple]:
        """Parts of the conversation, reusing the parts of messages unchanged since the last call.

        Message ``i`` keeps its part when it and every earlier message equal the copies kept from
        the last call (so its tool-call index is unchanged) and its history flag is unchanged.
        A message that is a kept sampled turn is the text of its sampled ids; ``redo``: render
        again from this message on.

        Returns:
            (parts, index of the first part that may differ from the old parts, new per-message state)
        """
        redo = len(messages) if redo is None else redo
        tools_part = self._tools_declaration(tools)
        header = header_parts(messages, None)
        if tools_part:
            header.insert(0, tools_part)
        n_hist = history_end(messages, self.thinking)
        j = self._unchanged_messages(messages)
        if n_hist != self._n_hist:
            j = min(j, n_hist, self._n_hist)
        self.sampled.drop_from(j + 1)  # kept turns after a changed message are text again
        j = min(j, redo)
        msgs, msg_parts, msg_calls = self._msgs[:j], self._msg_parts[:j], self._msg_calls[:j]
        calls = msg_calls[-1] if j else 0
        for i in range(j, len(messages)):
            msg = messages[i]
            turn = self.sampled.match(i, msg)
            if turn is not None:
                part, n = turn.text, len(msg.get("tool_calls") or [])
            else:
                part, n = render_message(msg, i, thinking=self.thinking, history=i < n_hist, call_index=calls)
            calls += n
            msgs.append(_snapshot(msg))
            msg_parts.append(part)
            msg_calls.append(calls)
        parts = header + msg_parts
        if self.add_generation_prompt:
            parts.append(GENERATION_PROMPT)
        same_header = len(header) == self._n_header and header == self._parts[:self._n_header]
        start = len(header) + j if same_header else 0
        return parts, start, (msgs, msg_parts, msg_calls, n_hist, len(header))

    def append(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> AppendResult:
        """Bring the ids up to date with ``messages`` (the *whole* conversation so far).

        Messages are compared with copies of the previous call's, so in-place edits are seen.
        Unchanged history costs one equality check of the messages (and of the tools) against
        those copies; only new or changed messages are rendered and compared as text.

        Returns:
            :class:`AppendResult`: the ids added and how many were rolled back first.

        Raises:
            ValueError: bad messages or tools (see ``render_chat``); the session is unchanged.
        """
        parts, start, state = self._render(messages, tools)
        _, diff = self._first_difference(parts, start)
        for r in sorted(self.sampled.turns):  # a kept turn stays only if its ids are before the difference
            if r == len(self._msgs) and not self.sampled.turns[r].placed:
                end = self._length  # the newest turn: its sampled ids end the ids
            elif self._n_header + r < len(self._starts):
                end = self._starts[self._n_header + r] + len(self._parts[self._n_header + r])
            else:
                end = self._length + 1
            if diff < end:
                self.sampled.drop_from(r)
                parts, start, state = self._render(messages, tools, redo=r)
                _, diff = self._first_difference(parts, start)
                break
        for turn in self.sampled.turns.values():
            turn.placed = True
        base = self._starts[start] if start < len(self._starts) else self._length
        starts = self._starts[:start]
        starts.extend(itertools.accumulate(map(len, parts[start:]), initial=base))
        new_length = starts.pop()
        self._msgs, self._msg_parts, self._msg_calls, self._n_hist, self._n_header = state
        if diff == self._length == new_length:
            self._parts, self._starts = parts, starts  # same text, maybe split differently
            return AppendResult([], 0)
        before = len(self._store)
        b_char = self._rollback_to(diff)
        rolled_back = before - len(self._store)
        k = max(0, bisect.bisect_right(starts, b_char) - 1)
        suffix = parts[k][b_char - starts[k]:] + "".join(parts[k + 1:]) if parts else ""
        new_ids, bounds = self.tokenizer.encode_with_boundaries(suffix, b_char, len(self._store))
        self._store.append(new_ids)
        self._bound_chars.extend(c for c, _ in bounds)
        self._bound_toks.extend(t for _, t in bounds)
        self._parts, self._starts, self._length = parts, starts, new_length
        return AppendResult(new_ids, rolled_back)

    def append_generated(self, ids: Sequence[int], message: dict | None = None) -> bool:
        """Record the ids the model sampled after the generation prompt (tito mode only).

        Without ``message``, they are kept by later :meth:`append` calls as long as the rendered
        assistant turn starts with their decoded text. With ``message`` (the assistant message
        the API returned for them), they are kept while the next conversations hold a message
        equal to it (:func:`kvtier.tokenize.sampled.message_key`) at the index after the last
        :meth:`append`'s messages, after unchanged earlier messages; a trailing ``<|im_end|>`` or
        ``[EOS]`` is left to the rendering, which closes the turn with ``<|im_end|>``.

        Returns:
            True (the ids are in the session).

        Raises:
            ValueError: canonical mode, or the ids do not follow a generation prompt.
        """
        if self.mode != "tito":
            raise ValueError("append_generated needs mode='tito' (canonical ids are always re-encoded)")
        if not self._parts or not self._parts[-1].endswith(GENERATION_PROMPT):
            raise ValueError("append_generated: the session must end with the generation prompt "
                             f"{GENERATION_PROMPT!r} (append the conversation first)")
        ids = [int(i) for i in ids]
        if message is not None and ids and ids[-1] in self._end_ids:
            ids = ids[:-1]
        key = message_key(message) if message is not None else None
        if not ids and key is None:
            return True
        text = self.tokenizer.decode(ids) if ids else ""
        if key is not None:
            self.sampled.add(SampledTurn(len(self._msgs), key, tuple(ids), self._parts[-1] + text + "<|im_end|>"))
        self._store.append(ids)
        self._parts[-1] += text
        self._length += len(text)
        # the end of a sampled turn is a boundary: later text is encoded after it
        self._bound_chars.append(self._length)
        self._bound_toks.append(len(self._store))
        return True

    def boundaries(self) -> dict[str, int]:
        """Where the ids of the last :meth:`append` end a part a later turn comes back to:
        ``tools`` (the end of the tool declaration; absent without tools) and ``history`` (the
        end of the last message, before the generation prompt), as a number of ids. Both are
        safe boundaries (the end of a special token)."""
        out = {}
        n = len(self._parts) - (1 if self.add_generation_prompt else 0)
        for name, k in (("tools", 1 if self._tools_part and self._n_header else 0), ("history", n)):
            if k <= 0 or k > len(self._starts):
                continue
            char = self._starts[k] if k < len(self._starts) else self._length
            b = bisect.bisect_right(self._bound_chars, char) - 1
            if self._bound_chars[b] == char:
                out[name] = self._bound_toks[b]
        return out
