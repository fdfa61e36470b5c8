"""The resume target (``kvtier serve --resume-ttft-s S``): the turns that resume a session after a
tool wait, and those whose TTFT missed ``S``, by why.

A resume is the first turn of a session after a turn that ended in tool calls (the pool was told
the session waits on a tool, with the turn's full pages). It misses when its TTFT is over ``S``:

- ``evicted``: fewer of its prompt tokens were found cached (any tier) than it shares, in full
  pages, with the waiting turn's prompt and output (capped at the prompt's full pages before its
  last token): blocks were dropped while the tool ran;
- ``prefetch_late``: all were found, but some on the host, disk or remote tier, so they were
  loaded when the turn was admitted (the prefetch had not brought them back in time);
- ``queued``: all were on the device: the time went to waiting for a slot and to computing;
- ``prefill``: counted before the others: the turn's own new tokens (its prompt past those it can
  find, above) take longer than ``S`` to prefill in a step of their own, by the scheduler's
  step-time model (:meth:`kvtier.serve.engine.Engine.prefill_time_s`): no cache policy or
  scheduling could have met ``S``.

Engine thread only (no locking).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

REASONS = ("evicted", "prefetch_late", "queued", "prefill")


@dataclass
class ResumeStats:
    """Resumes seen and resume-target misses by reason (with a target set)."""

    resumes: int = 0
    misses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))


def findable_tokens(kept_tokens: int, prompt_tokens: int, page_size: int) -> int:
    """Prompt tokens a resume can find cached: those it shares with the waiting turn in full pages
    (``kept_tokens``), capped at the prompt's full pages before its last token."""
    return min(kept_tokens, (max(prompt_tokens - 1, 0) // page_size) * page_size)


def miss_reason(ttft_s: float | None, target_s: float, kept_tokens: int, prompt_tokens: int, cached_tokens: int,
                cached_by_tier: dict, page_size: int,
                prefill_s: Callable[[int, int], float | None] | None = None) -> str | None:
    """Why a resumed turn missed ``target_s`` (one of :data:`REASONS`), None if it did not (or
    it has no TTFT: it failed before its first token). Tokens are counts; times seconds.

    ``prefill_s(new_tokens, cached_tokens)``: estimated seconds of a step that prefills only
    ``new_tokens`` after ``cached_tokens`` (asked only for a miss, with the prompt past
    :func:`findable_tokens`); None, or an estimate of None (no fit yet): never ``prefill``.
    """
    if ttft_s is None or ttft_s <= target_s:
        return None
    findable = findable_tokens(kept_tokens, prompt_tokens, page_size)
    own_s = prefill_s(prompt_tokens - findable, findable) if prefill_s is not None else None
    if own_s is not None and own_s > target_s:
        return "prefill"
    if cached_tokens < findable:
        return "evicted"
    if any(v for tier, v in cached_by_tier.items() if tier != "device"):
        return "prefetch_late"
    return "queued"


def shared_prefix(a, b) -> int:
    """Length of the common prefix of two token id sequences."""
    a, b = np.asarray(a), np.asarray(b)
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class ResumeTracker:
    """Resumes of the server's sessions against the target ``target_s`` (None: no target; resumes
    are still counted). ``prefill_s(new_tokens, cached_tokens)``: estimated seconds of a prefill
    chunk in a step of its own, or None (:meth:`kvtier.serve.engine.Engine.prefill_time_s`; None:
    no ``prefill`` reason)."""

    def __init__(self, page_size: int, target_s: float | None = None,
                 prefill_s: Callable[[int, int], float | None] | None = None):
        self.page_size, self.prefill_s = page_size, prefill_s
        self.target_s = None
        self.set_target(target_s)
        self.stats = ResumeStats()
        self._pending: dict[str, object] = {}  # session -> its waiting turn's ids, then the tokens shared

    def set_target(self, target_s: float | None) -> None:
        if target_s is not None and not 0 < target_s < float("inf"):
            raise ValueError(f"--resume-ttft-s must be a finite number > 0, got {target_s!r}")
        self.target_s = target_s

    def begin(self, session_id: str, waiting_ids) -> None:
        """``session_id`` ended a tool wait with a new request (its turn is a resume);
        ``waiting_ids``: the prompt and output of the turn it waited after."""
        if waiting_ids is not None:
            self._pending[session_id] = list(waiting_ids)

    def accepted(self, session_id: str, prompt_ids) -> None:
        """The resuming request of ``session_id`` was queued with ``prompt_ids``: the tokens it
        can find cached are its full pages shared with the waiting turn."""
        waiting = self._pending.get(session_id)
        if isinstance(waiting, list):
            self._pending[session_id] = shared_prefix(waiting, prompt_ids) // self.page_size * self.page_size

    def end(self, session_id: str | None, final) -> None:
        """A turn of ``session_id`` ended (``final``: its :class:`~kvtier.serve.api.jobs.Final`,
        None when aborted: not counted)."""
        kept = self._pending.pop(session_id, None) if session_id is not None else None
        if not isinstance(kept, int) or final is None or final.error is not None:
            return
        self.stats.resumes += 1
        if self.target_s is None:
            return
        why = miss_reason(final.ttft_s, self.target_s, kept, final.prompt_tokens, final.cached_tokens,
                          final.cached_tokens_by_tier, self.page_size, self.prefill_s)
        if why is not None:
            self.stats.misses[why] += 1

    def snapshot(self) -> dict:
        return {"resumes": self.stats.resumes, "misses": dict(self.stats.misses), "target_s": self.target_s}
