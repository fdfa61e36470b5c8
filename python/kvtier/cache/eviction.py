"""Eviction policies of the pool (``PoolConfig.cache_policy``), the resume-target plan of a
tool-waiting session (:func:`plan_resume`) and the tool-wait estimate."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from kvtier.options import check_real


def _check_target(resume_ttft_s, capacity_blocks) -> None:
    if resume_ttft_s is not None and not (isinstance(resume_ttft_s, (int, float)) and not isinstance(resume_ttft_s, bool)
                                          and 0 < resume_ttft_s < float("inf")):
        raise ValueError(f"resume_ttft_s must be a finite number > 0 or None, got {resume_ttft_s!r}")
    if capacity_blocks is not None and (not isinstance(capacity_blocks, int) or capacity_blocks < 0):
        raise ValueError(f"capacity_blocks must be an int >= 0 or None, got {capacity_blocks!r}")


class LRUPolicy:
    """Evict the least recently freed device page first (the pool's free-page order)."""

    name = "lru"
    resume_ttft_s: float | None = None

    def set_resume_target(self, resume_ttft_s: float | None, capacity_blocks: int | None = None) -> None:
        """The resume target in seconds (None: none): LRU keeps and prefetches nothing for it
        (its misses are still counted by the server); see :meth:`ToolAwarePolicy.set_resume_target`."""
        _check_target(resume_ttft_s, capacity_blocks)
        self.resume_ttft_s = resume_ttft_s

    def pick_page(self, free_pages, page_hash, now: float) -> int:
        """The free page to reuse next; ``free_pages`` is in LRU order (front = oldest)."""
        return next(iter(free_pages))

    def tool_wait(self, session_id, hashes: list[bytes], expected_wait_s: float, now: float,
                  load_s: float = 0.0) -> None:
        """A session starts waiting on a tool (no effect under LRU). ``load_s``: the cost model's
        seconds to load its blocks back from the tier below the device (used with a resume target)."""

    def tool_return(self, session_id) -> None:
        """The session's tool returned (no effect under LRU)."""

    def due_prefetches(self, now: float) -> list[list[bytes]]:
        """Block chains to load back onto the device now (none under LRU)."""
        return []


@dataclass(frozen=True)
class ResumePlan:
    """What the pool does with a tool-waiting session's blocks under a resume target (times are
    the pool clock's seconds).

    Attributes:
        kept: the blocks stay on the device through the whole wait (capacity allowed it).
        keep_until: eviction skips the session's device blocks until then.
        prefetch_at: blocks no longer on the device are loaded back from then on.
        hold_until: once prefetched, the loaded blocks are protected until then.
    """

    kept: bool
    keep_until: float
    prefetch_at: float
    hold_until: float


def plan_resume(now: float, expected_wait_s: float, load_s: float, num_blocks: int, kept_blocks: int,
                capacity_blocks: int | None, target_s: float, *, ttl_fraction: float = 0.5, max_ttl_s: float = 30.0,
                keep_fraction: float = 0.5, margin_fraction: float = 0.25, hold_fraction: float = 1.0) -> ResumePlan:
    """Keep or prefetch a session's ``num_blocks`` blocks so that its next turn, expected
    ``expected_wait_s`` seconds after ``now``, finds them on the device (its TTFT within
    ``target_s`` when capacity allows).

    - **Keep** when the blocks already kept through their waits (``kept_blocks``) plus these fit
      in ``keep_fraction`` of the device (``capacity_blocks`` pages; None: unbounded): protected
      until the expected return plus a grace of ``max(target_s, hold_fraction * expected_wait_s)``
      (a return later than the estimate still finds them).
    - Else **demote, then prefetch**: protected for the usual TTL
      ``min(ttl_fraction * expected_wait_s, max_ttl_s)``, then ordinary victims; the prefetch
      starts at ``expected return - load_s - margin`` with ``margin = margin_fraction *
      expected_wait_s`` (half the returns come before a median estimate; the margin covers the
      early ones), so the load has ended when the turn arrives; then held as a kept block is.

    A kept session is prefetched at the same time too: what pressure evicted despite the
    protection (it never blocks progress) comes back.

    Args:
        now, expected_wait_s, load_s, target_s: seconds (``load_s``: the cost model's estimate of
            loading the blocks from the tier below the device, :meth:`CostModel.prefix_load_s`).
        num_blocks, kept_blocks, capacity_blocks: counts of blocks (device pages).

    Raises:
        ValueError: a negative or non-finite time, a negative count, or a fraction out of range.
    """
    for name, v in (("now", now), ("expected_wait_s", expected_wait_s), ("load_s", load_s), ("target_s", target_s)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    if num_blocks < 0 or kept_blocks < 0 or (capacity_blocks is not None and capacity_blocks < 0):
        raise ValueError(f"block counts must be >= 0, got num_blocks={num_blocks}, kept_blocks={kept_blocks}, "
                         f"capacity_blocks={capacity_blocks}")
    if not 0 <= keep_fraction <= 1 or min(ttl_fraction, max_ttl_s, margin_fraction, hold_fraction) < 0:
        raise ValueError("keep_fraction must be in [0, 1]; ttl_fraction, max_ttl_s, margin_fraction and "
                         "hold_fraction must be >= 0")
    back = now + expected_wait_s
    hold_until = back + max(target_s, hold_fraction * expected_wait_s)
    prefetch_at = max(now, back - load_s - margin_fraction * expected_wait_s)
    if capacity_blocks is None or kept_blocks + num_blocks <= keep_fraction * capacity_blocks:
        return ResumePlan(True, hold_until, prefetch_at, hold_until)
    ttl = min(ttl_fraction * expected_wait_s, max_ttl_s)
    return ResumePlan(False, now + ttl, prefetch_at, hold_until)


@dataclass
class _Waiting:
    hashes: list[bytes]
    keep_until: float
    prefetch_at: float
    prefetched: bool = False
    hold_until: float | None = None  # resume target: protected until then once prefetched
    kept: bool = False  # resume target: kept through the wait


class ToolAwarePolicy(LRUPolicy):
    """Keep a tool-waiting session's device blocks for a TTL, then demote, then prefetch back.

    While a session waits on a tool expected to take ``w`` seconds, its device blocks are
    skipped by eviction for ``ttl = min(ttl_fraction * w, max_ttl_s)`` (short waits: the
    session is back before the pages are needed elsewhere). After the TTL the blocks are
    ordinary LRU victims: they are demoted to the lower tiers (write-through copied them
    already; write-back copies them on eviction). ``prefetch_lead_s`` before the expected
    return, blocks no longer on the device are loaded back, so the next turn finds them there.
    If every free page is protected, the oldest is taken anyway (a TTL never blocks progress).

    With a resume target (``resume_ttft_s``, ``kvtier serve --resume-ttft-s``) each wait follows
    :func:`plan_resume` instead: kept on the device through the wait while the kept sessions fit
    in ``keep_fraction`` of ``capacity_blocks``, else demoted after the TTL and prefetched back
    ``load_s`` plus a margin before the expected return (then held until the turn arrives).

    Args:
        ttl_fraction: share of the expected wait during which blocks stay on the device.
        max_ttl_s: upper bound of the TTL in seconds.
        prefetch_lead_s: how long before the expected return to start loading back (no target).
        resume_ttft_s: the resume target in seconds (None: none).
        capacity_blocks: device pages of the pool (the pool sets it with the target).
        keep_fraction, margin_fraction, hold_fraction: see :func:`plan_resume`.
    """

    name = "tool-aware"

    def __init__(self, ttl_fraction: float = 0.5, max_ttl_s: float = 30.0, prefetch_lead_s: float = 2.0, *,
                 resume_ttft_s: float | None = None, capacity_blocks: int | None = None, keep_fraction: float = 0.5,
                 margin_fraction: float = 0.25, hold_fraction: float = 1.0):
        if not (0 <= ttl_fraction and 0 <= max_ttl_s and 0 <= prefetch_lead_s):
            raise ValueError("ttl_fraction, max_ttl_s and prefetch_lead_s must be >= 0")
        if not 0 <= keep_fraction <= 1 or min(margin_fraction, hold_fraction) < 0:
            raise ValueError("keep_fraction must be in [0, 1]; margin_fraction and hold_fraction must be >= 0")
        self.ttl_fraction, self.max_ttl_s, self.prefetch_lead_s = ttl_fraction, max_ttl_s, prefetch_lead_s
        self.resume_ttft_s, self.capacity_blocks = None, capacity_blocks
        self.set_resume_target(resume_ttft_s, capacity_blocks)
        self.keep_fraction, self.margin_fraction, self.hold_fraction = keep_fraction, margin_fraction, hold_fraction
        self.sessions: dict[object, _Waiting] = {}
        # A block is protected until the latest TTL of the waiting sessions that hold it; both
        # maps are kept up to date per session, so a tool event costs O(that session's blocks).
        self._protected: dict[bytes, float] = {}
        self._holders: dict[bytes, dict[object, float]] = {}  # block -> {waiting session: its TTL end}

    def set_resume_target(self, resume_ttft_s: float | None, capacity_blocks: int | None = None) -> None:
        """Set (or clear, None) the resume target in seconds and the device pages it plans with.

        Raises:
            ValueError: a target that is not a finite number > 0, or a negative capacity.
        """
        _check_target(resume_ttft_s, capacity_blocks)
        self.resume_ttft_s = resume_ttft_s
        if capacity_blocks is not None:
            self.capacity_blocks = capacity_blocks

    def kept_blocks(self, now: float) -> int:
        """Blocks of the sessions kept through their waits (resume target) and still protected."""
        return sum(len(w.hashes) for w in self.sessions.values() if w.kept and w.keep_until > now)

    def tool_wait(self, session_id, hashes, expected_wait_s, now, load_s=0.0):
        check_real("expected_wait_s", expected_wait_s, min_value=0.0)
        check_real("load_s", load_s, min_value=0.0)
        self.tool_return(session_id)  # a new wait replaces the old one
        hashes = list(hashes)
        if self.resume_ttft_s is None:
            ttl = min(self.ttl_fraction * expected_wait_s, self.max_ttl_s)
            w = _Waiting(hashes, now + ttl, now + max(expected_wait_s - self.prefetch_lead_s, 0.0))
        else:
            plan = plan_resume(now, expected_wait_s, load_s, len(hashes), self.kept_blocks(now), self.capacity_blocks,
                               self.resume_ttft_s, ttl_fraction=self.ttl_fraction, max_ttl_s=self.max_ttl_s,
                               keep_fraction=self.keep_fraction, margin_fraction=self.margin_fraction,
                               hold_fraction=self.hold_fraction)
            w = _Waiting(hashes, plan.keep_until, plan.prefetch_at, hold_until=plan.hold_until, kept=plan.kept)
        self.sessions[session_id] = w
        self._protect(session_id, w)

    def _protect(self, session_id, w: _Waiting) -> None:
        for h in w.hashes:
            self._holders.setdefault(h, {})[session_id] = w.keep_until
            self._protected[h] = max(self._protected.get(h, 0.0), w.keep_until)

    def tool_return(self, session_id):
        w = self.sessions.pop(session_id, None)
        if w is None:
            return
        for h in w.hashes:
            holders = self._holders.get(h)
            if holders is None or holders.pop(session_id, None) is None:
                continue  # a block listed twice
            if holders:
                self._protected[h] = max(0.0, *holders.values())
            else:
                del self._holders[h]
                self._protected.pop(h, None)

    def pick_page(self, free_pages, page_hash, now):
        for page in free_pages:
            h = page_hash[page]
            if h is None or self._protected.get(h, 0.0) <= now:
                return page
        return next(iter(free_pages))

    def due_prefetches(self, now):
        due = []
        for sid, w in self.sessions.items():
            if not w.prefetched and now >= w.prefetch_at:
                w.prefetched = True
                if w.hold_until is not None and w.hold_until > w.keep_until:
                    w.keep_until = w.hold_until  # what comes back stays until the turn arrives
                    self._protect(sid, w)
                due.append(w.hashes)
        return due


def make_policy(name: str) -> LRUPolicy:
    """The eviction policy called ``name`` (see :data:`CACHE_POLICIES`)."""
    return {"lru": LRUPolicy, "tool-aware": ToolAwarePolicy}[name]()


class ToolWaitEstimate:
    """Median of the last ``window`` observed tool waits (seconds)."""

    def __init__(self, initial_s: float, window: int = 64):
        self.initial_s = initial_s
        self.observed: deque[float] = deque(maxlen=window)

    def value(self) -> float:
        return statistics.median(self.observed) if self.observed else self.initial_s
