"""Incremental, exact encoding of a growing K3 (XTML) chat session, and the choice of a session
encoder by the tokenizer's chat format.

:class:`XtmlSessionEncoder` renders the conversation as parts (:func:`kvtier.tokenize.xtml.render_xtml_parts`),
finds the first part that differs from the parts its ids encode, rolls the ids back to that part's
first id and encodes only the parts from there. Every part starts with a control token and each
segment is encoded on its own, so a part's ids depend on that part alone: the ids are always
exactly ``encode_xtml(tokenizer, messages, tools, options)``, the same guarantee
:class:`kvtier.tokenize.SessionEncoder` gives for K2's template. The turn's tails (``tool_choice``,
``response_format``) and the generation prompt are the last parts, so the next turn rolls back
exactly to the end of the last history message (``docs/k3.md``, "Chat format
(XTML)").

A turn's sampled ids are kept (:meth:`XtmlSessionEncoder.append_generated`): while the client sends
that assistant message back (:func:`kvtier.tokenize.sampled.message_key`) after the same earlier
parts, its part is the generation prompt's ids and the sampled ones, not a re-encoding; from the
first part that differs, the conversation is rendered and encoded as above.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.tokenize.formats import ChatFormat
from kvtier.tokenize.sampled import SampledTurn, SampledTurns, message_key
from kvtier.tokenize.session import AppendResult, EncodedSession, IdStore, SessionEncoder
from kvtier.tokenize.xtml import SEP, Part, XtmlOptions, close_tag, encode_part, render_xtml_parts, result_order


class SampledPart(tuple):
    """A message part whose ids are the ones a turn sampled (:meth:`XtmlSessionEncoder.append_generated`).
    Its segments are the message's rendering, for reading; two sampled parts are equal when their
    ids are, and a sampled part never equals a rendered one."""

    ids: tuple[int, ...]

    def __new__(cls, part: Part, ids: Sequence[int]):
        obj = super().__new__(cls, part)
        obj.ids = tuple(ids)
        return obj

    def __eq__(self, other) -> bool:
        return isinstance(other, SampledPart) and self.ids == other.ids

    def __ne__(self, other) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(self.ids)


class XtmlSessionEncoder(EncodedSession):
    """Encode one K3 chat session incrementally (canonical ids, every turn).

    Args:
        tokenizer: a :class:`kvtier.tokenize.KimiTokenizer` with K3's control tokens
            (``chat_format`` ``K3_XTML``).
        add_generation_prompt: end each rendering with the generation prompt.
        store, page_size, salt: where ids live and how their pages are hashed, as
            :class:`kvtier.tokenize.SessionEncoder`.

    Raises:
        ValueError: a tokenizer that does not speak K3's format.

    Example:
        >>> enc = XtmlSessionEncoder(k3_tok)                                      # doctest: +SKIP
        >>> r = enc.append([{"role": "user", "content": "hi"}], options=XtmlOptions(thinking=False))  # doctest: +SKIP
        >>> list(enc.ids) == encode_xtml(k3_tok, [{"role": "user", "content": "hi"}],
        ...                              options=XtmlOptions(thinking=False))      # doctest: +SKIP
        True
    """

    def __init__(self, tokenizer, *, add_generation_prompt: bool = True, store: IdStore | None = None,
                 page_size: int = 64, salt: bytes = b""):
        if getattr(tokenizer, "chat_format", None) is not ChatFormat.K3_XTML:
            raise ValueError("tokenizer: XtmlSessionEncoder needs a tokenizer with K3's control tokens "
                             f"(chat_format k3-xtml), got {getattr(tokenizer, 'chat_format', None)!r}")
        super().__init__(store, page_size, salt)
        self.tokenizer = tokenizer
        self.add_generation_prompt = add_generation_prompt
        self._parts: list[Part] = []  # the parts the ids encode, in order
        self._starts: list[int] = []  # the number of ids before each part
        self._n_messages = 0  # messages of the last append
        self._n_history_parts = 0  # parts of the last append before its tails and generation prompt
        self._declares_tools = False  # the last append's first part is a tool declaration
        self.sampled = SampledTurns()
        self._end_ids = (tokenizer.token_id("<|end_of_msg|>"), tokenizer.token_id("[EOS]"))
        self._close_message = tuple(encode_part(tokenizer, close_tag("message")))

    @property
    def text(self) -> str:
        """The prompt the ids stand for, control tokens spelled (for reading only)."""
        return "".join(t for part in self._parts for t, _ in part)

    def append(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
               options: XtmlOptions | None = None) -> AppendResult:
        """Bring the ids up to date with ``messages`` (the *whole* conversation so far).

        Args:
            messages, tools, options: as :func:`kvtier.tokenize.xtml.render_xtml_parts`.

        Returns:
            :class:`kvtier.tokenize.AppendResult`: the ids added and how many were rolled back.

        Raises:
            ValueError: as :func:`kvtier.tokenize.xtml.render_xtml_parts`; the session is unchanged.
        """
        rendered = render_xtml_parts(messages, tools, options, self.add_generation_prompt)
        position = {i: p for p, (i, _) in enumerate(result_order(messages))}
        canonical = list(rendered.messages)
        h = len(rendered.header)
        for r in sorted(self.sampled.turns):
            turn = self.sampled.match(r, messages[r]) if r in position else None
            if turn is None:
                self.sampled.drop_from(r)
                break
            rendered.messages[position[r]] = SampledPart(canonical[position[r]], turn.ids)
        parts = rendered.all()
        j = self._first_difference(parts)
        # a kept turn at or after the first difference follows other parts than it was sampled
        # after, unless it is the newest turn right after the parts of its own prompt
        for r, turn in sorted(self.sampled.turns.items()):
            k = h + position[r]
            if k > j or (k == j and turn.placed):
                for d in [d for d in self.sampled.turns if d >= r]:
                    rendered.messages[position[d]] = canonical[position[d]]
                self.sampled.drop_from(r)
                parts = rendered.all()
                j = self._first_difference(parts)
                break
        for turn in self.sampled.turns.values():
            turn.placed = True
        self._n_messages, self._declares_tools = len(messages), bool(tools)
        self._n_history_parts = h + len(rendered.messages)
        old = self._parts
        if j == len(old) == len(parts):
            return AppendResult([], 0)
        keep = self._starts[j] if j < len(old) else len(self._store)
        rolled_back = len(self._store) - keep
        self._store.truncate(keep)
        starts = self._starts[:j]
        new_ids: list[int] = []
        for part in parts[j:]:
            starts.append(keep + len(new_ids))
            new_ids.extend(part.ids if isinstance(part, SampledPart) else encode_part(self.tokenizer, part))
        self._store.append(new_ids)
        self._parts, self._starts = parts, starts
        return AppendResult(new_ids, rolled_back)

    def _first_difference(self, parts: list[Part]) -> int:
        old = self._parts
        j, n = 0, min(len(old), len(parts))
        while j < n and old[j] == parts[j]:
            j += 1
        return j

    def append_generated(self, ids: Sequence[int], message: dict) -> bool:
        """Keep the ids a turn sampled after this session's last prompt, for the assistant
        message the API returned for them (``message``, OpenAI-style): the next :meth:`append`
        whose conversation holds that message right after the last prompt's messages encodes it
        as the generation prompt's ids followed by ``ids``.

        Args:
            ids: the turn's output ids, ending ``<|close|>message<|sep|>`` and then
                ``<|end_of_msg|>`` or ``[EOS]`` (a turn the grammar finished); the end token is
                kept as ``<|end_of_msg|>``, the history form.
            message: the assistant message returned for them.

        Returns:
            True when they are kept; False (nothing kept) for a turn that did not end its message
            (a length stop), a session not ending in the generation prompt, or a message that is
            not an assistant message.
        """
        ids = [int(i) for i in ids]
        if ids and ids[-1] in self._end_ids:
            ids = ids[:-1]
        key = message_key(message)
        if (key is None or not self.add_generation_prompt or not self._parts
                or tuple(ids[-len(self._close_message):]) != self._close_message):
            return False
        prompt = self._store.ids()
        generation = [int(i) for i in prompt[self._starts[-1]:]]
        self.sampled.add(SampledTurn(self._n_messages, key, tuple(generation + ids + [self._end_ids[0]])))
        return True

    def boundaries(self) -> dict[str, int]:
        """Where the ids of the last :meth:`append` end a part a later turn comes back to:
        ``tools`` (the end of the tool declaration, the first part; absent without tools),
        ``history`` (the end of the last message, before the tails and the generation prompt),
        ``last_body`` (the end of the last message's opening tag: what a conversation that differs
        from this one only in its last message's text shares, e.g. a new session's first user
        message after the same tools and system prompt), as a number of ids."""
        out = {}
        if self._declares_tools and len(self._starts) > 1:
            out["tools"] = self._starts[1]
        last = self._n_history_parts - 1
        if 0 <= last < len(self._parts) and last < len(self._starts) and not isinstance(self._parts[last], SampledPart):
            part = self._parts[last]
            sep = next((k for k, (text, special) in enumerate(part) if special and text == SEP), None)
            if sep is not None:
                out["last_body"] = self._starts[last] + len(encode_part(self.tokenizer, part[:sep + 1]))
        if self._n_history_parts:
            out["history"] = (self._starts[self._n_history_parts] if self._n_history_parts < len(self._starts)
                              else len(self._store))
        return out


def session_encoder(tokenizer, *, page_size: int = 64, salt: bytes = b"",
                    keep_sampled: bool = False) -> SessionEncoder | XtmlSessionEncoder:
    """The session encoder for ``tokenizer``'s chat format: :class:`XtmlSessionEncoder` for K3's
    XTML, else :class:`kvtier.tokenize.SessionEncoder` (K2's template: canonical mode, or ``tito``
    with ``keep_sampled``, so that ``append_generated`` keeps a turn's sampled ids). Both keep
    sampled ids given ``append_generated``; without it their ids are canonical."""
    if getattr(tokenizer, "chat_format", ChatFormat.K2_TEMPLATE) is ChatFormat.K3_XTML:
        return XtmlSessionEncoder(tokenizer, page_size=page_size, salt=salt)
    return SessionEncoder(tokenizer, "tito" if keep_sampled else "canonical", page_size=page_size, salt=salt)
