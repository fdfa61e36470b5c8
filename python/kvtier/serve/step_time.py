"""A step-time model the scheduler learns from the steps it ran, and the resume bound it serves.

:class:`StepTimeModel` fits ``seconds = w . features(batch)`` over recent steps, the features
being :data:`FEATURES` (:func:`step_features`), with non-negative weights
(:func:`fit_nonnegative`). Prefill steps and decode-only steps are kept in two windows so the
many short decode steps of a busy server do not push the prefill terms out of the fit.

With a resume target ``S`` (``kvtier serve --resume-ttft-s``) the scheduler keeps a step's
estimated time under ``RESUME_STEP_SHARE * S`` while a request gets its first token in it or a
session is due back from a tool wait (:meth:`kvtier.cache.pool.KVPool.returns_within`): the
prefill chunks that do not end their prompt are shrunk, largest first
(:func:`bound_step`). A resume then waits at most one short
step for the one in flight and runs in a short one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np

from kvtier.serve.step_plan import ScheduledBatch, pairs

FEATURES = ("step", "prefill_tokens", "prefill_pairs", "decodes", "decode_context")
"""Features of a step (:func:`step_features`): 1, prefill tokens, visible query-key pairs of the
prefill chunks (:func:`kvtier.serve.step_plan.pairs`), decoding sequences, and the sum of the
decodes' contexts (tokens attended)."""

RESUME_STEP_SHARE = 0.4
"""Share of the resume target a step may take while it gives a request its first token or a
session is due back from a tool wait: a resume that arrives during such a step and runs in the
next one waits two of them, 0.8 of the target, which leaves a fifth for the model's error and
short prefix loads. (0.3, 0.35, 0.4 and 0.5 were tried in the simulator, perf/resume_slo.py
--sim kimi-mi355x-128: 0.4 had the fewest misses.)"""


def step_features(extends, num_decodes: int, decode_context: int) -> np.ndarray:
    """[len(FEATURES)] float64 features of a step.

    Args:
        extends: ``(new_tokens, cached_tokens)`` per prefill chunk.
        num_decodes: decoding sequences (one token each).
        decode_context: sum over the decodes of the tokens they attend.
    """
    return np.array([1.0, sum(n for n, _ in extends), sum(pairs(p, n) for n, p in extends), num_decodes,
                     decode_context], dtype=np.float64)


def batch_features(batch: ScheduledBatch) -> np.ndarray:
    """:func:`step_features` of ``batch`` before it runs (its sequences' ``num_computed_tokens``
    not yet advanced)."""
    return step_features([(n, s.num_computed_tokens) for s, n in batch.extends], len(batch.decodes),
                         sum(s.num_computed_tokens + 1 for s in batch.decodes))


