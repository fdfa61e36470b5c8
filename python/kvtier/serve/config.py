"""Engine configuration (validated): the pool's :class:`~kvtier.cache.config.PoolConfig` plus the
scheduler's limits and the engine's own options."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvtier.cache.block_hash import compose_salt
from kvtier.cache.config import PoolConfig
from kvtier.options import check_choice, check_int, check_real

SCHEDULE_POLICIES = ("cache-aware", "fcfs")  # kvtier.serve.admission.POLICIES by name (checked there)
PREEMPTION_MODES = ("swap", "recompute")  # EngineConfig.preemption_mode (vLLM's names for the two)
PREEMPTION_MODE = "swap"
"""Default ``EngineConfig.preemption_mode``: over 5 quiet repeats against the bound (docs/scheduling.md)
``swap`` halved the decode tail of ``recompute`` on both workloads at overlapping p99 TTFT."""
ADMISSION_WATERMARK = 0.0
"""Default ``EngineConfig.admission_watermark``: the share of device pages admission keeps free
for the running sequences' next pages. 0, 0.02 and 0.05 were measured under swap preemption in
the simulator on 32 kv-cache-tester sessions (perf/results/sim_preemption_watermark.json): TPOT
p99 2.34, 2.31 and 4.90 s, TTFT p90 1.23, 1.35 and 1.40 s; none is kept by default."""


@dataclass(frozen=True)
class EngineConfig:
    """The pool's config, the scheduler's limits and the engine's options.

    Attributes:
        pool: the KV pool's sizes and policies (page size, device pages, host/disk/remote tiers,
            eviction and write policies, prefix caching, tenant ``salt``); the engine mixes the
            model's identity and compute dtype into ``pool.salt`` (:meth:`pool_config`), so
            engines with different salts never share cached blocks.
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
        max_num_batched_pairs: under ``cache-aware``, attention budget of one step: the
            query-key pairs of its prefill chunks (a chunk of ``n`` tokens after ``c`` cached or
            computed ones has ``n * c + n * (n + 1) / 2``); None (default): no attention
            budget, steps are bounded by ``max_num_batched_tokens`` alone, as in vLLM's and
            SGLang's chunked prefill. A budget (``B * (B + 1) // 2`` for a ``B``-token step
            budget is the pairs of a first chunk of a fresh prompt) cuts a chunk deep in a long
            context to about the time of a first chunk. It cuts the chunks of running prefills;
            a request's first chunk, at admission, is counted against it but not cut (a cached
            turn's new tokens run in the step that admits it). A step's first running chunk gets
            at least one token whatever the budget.
        max_num_seqs: sequences running or loading at once.
        seed: seed of the engine's sampling generator.
        cuda_graph: replay decode-only steps from CUDA/HIP graphs captured per batch size (1, 2,
            4, .. up to max_num_seqs, at most 64), as vLLM and SGLang do; needs a GPU model (the
            runner raises ValueError otherwise). Off by default until measured.
        schedule_policy: ``cache-aware`` (waiting requests ordered by their estimated cost to
            serve, cached ones first, with aging; see :mod:`kvtier.serve.admission`) or
            ``fcfs`` (arrival order; a request that cannot be placed holds the ones behind it).
        schedule_max_passes: under ``cache-aware``, a request that later arrivals passed over in
            this many steps is served ahead of every request that was not, in arrival order.
        preemption_mode: what a preempted sequence costs when it comes back
            (:mod:`kvtier.serve.preemption`). ``swap``: where the pool keeps evicted
            blocks below the device (``KVPool.keeps_evicted_blocks``), its full blocks go down a
            tier when their pages are reused and load back by copy, and victims are chosen by
            their resume cost (``KVPool.resume_s``): a decode is preempted for a waiting request
            only when bringing it back costs less than waiting for it to end and it has more than
            4 tokens left, least harmed in its time per output token first (the default,
            :data:`PREEMPTION_MODE`: docs/scheduling.md has the measurement).
            ``recompute``: victims are chosen by rank alone (what this engine did before; the
            preempted sequence's blocks are reused while cached). Without a lower tier both act
            as ``recompute``.
        admission_watermark: share of the device pages, in [0, 0.5], that admitting a new request
            must leave free while other sequences run or load, so the running sequences get
            their next pages without a preemption (vLLM's block manager keeps 1%); 0: none. A
            request that was preempted, and a request admitted onto an idle pool, ignore it.

    Every field is checked for its type and range (the pool's by :class:`PoolConfig`); sizes
    that give a host or disk tier of zero blocks are errors when the engine builds its pool (the
    block size depends on the model).

    Raises:
        ValueError: a field of the wrong type or out of range, naming it, the value and what
            was expected.

    Example:
        >>> EngineConfig(pool=PoolConfig(page_size=16, num_device_pages=256), max_num_seqs=8).pool.page_size
        16
        >>> EngineConfig.of(page_size=16, host_cache_bytes=1 << 30, max_num_seqs=8).pool.host_cache_bytes
        1073741824
    """

    pool: PoolConfig = field(default_factory=PoolConfig)
    max_num_batched_tokens: int = 2048
    max_num_batched_pairs: int | None = None
    max_num_seqs: int = 64
    seed: int = 0
    cuda_graph: bool = False
    schedule_policy: str = "cache-aware"
    schedule_max_passes: int = 16
    preemption_mode: str = PREEMPTION_MODE
    admission_watermark: float = ADMISSION_WATERMARK

    def __post_init__(self) -> None:
        if not isinstance(self.pool, PoolConfig):
            raise ValueError(f"pool must be a PoolConfig, got {self.pool!r} ({type(self.pool).__name__})")
        if not isinstance(self.cuda_graph, bool):
            raise ValueError(f"cuda_graph must be a bool, got {self.cuda_graph!r}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "schedule_max_passes"):
            check_int(name, getattr(self, name), min_value=1)
        if self.max_num_batched_pairs is not None:
            check_int("max_num_batched_pairs", self.max_num_batched_pairs, min_value=1)
        check_choice("schedule_policy", self.schedule_policy, SCHEDULE_POLICIES)
        check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        check_real("admission_watermark", self.admission_watermark, min_value=0.0, max_value=0.5)
        check_int("seed", self.seed, min_value=0, max_value=2**63 - 1)

    @staticmethod
    def of(**fields) -> EngineConfig:
        """An engine config from flat keyword arguments: :class:`PoolConfig` fields (``page_size``,
        ``num_device_pages``, ``host_cache_bytes``, ``write_policy``, ``salt``, ...) go to
        ``pool``, the others are this class's (what ``kvtier.LLM(**engine_args)`` takes).

        Raises:
            ValueError: an argument that is neither (naming it and the known ones), or a bad value.
        """
        pool_names = {f.name for f in dataclasses.fields(PoolConfig)}
        own_names = {f.name for f in dataclasses.fields(EngineConfig)} - {"pool"}
        unknown = sorted(set(fields) - pool_names - own_names)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; expected some of {sorted(pool_names | own_names)}")
        pool = PoolConfig(**{k: v for k, v in fields.items() if k in pool_names})
        return EngineConfig(pool=pool, **{k: v for k, v in fields.items() if k in own_names})

    def pool_config(self, model_id: bytes = b"") -> PoolConfig:
        """``pool`` with its salt bound to ``model_id`` (the model's weights and compute dtype):
        ``compose_salt(model_id, pool.salt)`` (length-prefixed, so no two different pairs give
        the same salt)."""
        return dataclasses.replace(self.pool, salt=compose_salt(model_id, self.pool.salt))
