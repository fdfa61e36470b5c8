"""A request as the engine tracks it: its tokens, pages and progress."""

from __future__ import annotations

import enum
from dataclasses import InitVar, dataclass, field

import torch

from kvtier.cache.kv_state import KVState
from kvtier.serve.params import RequestMetrics, SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request's state.

    Its KV state in the pool (pages, block hashes, hits per tier, loads) is :attr:`kv`, which the
    sequence owns and the pool reads and writes. ``num_computed_tokens`` (kept in ``kv``) counts
    tokens whose KV is in its pages (computed or reused); the tokens ``[num_computed_tokens,
    num_tokens)`` still have to run. Only the scheduler advances it.

    Args (besides the fields):
        prompt_block_hashes: the chained hashes of the prompt's first full blocks, when known
            (they are not computed again); None = none.
        cache_salt: the request's own salt of its block hashes (``KVState.salt``).

    ``prompt_token_ids`` is None for a prompt known only by its length (``num_prompt_tokens``)
    and the hashes of every block it will fill (``prompt_block_hashes``): what the pool needs
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
    num_cached_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token: (id, logprob), best first
    prompt_logprobs: list[float | None] = field(default_factory=list)
    finish_reason: str | None = None
    # Where the reused prompt tokens came from (tokens per tier), as reported (the first
    # admission's; the last placement's are in kv.prefix_tokens_by_tier).
    cached_tokens_by_tier: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0})
    prefix_done: bool = False  # the cached prefix was matched (and loaded) since the last admission
    admitted: bool = False  # admitted at least once (num_cached_tokens is set on the first admission only)
    num_passed_over: int = 0  # steps in which a later arrival got prefill tokens and this one none
    error: str | None = None
    constraint: object | None = None  # kvtier.toolcall.ToolCallConstraint of a request with tools
    parser: object | None = None  # kvtier.toolcall.ToolCallParser when the engine has a tokenizer
    num_parsed_tokens: int = 0  # output tokens fed to ``parser`` so far (Engine.take_events, Engine._output)
    num_prompt_tokens: int | None = None  # given only when prompt_token_ids is None
    # prompt positions a later request comes back to (the renderer's boundaries: the end of the
    # tool declaration, of the last history message); a hybrid model checkpoints their pages
    checkpoint_at: tuple[int, ...] = ()
    kv: KVState = field(init=False, repr=False)
    prompt_block_hashes: InitVar[list[bytes] | None] = None
    cache_salt: InitVar[bytes] = b""

    def __post_init__(self, prompt_block_hashes: list[bytes] | None, cache_salt: bytes) -> None:
        if self.prompt_token_ids is not None:
            self.num_prompt_tokens = len(self.prompt_token_ids)
        elif self.num_prompt_tokens is None:
            raise ValueError("a Sequence needs prompt_token_ids or num_prompt_tokens")
        self.kv = KVState(self, salt=cache_salt, block_hashes=list(prompt_block_hashes or []))
        if self.params.prompt_logprobs and not self.prompt_logprobs:
            self.prompt_logprobs = [None] * (self.num_prompt_tokens - 1)

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is in the sequence's pages (``kv.num_computed_tokens``)."""
        return self.kv.num_computed_tokens

    @num_computed_tokens.setter
    def num_computed_tokens(self, n: int) -> None:
        self.kv.num_computed_tokens = n

    @property
    def page_ids(self) -> list[int]:
        """Its device pages, i.e. its row of ``block_table`` (``kv.page_ids``; the pool's to change)."""
        return self.kv.page_ids

    @property
    def block_hashes(self) -> list[bytes]:
        """Chained hashes of its full blocks known so far (``kv.block_hashes``)."""
        return self.kv.block_hashes

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
