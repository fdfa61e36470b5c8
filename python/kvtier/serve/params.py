"""Request-level parameters and results of the offline API."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to generate for one request (vLLM-compatible names).

    Attributes:
        max_tokens: tokens to generate at most (>= 1).
        temperature: 0 = greedy; > 0 scales logits before sampling.
        top_p: nucleus mass in (0, 1].
        seed: per-request generator seed; None uses the engine's generator.
        ignore_eos: keep generating past end-of-sequence tokens.
        logprobs: return the log-probability of each generated token (under the unscaled
            model distribution).
        prompt_logprobs: return the log-probability of each prompt token after the first.

    Raises:
        ValueError: a field out of range.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: bool = False
    prompt_logprobs: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.perf_counter`` seconds) of one request."""

    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, seconds."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_s(self) -> float | None:
        """Arrival to last token, seconds."""
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass
class RequestOutput:
    """The result of one prompt.

    Attributes:
        request_id: engine-assigned id.
        prompt_token_ids: the prompt.
        token_ids: generated token ids.
        logprobs: log-probability of each generated token, or None when not requested.
        prompt_logprobs: ``len(prompt) - 1`` entries, entry ``i`` for prompt token ``i + 1``;
            None when not requested. Entries whose preceding position was served from cached
            pages are ``None`` (their logits were never computed): exactly the first
            ``num_cached_tokens`` entries.
        num_cached_tokens: prompt tokens whose KV came from cached blocks, from any tier.
        cached_tokens_by_tier: the same tokens split by the tier they came from
            (``{"device", "host", "disk"}``).
        finish_reason: ``"length"`` or ``"stop"`` (an end-of-sequence token).
        metrics: timings.
    """

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None
    prompt_logprobs: list[float | None] | None
    num_cached_tokens: int
    finish_reason: str | None
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    metrics: RequestMetrics = field(repr=False, default=None)  # type: ignore[assignment]
