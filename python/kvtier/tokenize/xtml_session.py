"""Incremental, exact encoding of a growing K3 (XTML) chat session, and the choice of a session
encoder by the tokenizer's chat format.

:class:`XtmlSessionEncoder` renders the conversation as parts (:func:`kvtier.tokenize.xtml.render_xtml_parts`),
finds the first part that differs from the parts its ids encode, rolls the ids back to that part's
first id and encodes only the parts from there. Every part starts with a control token and each
segment is encoded on its own, so a part's ids depend on that part alone: the ids are always
exactly ``encode_xtml(tokenizer, messages, tools, options)``, the same guarantee
:class:`kvtier.tokenize.SessionEncoder` gives for K2's template. The turn's tails (``tool_choice``,
``response_format``) and the generation prompt are the last parts, so the next turn rolls back
exactly to the end of the last history message (``../shared/docs/K3.md``, "What it means for a
cache").
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.tokenize.formats import ChatFormat
from kvtier.tokenize.session import AppendResult, EncodedSession, IdStore, SessionEncoder
from kvtier.tokenize.xtml import Part, XtmlOptions, encode_part, render_xtml_parts


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
        parts = render_xtml_parts(messages, tools, options, self.add_generation_prompt).all()
        old = self._parts
        j, n = 0, min(len(old), len(parts))
        while j < n and old[j] == parts[j]:
            j += 1
        if j == len(old) == len(parts):
            return AppendResult([], 0)
        keep = self._starts[j] if j < len(old) else len(self._store)
        rolled_back = len(self._store) - keep
        self._store.truncate(keep)
        starts = self._starts[:j]
        new_ids: list[int] = []
        for part in parts[j:]:
            starts.append(keep + len(new_ids))
            new_ids.extend(encode_part(self.tokenizer, part))
        self._store.append(new_ids)
        self._parts, self._starts = parts, starts
        return AppendResult(new_ids, rolled_back)


def session_encoder(tokenizer, *, page_size: int = 64, salt: bytes = b"") -> SessionEncoder | XtmlSessionEncoder:
    """The session encoder for ``tokenizer``'s chat format: :class:`XtmlSessionEncoder` for K3's
    XTML, else :class:`kvtier.tokenize.SessionEncoder` (K2's template, canonical mode)."""
    if getattr(tokenizer, "chat_format", ChatFormat.K2_TEMPLATE) is ChatFormat.K3_XTML:
        return XtmlSessionEncoder(tokenizer, page_size=page_size, salt=salt)
    return SessionEncoder(tokenizer, page_size=page_size, salt=salt)
