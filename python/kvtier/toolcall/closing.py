"""The shortest-completion search a tool-call constraint closes a turn with before ``max_tokens``.

A grammar can always be finished, but the model may not head there: a string can go on forever
(and a random model never closes one). :func:`closing_tokens` finds a short completion of the
turn greedily with the matcher: forced tokens first, then whichever allowed token closes most JSON
nesting (:class:`JsonNesting`), ties broken by a bounded look-ahead; the completion is written with
the tokens the tokenizer gives its text (:meth:`TokenTable.canonical`). Each search spends at most
a :class:`SearchBudget` of matcher calls and raises once its deadline passes. The constraint that
uses it is :class:`kvtier.toolcall.constrain.ToolCallConstraint`.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import numpy as np

from kvtier.tokenize.formats import ChatFormat
from kvtier.toolcall.grammar import GrammarLimitError
from kvtier.toolcall.parser import ARGUMENT_BEGIN, CALL_END, SECTION_END

_QUOTE, _BACKSLASH = 0x22, 0x5C
_OPEN, _CLOSE = (0x7B, 0x5B), (0x7D, 0x5D)
_STRUCTURAL = b'"}]0,:'  # closing candidates, in order of preference at equal nesting
MAX_CLOSING_TOKENS = 4096  # give up estimating a completion longer than this
ROLLOUT_TOKENS = 128  # look-ahead of a tie-break between candidate tokens
MAX_ROLLOUT_CHOICES = 16  # tie-break by look-ahead only among this many candidates


@dataclass
class JsonNesting:
    """Open JSON containers and string state of the bytes seen since the last special token."""

    depth: int = 0
    in_string: bool = False
    escape: bool = False

    def feed(self, data: bytes) -> JsonNesting:
        for b in data:
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif b == _BACKSLASH:
                    self.escape = True
                elif b == _QUOTE:
                    self.in_string = False
            elif b == _QUOTE:
                self.in_string = True
            elif b in _OPEN:
                self.depth += 1
            elif b in _CLOSE:
                self.depth -= 1
        return self

    def copy(self) -> JsonNesting:
        return JsonNesting(self.depth, self.in_string, self.escape)

    @property
    def openness(self) -> int:
        """Containers still open, counting an open string as one."""
        return self.depth + int(self.in_string)


_HEADER = re.compile(r'(?P<tag>\w+)(?P<attrs>(?: [^\s="]+="[^"]*")*)')  # a K3 tag header: tag key="v" ...
# The control tokens a short completion takes first when the grammar allows them, per chat format:
# K2's markers that end a call, the section, an id; K3's tag tokens (<|close|> ends a value, a call,
# a channel; <|sep|> ends a tag; <|open|> starts the argument or call that must come).
CLOSING_MARKERS = {
    ChatFormat.K2_TEMPLATE: (CALL_END, SECTION_END[0], ARGUMENT_BEGIN),
    ChatFormat.K3_XTML: ("<|close|>", "<|sep|>", "<|open|>"),
}


class TokenTable:
    """Byte strings of token ids and the ids of the special markers, for one tokenizer (its
    ``chat_format`` chooses the markers; K2's when it has none)."""

    def __init__(self, tokenizer, end_of_turn_ids):
        self.tokenizer = tokenizer
        self.end_of_turn = tuple(end_of_turn_ids)
        self.vocab_size = tokenizer.n_vocab
        self.special = set(tokenizer.special_ids)
        chat_format = getattr(tokenizer, "chat_format", ChatFormat.K2_TEMPLATE)
        self.markers = [tokenizer.token_id(m) for m in CLOSING_MARKERS[chat_format]]
        self._k3_open = tokenizer.token_id("<|open|>") if chat_format is ChatFormat.K3_XTML else None
        ranks = tokenizer._enc._mergeable_ranks
        self.byte_token = {
            b: ranks[bytes([b])] for b in range(256) if bytes([b]) in ranks
        }
        self.structural = [self.byte_token[b] for b in _STRUCTURAL]
        self.byte_ids = np.array(sorted(self.byte_token.values()), dtype=np.int64)
        self._bytes: dict[int, bytes] = {}

    def bytes_of(self, token: int) -> bytes:
        data = self._bytes.get(token)
        if data is None:
            data = self._bytes[token] = self.tokenizer.decode_bytes([token])
        return data

    def canonical(self, ids: list[int]) -> list[int]:
        """``ids`` with each run of text between special tokens re-encoded as the chat format
        encodes that text: K2: the run as one segment (``encode_segment``); K3: a tag header
        (the run after ``<|open|>``) as K3's renderer writes it, the tag and each attribute a
        segment of its own (:func:`kvtier.tokenize.xtml.open_tag`), any other run as one segment.
        A run that is not whole UTF-8 is kept as it is."""
        out: list[int] = []
        run: list[int] = []
        after = None
        for t in [*ids, None]:
            if t is not None and t not in self.special:
                run.append(t)
                continue
            if run:
                out += self._encode_run(run, after)
                run = []
            if t is not None:
                out.append(t)
                after = t
        return out

    def _encode_run(self, run: list[int], after: int | None) -> list[int]:
        try:
            text = b"".join(self.bytes_of(t) for t in run).decode("utf-8")
        except UnicodeDecodeError:
            return run
        if self._k3_open is not None and after == self._k3_open:
            from kvtier.tokenize.xtml import encode_part, open_tag
            from kvtier.toolcall.xtml_parser import attributes

            m = _HEADER.fullmatch(text)
            if m is not None:
                attrs = list(attributes(m["attrs"]).items())
                return encode_part(self.tokenizer, open_tag(m["tag"], attrs)[1:-1])
        return self.tokenizer.encode_segment(text)

    def advance(self, nesting: JsonNesting, token: int) -> JsonNesting:
        """``nesting`` after ``token`` (special tokens start a fresh JSON context)."""
        if token in self.special:
            return JsonNesting()
        return nesting.feed(self.bytes_of(token))


class SearchBudget:
    """The work one closing search may do.

    Args:
        fuel: matcher calls (a bitmask counts 16); when they run out the search finds nothing.
        deadline: ``time.monotonic()`` past which the search raises, or None.
        deadline_s: the limit ``deadline`` came from (for the message).

    Attributes:
        exhausted: the fuel ran out.
    """

    def __init__(self, fuel: int, deadline: float | None = None, deadline_s: float | None = None):
        self.fuel, self.deadline, self.deadline_s = fuel, deadline, deadline_s
        self.exhausted = False

    def spend(self, calls: int) -> None:
        """Charge ``calls`` matcher calls.

        Raises:
            GrammarLimitError: the deadline passed.
        """
        self.fuel -= calls
        if self.fuel < 0:
            self.exhausted = True
            raise _OutOfFuel
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise GrammarLimitError(f"the tool grammar's work for one token took longer than mask_deadline_s="
                                    f"{self.deadline_s:g} s")


class _OutOfFuel(Exception):
    pass


_UNLIMITED = SearchBudget(1 << 62)


def _allowed_single_bytes(matcher, table: TokenTable) -> list[int]:
    words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)
    ids = table.byte_ids
    bits = (words[ids >> 5] >> (ids & 31).astype(np.uint32)) & np.uint32(1)
    return ids[bits.astype(bool)].tolist()


