"""What one replay run records: a row per request and the counters of the run."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    """One replayed request (one turn of one session).

    Times are seconds since the start of the run (``time.perf_counter`` based).

    Attributes:
        session_id: the session this turn belongs to.
        turn: index of the turn within its session (0-based).
        input_tokens: prompt length in tokens (after token scaling).
        output_tokens: tokens generated.
        arrival_s: when the request was due (its session's previous turn finished plus the
            think time): what a client measures TTFT from, even if the replay loop was busy
            with an engine step at that moment and submitted it a little later.
        first_token_s: when its first output token was sampled (None: never, e.g. an error).
        finish_s: when it finished (None: not finished when the run ended).
        cached_tokens: prompt tokens served from cached blocks, any tier.
        cached_tokens_by_tier: the same split by tier: ``{"device", "host", "disk"}``.
        error: the engine's error for this request, or None.
        output_token_ids, logprobs: the generated tokens and their log-probabilities, kept only
            when the replay was asked for them (``replay(..., keep_outputs=True)``).
        admitted_s: when the scheduler first gave it pages (its cached prefix placed or its
            loads started); None: never, or not recorded.
        loaded_s: when its loaded pages were usable (``admitted_s`` when nothing was loaded).
        preemptions: times it was preempted before its first token (each one sends it back to
            wait; its computed blocks are reloaded or recomputed when it is admitted again);
            None: not observed, as over HTTP (``kvtier bench --endpoint``).

    TTFT splits into ``queue_wait_s`` (arrival -> admission), ``load_wait_s`` (admission ->
    loaded pages usable) and ``prefill_s`` (-> first token: its prefill chunks, and the steps
    between them); the three add up to ``ttft_s``.
    """

    session_id: str
    turn: int
    input_tokens: int
    output_tokens: int
    arrival_s: float
    first_token_s: float | None
    finish_s: float | None
    cached_tokens: int
    cached_tokens_by_tier: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0})
    error: str | None = None
    output_token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    admitted_s: float | None = None
    loaded_s: float | None = None
    preemptions: int | None = None

    @property
    def queue_wait_s(self) -> float | None:
        """Arrival to admission in seconds (None when not admitted or not recorded)."""
        return None if self.admitted_s is None else self.admitted_s - self.arrival_s

    @property
    def load_wait_s(self) -> float | None:
        """Admission to its loaded pages being usable, in seconds."""
        return None if self.admitted_s is None or self.loaded_s is None else self.loaded_s - self.admitted_s

    @property
    def prefill_s(self) -> float | None:
        """Loaded pages usable to first token, in seconds."""
        return None if self.loaded_s is None or self.first_token_s is None else self.first_token_s - self.loaded_s

    @property
    def tier_mix(self) -> dict[str, int]:
        """Prompt tokens by where they came from: ``{"device", "host", "disk", "computed"}``
        (computed = prefilled on the first admission)."""
        mix = {t: self.cached_tokens_by_tier.get(t, 0) for t in ("device", "host", "disk")}
        mix["computed"] = self.input_tokens - self.cached_tokens
        return mix

    @property
    def ttft_s(self) -> float | None:
        """Time to first token in seconds (None when no token came)."""
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first, in seconds (None for fewer than 2 tokens)."""
        if self.first_token_s is None or self.finish_s is None or self.output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)

    @property
    def e2e_s(self) -> float | None:
        """Arrival to finish in seconds."""
        return None if self.finish_s is None else self.finish_s - self.arrival_s


@dataclass
class ConfigRun:
    """One cache configuration's replay of the workload.

    Attributes:
        name: configuration name (``device-only``, ``tiered``, ...).
        records: one per request submitted.
        wall_s: seconds from the first submission to the last finish.
        recomputed_tokens: prompt tokens that were prefilled (not served from any cache),
            including recomputation after preemption.
        bytes_moved: bytes copied per direction, e.g. ``{"device->host", "host->device",
            "host->disk", "disk->device"}`` (a disk block goes through a host staging buffer).
        copy_errors: failed copies (each ended in recomputation).
        evictions: blocks evicted per tier.
        stores_refused: blocks not copied down per tier (``{"host", "disk"}``) because the tier
            had no room (see ``kvtier.cache.pool.PoolStats``).
        preemptions: running requests preempted when device pages ran out.
        device_pages: device pages per layer; ``working_set_pages``: pages the concurrent
            sessions' contexts need at their peak (for the capacity ratio printed).
        server_counters: False when the engine's own counters (bytes moved, copy errors,
            evictions, refused stores, preemptions, device pages) were not observed, as over HTTP
            (``kvtier bench --endpoint``): the report shows them as unknown, not 0.
        mean_running_batch: sequences running per engine step, averaged over the steps that ran
            any (None: not observed, as over HTTP or in the simulator).
        sections: the pools' counters beyond their blocks', by section name
            (:attr:`kvtier.cache.pool_stats.PoolSnapshot.sections`), summed over the engines;
            empty when the pools keep none or they were not observed.
    """

    name: str
    records: list[RequestRecord]
    wall_s: float
    recomputed_tokens: int = 0
    bytes_moved: dict[str, int] = field(default_factory=dict)
    copy_errors: int = 0
    evictions: dict[str, int] = field(default_factory=dict)
    stores_refused: dict[str, int] = field(default_factory=dict)
    preemptions: int = 0
    device_pages: int = 0
    working_set_pages: int = 0
    server_counters: bool = True
    sections: dict[str, object] = field(default_factory=dict)
    mean_running_batch: float | None = None
