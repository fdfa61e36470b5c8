"""Per-request grammar state for tool-call constrained decoding, and batched mask filling.

Each constrained request owns a :class:`ToolCallConstraint` (an llguidance matcher over the
turn grammar of :mod:`kvtier.toolcall.grammar`). Every step, :func:`fill_bitmasks` writes one
packed allowed-token row per request (the layout ``kvtier.ops.sample(..., token_bitmask=...)``
takes: bit ``j % 32`` of int32 word ``j // 32`` set = token ``j`` allowed), all rows in one
llguidance call that runs on its own threads without the GIL.

**Closing before max_tokens.** A grammar can always be finished, but the model may not head
there: a string can go on forever (and a random model never closes one). So the constraint
keeps an estimate of the shortest completion of the turn — found greedily with the matcher:
forced tokens first, then whichever allowed token closes most JSON nesting, see
:func:`kvtier.toolcall.closing.closing_tokens` — and once that completion needs every remaining token of
``max_tokens``, it forces it token by token; near the end of the budget a sampled token after
which the turn could no longer be finished in time is replaced by the completion's first token.
A turn therefore ends with complete calls whenever ``max_tokens`` leaves room for the shortest
completion when the watch starts; otherwise the output is cut and the parser reports the open
call as incomplete. A forced completion that is the end of turn alone (text the budget cut)
sets :attr:`ToolCallConstraint.cut_by_budget`, and the request finishes with ``"length"``
(OpenAI's ``length``, Anthropic's ``max_tokens``, an ``incomplete`` response), as it would
without tools; the server still reports whole calls as ``tool_calls``.

**Bounded work.** A search looks no further than the budget it decides about (the tokens left,
or what decides whether to watch), spends at most ``GrammarLimits.closing_fuel`` matcher calls
(then it finds nothing, and the turn goes on under its mask alone), and raises
:class:`~kvtier.toolcall.grammar.GrammarLimitError` once one token's grammar work passes
``GrammarLimits.mask_deadline_s``: a schema whose shortest instance is huge costs each token a
bounded amount, and the request ends at its own ``max_tokens``.
"""

from __future__ import annotations

import time

import numpy as np

from kvtier.toolcall.closing import (
    MAX_CLOSING_TOKENS,
    JsonNesting,
    SearchBudget,
    TokenTable,
    closing_tokens,
)
from kvtier.toolcall.grammar import GrammarError, GrammarLimits

CHECK_INTERVAL = 32  # tokens between completion estimates while far from max_tokens
WINDOW_TOKENS = 64  # watch every token once max_tokens is this close beyond twice the shortest completion