def _candidates(
    matcher, table: TokenTable, nesting: JsonNesting, budget: SearchBudget = _UNLIMITED
) -> list[tuple[tuple, int]]:
    """Allowed next tokens of a short completion with their sort keys, best first: an end marker
    if one is allowed; else structural characters if one does not open more JSON; else every
    allowed single byte, keyed by (JSON left open, no closing character allowed after it, byte)."""
    budget.spend(len(table.markers) + len(table.structural))
    for t in table.markers:
        if matcher.validate_tokens([t]):
            return [((0, 0, 0), t)]
    found = []
    for rank, t in enumerate(table.structural):
        if matcher.validate_tokens([t]):
            found.append(((table.advance(nesting.copy(), t).openness, 0, rank), t))
    found.sort()
    if found and found[0][0][0] <= nesting.openness:
        return found
    allowed = _allowed_single_bytes(matcher, table)
    budget.spend(16 + 5 * len(allowed))
    for t in allowed:
        after = table.advance(nesting.copy(), t)
        matcher.consume_token(t)
        can_close = any(matcher.validate_tokens([c]) for c in table.structural[:3])
        matcher.rollback(1)
        found.append(((after.openness, 0 if can_close else 1, t), t))
    return sorted(found)


def _pick(matcher, table: TokenTable, nesting: JsonNesting, rollout: int,
          budget: SearchBudget = _UNLIMITED) -> int | None:
    """The best candidate; when several tie on the first two keys (e.g. the first letters of
    property names), the one whose own greedy completion (up to ``rollout`` tokens) is shortest."""
    found = _candidates(matcher, table, nesting, budget)
    if not found:
        return None
    ties = [t for key, t in found if key[:2] == found[0][0][:2]]
    if rollout and 1 < len(ties) <= MAX_ROLLOUT_CHOICES:
        # The first tie with the shortest look-ahead (a look-ahead that finds none counts
        # rollout + 1); one after the best so far need not look as far as it.
        best, best_len = ties[0], rollout + 2
        for t in ties:
            budget.spend(2)
            m = matcher.deep_copy()
            m.consume_token(t)
            path = _closing(
                m, table, table.advance(nesting.copy(), t), min(rollout, best_len - 1), 0, budget
            )
            length = len(path) if path is not None else rollout + 1
            if length < best_len:
                best, best_len = t, length
        return best
    return found[0][1]


