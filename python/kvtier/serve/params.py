"""Request-level parameters and results of the offline API."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier.options import check_bool, check_int, check_real

GREEDY_TEMPERATURE = 1e-5
MAX_PENALTY = 2.0  # |presence_penalty| and |frequency_penalty| at most (OpenAI's range)
MAX_TOP_LOGPROBS = 20  # alternatives per generated token at most (OpenAI's chat range)


@dataclass(frozen=True)
class SamplingParams:
    """How to generate for one request (names as in vLLM; ``logprobs`` and
    ``prompt_logprobs`` are booleans, ``top_logprobs`` asks for alternatives as OpenAI's chat API).

    Attributes:
        max_tokens: tokens to generate at most (>= 1).
        temperature: below 1e-5 = greedy; otherwise scales logits before sampling.
        top_p: nucleus mass in (0, 1].
        seed: per-request generator seed; None uses the engine's generator.
        ignore_eos: keep generating past end-of-sequence tokens.
        logprobs: return the log-probability of each generated token (under the unscaled
            model distribution).
        top_logprobs: with ``logprobs``, also return the ``top_logprobs`` most likely tokens at
            each generated position and their log-probabilities (same distribution), in
            [0, :data:`MAX_TOP_LOGPROBS`]; 0 = none.
        prompt_logprobs: return the log-probability of each prompt token after the first.
        tools: OpenAI-style function tools; when given (non-empty), the whole turn is decoded
            under a grammar of the model's tool-call format (K2's or K3's) whose arguments match each tool's schema
            (:mod:`kvtier.toolcall`), and the output carries ``content`` and ``tool_calls``.
            Parameters must be in the schema subset Kimi's API accepts. Needs an engine with a
            tokenizer (``LLM(..., tokenizer=DIR)``).
        tool_choice: ``"auto"`` (text and/or calls), ``"none"`` (text only), ``"required"``
            (one or more calls, no text) or ``{"type": "function", "function": {"name": NAME}}``.
        parallel_tool_calls: allow several calls in one turn.
        response_format: None, ``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type":
            "json_schema", "json_schema": {"name", "schema", "strict"?}}`` (OpenAI's shapes,
            :func:`kvtier.tokenize.xtml.check_response_format`): the JSON kinds decode the
            answer under a grammar whose text is a JSON object / an instance of ``schema`` (K2:
            the content; K3: the response channel), beside any tool calls ``tool_choice`` allows.
        presence_penalty: subtracted from the logit of every token already generated in this
            request (OpenAI's definition), in [-2, 2]; 0 = off.
        frequency_penalty: subtracted from a token's logit once per time it was generated, in
            [-2, 2]; 0 = off. Both change what is sampled, not the returned logprobs
            (:func:`kvtier.serve.penalties.apply_penalties`).
        refuse_past_context: True: a prompt whose length plus ``max_tokens`` exceeds the
            model's context (``max_position_embeddings``) is refused (ValueError naming
            ``max_tokens`` and both numbers), as vLLM's server refuses it; the HTTP server sets
            it when the client gave a maximum. False (the default): generation stops at the
            context's end with finish reason ``"length"``.

    A constrained turn ends when its grammar is complete (``ignore_eos`` does not apply), and
    when the shortest completion needs all remaining tokens of ``max_tokens`` that completion
    is forced, so calls are not cut off whenever ``max_tokens`` leaves room for one; such a turn
    finishes with ``"length"``, as one cut off does.

    Raises:
        ValueError: a field out of range; for tools, naming ``tools[i]...`` or ``tool_choice``.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: bool = False
    prompt_logprobs: bool = False
    top_logprobs: int = 0
    tools: Any = None
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    refuse_past_context: bool = False
    response_format: Any = None
    # Derived from the tool fields: the turn grammar (None: unconstrained).
    tool_grammar: str | None = field(default=None, init=False, repr=False, compare=False)
    tool_specs: tuple = field(default=(), init=False, repr=False, compare=False)  # ToolSpecs it was built from
    tool_choice_name: str = field(default="auto", init=False, repr=False, compare=False)  # normalised tool_choice
    response_schema: dict | None = field(default=None, init=False, repr=False, compare=False)  # of response_format

    def __post_init__(self) -> None:
        check_int("max_tokens", self.max_tokens, min_value=1)
        check_real("temperature", self.temperature, min_value=0)
        check_real("top_p", self.top_p, min_value=0, min_open=True)
        if self.top_p > 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None:  # None: not seeded
            check_int("seed", self.seed, min_value=0, max_value=2**63 - 1)
        if not isinstance(self.logprobs, bool):
            raise ValueError(f"logprobs must be True or False (alternatives: top_logprobs), got {self.logprobs!r}")
        for name in ("ignore_eos", "prompt_logprobs", "parallel_tool_calls", "refuse_past_context"):
            check_bool(name, getattr(self, name))
        check_int("top_logprobs", self.top_logprobs, min_value=0, max_value=MAX_TOP_LOGPROBS)
        if self.top_logprobs and not self.logprobs:
            raise ValueError(f"top_logprobs={self.top_logprobs} needs logprobs=True")
        for name in ("presence_penalty", "frequency_penalty"):
            check_real(name, getattr(self, name), min_value=-MAX_PENALTY, max_value=MAX_PENALTY)
        self._check_tools()

    def _check_tools(self) -> None:
        if self.response_format is not None:
            from kvtier.tokenize.xtml import check_response_format

            check_response_format(self.response_format)
            kind = self.response_format["type"]
            schema = {"type": "object"} if kind == "json_object" else \
                self.response_format["json_schema"]["schema"] if kind == "json_schema" else None
            object.__setattr__(self, "response_schema", schema)
        if self.tools is None and self.tool_choice == "auto" and self.response_schema is None:
            return
        from kvtier.toolcall import normalize_tool_choice, normalize_tools, turn_grammar

        specs = normalize_tools(self.tools if self.tools is not None else [])
        choice = normalize_tool_choice(self.tool_choice, specs)
        object.__setattr__(self, "tool_choice_name", choice)
        if specs or self.response_schema is not None:
            object.__setattr__(self, "tool_grammar", turn_grammar(specs, choice, self.parallel_tool_calls,
                                                                  self.response_schema))
            object.__setattr__(self, "tool_specs", specs)

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 sample greedily (vLLM's threshold): smaller ones overflow softmax."""
        return self.temperature < GREEDY_TEMPERATURE


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.perf_counter`` seconds) of one request.

    ``arrival_time`` <= ``admitted_time`` (the first step that gave it pages: its cached prefix
    placed or its loads started) <= ``loaded_time`` (its loaded pages usable; equal to
    ``admitted_time`` when nothing was loaded) <= ``first_token_time`` <= ``finish_time``;
    None until reached. A preempted request keeps its first admission's times.
    ``num_preemptions`` counts the times it was preempted before its first token
    (``preemptions_after_first_token`` those after it).
    """

    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    admitted_time: float | None = None
    loaded_time: float | None = None
    num_preemptions: int = 0
    preemptions_after_first_token: int = 0
    arrival_step: int = 0  # Engine.num_steps when it arrived
    finish_step: int | None = None  # Engine.num_steps when it finished

    @property
    def engine_steps(self) -> int | None:
        """Engine steps completed between arrival and finish (how long it waited and ran, counted
        in steps), or None before it finished."""
        return None if self.finish_step is None else self.finish_step - self.arrival_step

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
        prompt_token_ids: the prompt (None for one given by its block hashes only,
            ``Engine.add_hashed_request``).
        token_ids: generated token ids.
        logprobs: log-probability of each generated token, or None when not requested.
        top_logprobs: per generated token, its ``SamplingParams.top_logprobs`` most likely
            alternatives as ``(token_id, logprob)`` pairs, most likely first; None when not
            requested.
        prompt_logprobs: ``len(prompt) - 1`` entries, entry ``i`` for prompt token ``i + 1``;
            None when not requested. Entries whose preceding position was served from cached
            pages are ``None`` (their logits were never computed): exactly the first
            ``num_cached_tokens`` entries.
        num_cached_tokens: prompt tokens whose KV came from cached blocks, from any tier.
        cached_tokens_by_tier: the same tokens split by the tier they came from
            (``{"device", "host", "disk"}``).
        finish_reason: ``"length"`` (``max_tokens`` or the context reached, or a tool grammar
            the budget forced closed), ``"stop"`` (an end-of-sequence token, or a tool grammar
            completed) or ``"error"``.
        error: what went wrong when ``finish_reason == "error"``, else None.
        metrics: timings.
        content: the answer text (special tokens removed), when the engine has a tokenizer;
            else None.
        reasoning_content: text between ``<think>`` and ``</think>`` (None without a tokenizer).
        tool_calls: ``[{"id", "name", "arguments"}]`` with ``arguments`` a JSON string, in
            order (None without a tokenizer).
        tool_call_problems: calls that could not be returned (e.g. ``incomplete`` when the
            output was cut), as :meth:`kvtier.toolcall.ToolCallProblem.to_dict` dicts.
        last_prompt_block: the block hash (16 bytes) of the prompt's last full block, None when
            the prompt has no full block or prefix caching is off: what a router looks up in
            the workers' KV events to find where the prompt's prefix is cached.
        events: the request's tool-call parser events (``kvtier.toolcall.ContentDelta``,
            ``ReasoningDelta``, ``ToolCall``, ``ToolCallProblem``) not already taken with
            ``Engine.take_events``: every event of the output when none were (None without a
            tokenizer). Not compared and not in the repr.
    """

    request_id: int
    prompt_token_ids: list[int] | None
    token_ids: list[int]
    logprobs: list[float] | None
    prompt_logprobs: list[float | None] | None
    num_cached_tokens: int
    finish_reason: str | None
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    metrics: RequestMetrics = field(repr=False, default=None)  # type: ignore[assignment]
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_problems: list[dict] | None = None
    last_prompt_block: bytes | None = None
    events: list | None = field(default=None, repr=False, compare=False)
    top_logprobs: list[list[tuple[int, float]]] | None = None