def fit_nonnegative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least-squares weights ``w >= 0`` of ``x @ w ~ y``.

    Columns whose unconstrained weight comes out negative are dropped one at a time (the most
    negative first) and the rest refitted until all are >= 0 (an active-set NNLS); columns are
    scaled to unit maximum for the solve.

    Args:
        x: [samples, features] float64; y: [samples] float64.

    Returns:
        [features] float64 weights, 0 for dropped columns.

    Raises:
        ValueError: shapes that do not match or fewer samples than features.
    """
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.ndim != 2 or y.shape != (x.shape[0],) or x.shape[0] < x.shape[1]:
        raise ValueError(f"need x [samples, features] and y [samples] with samples >= features, got x "
                         f"{x.shape} and y {y.shape}")
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    active = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(xs[:, active], y, rcond=None)
        if coef.min() >= 0 or len(active) == 1:
            break
        del active[int(np.argmin(coef))]
    w = np.zeros(x.shape[1])
    w[active] = np.maximum(coef, 0.0) / scale[active]
    return w


class StepTimeModel:
    """Seconds of a step, fitted on the steps run so far.

    Args:
        window: prefill steps kept for the fit (decode-only steps: a quarter as many).
        refit_every: steps observed between refits.

    Attributes:
        weights: [len(FEATURES)] seconds per unit of each feature, or None before the first fit
            (fewer than ``2 * len(FEATURES)`` steps of each kind seen).
    """

    def __init__(self, window: int = 256, refit_every: int = 32):
        if window < 2 * len(FEATURES) or refit_every < 1:
            raise ValueError(f"window must be >= {2 * len(FEATURES)} and refit_every >= 1, got {window}, {refit_every}")
        self._prefill: deque[tuple[np.ndarray, float]] = deque(maxlen=window)
        self._decode: deque[tuple[np.ndarray, float]] = deque(maxlen=max(window // 4, 2 * len(FEATURES)))
        self.refit_every, self._since = refit_every, 0
        self.weights: np.ndarray | None = None

    def observe(self, features: np.ndarray, seconds: float) -> None:
        """Fold one step's features (:func:`step_features`) and measured seconds in (a step with no
        time or a non-finite one is ignored)."""
        if not (seconds > 0 and np.isfinite(seconds)):
            return
        (self._prefill if features[1] > 0 else self._decode).append((features, float(seconds)))
        self._since += 1
        if self._since >= self.refit_every and min(len(self._prefill), len(self._decode)) >= 2 * len(FEATURES):
            self._since = 0
            rows = [*self._prefill, *self._decode]
            self.weights = fit_nonnegative(np.stack([f for f, _ in rows]), np.array([s for _, s in rows]))

    def estimate_s(self, features: np.ndarray) -> float | None:
        """Estimated seconds of a step with ``features``; None before the first fit."""
        return None if self.weights is None else float(features @ self.weights)


def bound_step(batch: ScheduledBatch, model: StepTimeModel, target_s: float | None, page_size: int,
               clock: Callable[[], float], returns_within: Callable[[float, float], bool]) -> bool:
    """Shorten ``batch`` in place to ``RESUME_STEP_SHARE * target_s`` seconds of ``model``'s
    estimated time when it gives a request its first token or a session is due back from a tool
    wait (``returns_within(target_s, est)``: expected from ``target_s`` ago to the step's end,
    :meth:`KVPool.returns_within`): prefill chunks are cut, the largest first, to no less than
    ``page_size`` tokens each (each keeps making progress). Never cut: decodes, and a chunk that
    ends its prompt and, in a step with the decodes alone, would fit the bound or give its
    request its first token within the target of its arrival (``clock``: the requests' clock).
    No target, no fit yet, or a step already short: unchanged.

    Returns:
        whether the step was over the bound and its chunks were considered for cutting.
    """
    if target_s is None or not batch.extends:
        return False
    est = model.estimate_s(batch_features(batch))
    bound = RESUME_STEP_SHARE * target_s
    if est is None or est <= bound:
        return False
    ends = [s.num_computed_tokens + n >= s.num_tokens for s, n in batch.extends]
    if not any(ends) and not returns_within(target_s, est):
        return False
    floor = page_size
    decodes = batch_features(ScheduledBatch(decodes=batch.decodes)) - batch_features(ScheduledBatch())
    now = clock()

    def kept(seq, n: int) -> bool:  # ends its prompt within the bound, or within its target
        t = model.estimate_s(decodes + batch_features(ScheduledBatch(extends=[(seq, n)])))
        return t <= bound or (not seq.output_token_ids and now - seq.metrics.arrival_time + t <= target_s)

    order = sorted((i for i, ((s, n), end) in enumerate(zip(batch.extends, ends))
                    if n > floor and not (end and kept(s, n))), key=lambda i: -batch.extends[i][1])
    for i in order:
        seq, n = batch.extends[i]
        lo, hi = floor, n  # the largest chunk in [floor, n] within the bound, by bisection
        batch.extends[i] = (seq, lo)
        if model.estimate_s(batch_features(batch)) <= bound:
            while hi - lo > floor:
                mid = lo + max(floor, (hi - lo) // 2 // floor * floor)
                batch.extends[i] = (seq, mid)
                if model.estimate_s(batch_features(batch)) <= bound:
                    lo = mid
                else:
                    hi = mid
            batch.extends[i] = (seq, lo)
            break
    return True


class ResumeBound:
    """The scheduler's resume target and the steps it shortened (:func:`bound_step`)."""

    def __init__(self):
        self.target_s: float | None = None
        self.num_bounded_steps = 0

    def set_target(self, resume_ttft_s: float | None) -> None:
        """Bound steps for a resume TTFT of ``resume_ttft_s`` seconds (None: no bound).

        Raises:
            ValueError: a target that is not a finite number > 0.
        """
        if resume_ttft_s is not None and not (isinstance(resume_ttft_s, (int, float)) and not isinstance(
                resume_ttft_s, bool) and 0 < resume_ttft_s < float("inf")):
            raise ValueError(f"resume_ttft_s must be a finite number of seconds > 0 or None, got {resume_ttft_s!r}")
        self.target_s = resume_ttft_s

    def apply(self, batch: ScheduledBatch, model: StepTimeModel, page_size: int, clock: Callable[[], float],
              returns_within: Callable[[float, float], bool]) -> None:
        """:func:`bound_step` under this target, counting the steps it considered cutting."""
        if bound_step(batch, model, self.target_s, page_size, clock, returns_within):
            self.num_bounded_steps += 1


__all__ = ["FEATURES", "RESUME_STEP_SHARE", "ResumeBound", "StepTimeModel", "batch_features", "bound_step", "fit_nonnegative",
           "step_features"]