def closing_tokens(
    matcher,
    table: TokenTable,
    nesting: JsonNesting,
    limit: int = MAX_CLOSING_TOKENS,
    rollout: int = ROLLOUT_TOKENS,
    budget: SearchBudget | None = None,
):
    """A short sequence of tokens that completes the turn from ``matcher``'s state, ending with an
    end-of-turn id; None if none was found within ``limit`` tokens, or within ``budget``'s fuel
    (then ``budget.exhausted``). ``matcher`` is unchanged.

    Greedy: forced tokens (llguidance's fast-forward) first, else :func:`_pick`. Not always the
    shortest completion, but one that closes what is open before it opens anything new. The
    completion is then written with the tokens the tokenizer gives its text
    (:meth:`TokenTable.canonical`: ``"}`` as the one token BPE makes of it, not ``"`` then ``}``)
    when the grammar takes them and they fit in ``limit``, so a closed turn encodes back to the
    ids it was sampled as.

    Raises:
        GrammarLimitError: ``budget``'s deadline passed.
    """
    try:
        path = _closing(matcher, table, nesting, limit, rollout, budget or SearchBudget(1 << 62))
    except _OutOfFuel:
        return None
    if path is None:
        return None
    canon = table.canonical(path[:-1])
    if canon != path[:-1] and len(canon) < limit:
        m = matcher.deep_copy()
        if m.try_consume_tokens(canon) == len(canon) and m.is_accepting():
            return canon + path[-1:]
    return path


def _closing(matcher, table: TokenTable, nesting: JsonNesting, limit: int, rollout: int, budget: SearchBudget):
    budget.spend(1)
    m = matcher.deep_copy()
    nesting = nesting.copy()
    path: list[int] = []
    while len(path) < limit:
        budget.spend(3)
        if m.is_accepting():
            return path + [table.end_of_turn[0]]
        forced = m.compute_ff_tokens()
        if forced and m.try_consume_tokens(forced) == len(forced):
            step = forced
        else:
            t = _pick(m, table, nesting, rollout, budget)
            if t is None or not m.consume_token(t):
                return None
            step = [t]
        for t in step:
            nesting = table.advance(nesting, t)
        path += step
    return None
