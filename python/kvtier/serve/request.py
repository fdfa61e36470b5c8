"""A request as the engine tracks it: its tokens, pages and progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from kvtier.serve.params import RequestMetrics, SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request's state.

    ``num_computed_tokens`` counts tokens whose KV is in this sequence's pages (computed or
    reused); the tokens ``[num_computed_tokens, num_tokens)`` still have to run.

    ``prompt_token_ids`` is None for a prompt known only by its length (``num_prompt_tokens``)
    and the hashes of every block it will fill (``block_hashes``): what the pool needs
    (:class:`kvtier.cache.kv_state.KVState`) and all a timed runner needs; reading its tokens
    raises.
    """

    seq_id: int
    prompt_token_ids: list[int] | None
    params: SamplingParams
    metrics: RequestMetrics
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    page_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    finish_reason: str | None = None
    # Where the reused prompt tokens came from (tokens per tier): of the last prefix placement,
    # and as reported (the first admission's).
    prefix_tokens_by_tier: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0})
    cached_tokens_by_tier: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0})
    # Tier each reused block was first served from to this sequence (hash -> tier name).
    hit_tiers: dict[bytes, str] = field(default_factory=dict)
    prefix_done: bool = False  # the cached prefix was matched (and loaded) since the last admission
    admitted: bool = False  # admitted at least once (num_cached_tokens is set on the first admission only)
    num_passed_over: int = 0  # steps in which a later arrival got prefill tokens and this one none
    error: str | None = None
    constraint: object | None = None  # kvtier.toolcall.ToolCallConstraint of a request with tools
    parser: object | None = None  # kvtier.toolcall.ToolCallParser when the engine has a tokenizer
    salt: bytes = b""  # this request's cache salt, mixed into its block hashes after the engine's
    num_prompt_tokens: int | None = None  # given only when prompt_token_ids is None

    def __post_init__(self) -> None:
        if self.prompt_token_ids is not None:
            self.num_prompt_tokens = len(self.prompt_token_ids)
        elif self.num_prompt_tokens is None:
            raise ValueError("a Sequence needs prompt_token_ids or num_prompt_tokens")
        if self.params.prompt_logprobs and not self.prompt_logprobs:
            self.prompt_logprobs = [None] * (self.num_prompt_tokens - 1)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    def token_ids(self, start: int = 0, end: int | None = None) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output.

        Raises:
            ValueError: the prompt was given by its block hashes only.
        """
        if self.prompt_token_ids is None:
            raise ValueError(f"request {self.seq_id} was given block hashes, not token ids: its hashes must cover "
                             "every block the pool indexes")
        n = self.num_prompt_tokens
        end = self.num_tokens if end is None else end
        if end <= n:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids[start:] if start < n else []) + self.output_token_ids[max(start - n, 0):end - n]