class ToolCallConstraint:
    """The grammar state of one request.

    Args:
        matcher: a fresh ``llguidance.LLMatcher`` of the request's turn grammar.
        table: the tokenizer's :class:`TokenTable`.
        max_tokens: the request's ``max_tokens`` (closing is planned against it).
        limits: ``closing_fuel`` and ``mask_deadline_s`` bound each token's work (default
            :class:`~kvtier.toolcall.grammar.GrammarLimits`).
        stats: a :class:`~kvtier.toolcall.grammar.GrammarStats` counting searches out of fuel.

    Near the end of the budget (within ``2 * shortest + WINDOW_TOKENS`` tokens of ``max_tokens``)
    every sampled token is checked: if the turn could no longer be completed after it, the
    first token of the shortest completion is taken instead and the rest is forced. Once a
    completion fits when the watch starts, the turn always ends complete.
    """

    def __init__(self, matcher, table: TokenTable, max_tokens: int, limits: GrammarLimits | None = None,
                 stats=None):
        self.matcher = matcher
        self.table = table
        self.max_tokens = max_tokens
        self.limits = limits if limits is not None else GrammarLimits()
        self.stats = stats
        self.num_tokens = 0  # tokens consumed
        self.nesting = JsonNesting()
        self.finished = False
        self.cut_by_budget = False  # the budget ended the turn outside a call (finish reason "length")
        self._forced: list[int] = []  # committed completion, next token first
        self._closing: list[int] | None = (
            None  # a short completion from the state at _closing_at
        )
        self._closing_at = -1
        self._closing_limit = 0  # the token limit _closing was searched with
        self._watch = False
        self._deadline: float | None = None  # of the current token's grammar work

    @property
    def remaining(self) -> int:
        """Tokens left before ``max_tokens``."""
        return self.max_tokens - self.num_tokens

    @property
    def watching(self) -> bool:
        """Every sampled token is checked against the budget (the end of ``max_tokens`` is near)."""
        return self._watch

    def _start_work(self) -> None:
        self._deadline = time.monotonic() + self.limits.mask_deadline_s

    def _closing_now(self, limit: int) -> list[int] | None:
        """A completion of at most ``limit`` tokens from the current state (cached per state)."""
        if self._closing_at != self.num_tokens or (self._closing is None and self._closing_limit < limit):
            budget = SearchBudget(self.limits.closing_fuel, self._deadline, self.limits.mask_deadline_s)
            self._closing = closing_tokens(self.matcher, self.table, self.nesting, limit, budget=budget)
            self._closing_at, self._closing_limit = self.num_tokens, limit
            if budget.exhausted and self.stats is not None:
                self.stats.add(out_of_fuel=1)
        return self._closing

    def plan(self) -> int | None:
        """The token this step must take (a committed completion), or None to compute a mask.

        Raises:
            GrammarLimitError: the work passed ``limits.mask_deadline_s``.
        """
        self._start_work()
        if self._forced:
            return self._forced[0]
        if not self._watch and (
            self._closing_at < 0 or self.num_tokens - self._closing_at >= CHECK_INTERVAL
        ):
            # Watch once remaining <= 2 * shortest + WINDOW_TOKENS: a search up to half the tokens
            # left (beyond the window) decides it; finding none means watching.
            if self.remaining <= WINDOW_TOKENS:
                self._watch = True
            else:
                need = min(MAX_CLOSING_TOKENS, -(-(self.remaining - WINDOW_TOKENS) // 2))
                path = self._closing_now(need)
                length = len(path) if path else (MAX_CLOSING_TOKENS if need == MAX_CLOSING_TOKENS else need + 1)
                self._watch = self.remaining <= 2 * length + WINDOW_TOKENS
        if self._watch:
            path = self._closing_now(self.remaining)
            if path is not None and len(path) >= self.remaining:
                self._forced, self.cut_by_budget = list(path), self._cuts_text(path)
                return path[0]
        return None

    def _cuts_text(self, path: list[int]) -> bool:
        """Whether forcing ``path`` ends the turn where it stands (the end of turn alone: text, or
        the space after a finished call, cut by the budget) rather than closing an open call or
        structure whole."""
        return len(path) == 1 and path[0] in self.table.end_of_turn

    def take(self, token: int) -> int:
        """Consume the sampled ``token``, or the first token of the shortest completion when
        ``token`` would leave too few tokens to finish; returns the token taken.

        Raises:
            GrammarError: the grammar does not allow ``token`` (the mask was not applied).
            GrammarLimitError: the check passed ``limits.mask_deadline_s``.
        """
        if self._forced or not self._watch or token in self.table.end_of_turn:
            self.consume(token)
            return token
        self._start_work()
        before, nesting = self._closing_now(self.remaining), self.nesting.copy()
        self.consume(token)
        # The model follows the completion: the rest of it still fits.
        if before and before[0] == token:
            self._closing, self._closing_at = before[1:], self.num_tokens
        after = self._closing_now(self.remaining)
        if before is None or (after is not None and len(after) <= self.remaining):
            return token
        self.matcher.rollback(1)
        self.num_tokens -= 1
        self.nesting = nesting
        self._forced, self.cut_by_budget = list(before), self._cuts_text(before)
        self.consume(before[0])
        return before[0]

    def prime(self, tokens) -> None:
        """Advance the grammar by prompt tokens the turn continues (K3's generation prompt opens
        the ``think`` or ``response`` channel the turn grammar starts with); they count against
        no budget.

        Raises:
            GrammarError: the grammar does not allow ``tokens``.
        """
        tokens = list(tokens)
        if tokens and self.matcher.try_consume_tokens(tokens) != len(tokens):
            raise GrammarError(f"the prompt's last tokens {tokens} do not start the turn grammar: "
                               f"{self.matcher.get_error()}")
        self.nesting = JsonNesting()
        self._closing_at = -1

    def consume(self, token: int) -> None:
        """Advance the grammar by ``token``.

        Raises:
            GrammarError: the grammar does not allow ``token``.
        """
        if self._forced:
            self._forced = self._forced[1:] if self._forced[0] == token else []
        if token in self.table.end_of_turn and self.matcher.is_accepting():
            self.num_tokens += 1
            self.finished = True
            return
        if not self.matcher.consume_token(token):
            raise GrammarError(
                f"token {token} is not allowed by the tool grammar: {self.matcher.get_error()}"
            )
        self.num_tokens += 1
        self.nesting = self.table.advance(self.nesting, token)


def fill_bitmasks(constraints, bitmask: np.ndarray, executor=None) -> list[str | None]:
    """Fill row ``i`` of ``bitmask`` ([n, ceil(vocab / 32)] int32, C-contiguous) with the tokens
    ``constraints[i]`` allows now; a committed completion allows exactly its next token.

    Returns:
        per row, None or the error that left the row unfilled (a matcher in an error state, or a
        failed plan); one request's failure does not affect the other rows.
    """
    from llguidance.numpy import fill_next_token_bitmask_par

    errors: list[str | None] = [None] * len(constraints)
    pending = []
    for i, c in enumerate(constraints):
        try:
            if c.matcher.is_error():
                raise GrammarError(f"tool grammar failed: {c.matcher.get_error()}")
            forced = c.plan()
        except Exception as e:  # noqa: BLE001 - reported on that request only
            errors[i] = f"{type(e).__name__}: {e}"
            continue
        if forced is None:
            pending.append((c.matcher, i))
        else:
            bitmask[i] = 0
            bitmask[i, forced >> 5] = np.uint32(1 << (forced & 31)).view(np.int32)
    if pending:
        if executor is None:
            import llguidance

            executor = llguidance.LLExecutor()
        fill_next_token_bitmask_par(executor, pending, bitmask)
    return errors
