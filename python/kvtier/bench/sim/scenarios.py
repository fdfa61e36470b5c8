"""Named simulation scenarios: the model, the hardware, the workload and the configurations
compared.

``kimi-mi355x-128`` reproduces the published measurement (WORKLOAD.md): Kimi K2 shapes on one
node of 8x MI355X with tensor parallelism 8, 128 concurrent coding sessions, each cache
configuration in turn. ``migration`` puts two such workers behind a router and compares sticky
sessions with sessions that move to the least-loaded worker, their cache either reachable there
(a store shared by both workers) or not (each worker's store is its own). ``tiny`` is a
seconds-long smoke run at CPU scale.

Every assumption is a field or constant here, with its reason beside it; the one fitted value
is :data:`THINK_TIME_SCALE`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kvtier.bench.configs import CONFIGS, BenchConfig
from kvtier.bench.sim.hardware import Efficiency
from kvtier.bench.sim.loop import ROUTERS
from kvtier.bench.workload import check_replay_options
from kvtier.options import check_choice, check_int, check_real
from kvtier.serve.config import SCHEDULE_POLICIES

MI355X_MATRIX_EFFICIENCY = 0.5
"""Fraction of the MI355X matrix peaks that K2's GEMMs and attention reach: an assumption, not
fitted and not measured on an MI355X. At 0.5 the roofline prefills ~89K tokens/s in
16K-token chunks with nothing cached on 8x MI355X (~50K on 8x H200) and re-prefills a
150K-token context in ~4.9 s; ``--matrix-efficiency`` or ``--kernel-csv`` replace it."""

THINK_TIME_SCALE = 6.4
"""The one fitted parameter: recorded think times (capped at :data:`REPLAY_MAX_DELAY_S`, as
kv-cache-tester's replay tool caps them) are replayed this many times longer. Fitted on the
device-only p99 TTFT of ``kimi-mi355x-128`` over the kv-cache-tester traces against the
published 17.3 s (``perf/sim_calibrate.py``; scan in ``perf/results/sim_calibration.json``). At
the recorded pace (1.0) the simulated node is overloaded (device-only p99 141 s, and 101 s even
at 100% matrix efficiency: ``kvtier simulate --scenario kimi-mi355x-128 --trace
../shared/traces/kv-cache-tester --configs device-only --time-scale 1 --max-think-s 600
[--matrix-efficiency 1]``), so the published run's offered load must have been lower than these
traces at 128 sessions; this factor stands for that difference."""

K2_CONTEXT_TOKENS = 262_144
"""Longest prompt accepted: the 256K context of Kimi K2-Instruct-0905 and later K2 releases."""

REPLAY_MAX_DELAY_S = 600.0
"""kv-cache-tester's ``trace_replay_tester.py --max-delay`` default since its commit 73201b7
(2026-04-04; its docs still say 60): a recorded think time is capped at this many seconds
before the time scale multiplies it."""

REPLAY_MAX_CONTEXT_TOKENS = 128_000
"""kv-cache-tester's ``trace_replay_tester.py --max-context`` default: traces whose first
request is longer are left out and a session stops before its first longer request."""

REPLAY_WARM_PREFIX_FRACTION = 0.5
"""kv-cache-tester's ``--warm-prefix-pct`` default: half of the largest tool + system prompt
(0.5 x 23,081 = 11,540 tokens over the kept traces in ``shared/traces``; its 180 whole 64-token
blocks, 11,520 tokens, are shared) is one prefix that every session starts with, as Claude
Code's tool definitions and system prompt repeat across sessions (WORKLOAD.md). Beyond it the
trace's own sharing is kept (sibling sub-agents share their prompt), where the tool fills each
first prompt with fresh text."""

STORES = ("disk", "network")


@dataclass(frozen=True)
class Variant:
    """One configuration a scenario simulates.

    Attributes:
        name: column name in the results.
        cache: the pool's tiers and policies (a ``kvtier bench`` configuration).
        router: how turns pick a worker (:data:`kvtier.bench.sim.loop.ROUTERS`).
        shared_store: the tier below host memory is one store all workers read and write
            (else each worker has its own).
    """

    name: str
    cache: BenchConfig
    router: str = "sticky"
    shared_store: bool = False

    def __post_init__(self) -> None:
        check_choice(f"Variant {self.name!r}: router", self.router, ROUTERS)


@dataclass(frozen=True)
class Replay:
    """The workload and how it is replayed (see :mod:`kvtier.bench.sim.loop`).

    Attributes:
        sessions: sessions taken from the trace or generated (more than ``concurrency``: a
            finished session's slot goes to the next).
        concurrency: sessions active at once.
        max_turns: turns kept per session (None = all).
        token_scale, time_scale, max_think_s: as ``kvtier bench``.
        truncate_input_tokens, warm_prefix_fraction: as :func:`kvtier.bench.workload.load_trace`
            (:data:`REPLAY_MAX_CONTEXT_TOKENS`, :data:`REPLAY_WARM_PREFIX_FRACTION`); None = the
            model's context only; the built-in generator always shares its whole tool + system prompt.
        ramp_s: seconds over which the first ``concurrency`` sessions start.
        warmup_s, duration_s: the measurement window, virtual seconds.
        seed: of the built-in workload generator.
    """

    sessions: int
    concurrency: int
    max_turns: int | None = None
    token_scale: float = 1.0
    time_scale: float = 1.0
    max_think_s: float = 60.0
    truncate_input_tokens: int | None = None
    warm_prefix_fraction: float = 0.0
    ramp_s: float = 0.0
    warmup_s: float = 0.0
    duration_s: float = math.inf
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("sessions", self.sessions, min_value=1)
        check_int("concurrency", self.concurrency, min_value=1)
        check_real("ramp_s", self.ramp_s, min_value=0)
        if not 0 <= self.warmup_s < self.duration_s:
            raise ValueError(f"need 0 <= warmup_s < duration_s, got {self.warmup_s} and {self.duration_s}")
        check_replay_options(self.truncate_input_tokens, self.warm_prefix_fraction)


@dataclass(frozen=True)
class Scenario:
    """A simulated experiment.

    Attributes:
        name, description: as listed by ``kvtier simulate --list``.
        model: model preset (``kimi-k2``, ``tiny``).
        node: hardware preset of each worker (``mi355x``, ``h200``).
        workers: workers behind the router.
        store: link of the tier below host memory: ``"disk"`` (the node's NVMe) or
            ``"network"`` (a remote store over the GPUs' NICs).
        page_size: tokens per page and block (a multiple of the workload's block size).
        max_num_batched_tokens: token budget per step.
        efficiency: kernel efficiencies and fixed costs of the step timer.
        replay: workload and closed loop.
        variants: configurations compared, in column order.
        baseline: the variant ratios are taken against.
        max_context_tokens: longest prompt accepted.
        device_fraction: None sizes the device tier from HBM; a number sizes it as ``kvtier
            bench`` does, as a fraction of the working set (for CPU-scale scenarios).
        kv_dtype_bytes, weight_dtype_bytes: bytes per KV value and per linear weight.
        calibration: what the scenario's fitted values were fitted on ("" = nothing fitted).
        schedule_policy: the engines' admission order (``EngineConfig.schedule_policy``):
            ``fcfs``, under which the scenarios were calibrated, unless overridden.
    """

    name: str
    description: str
    model: str
    node: str
    workers: int
    store: str
    page_size: int
    max_num_batched_tokens: int
    efficiency: Efficiency
    replay: Replay
    variants: tuple[Variant, ...]
    baseline: str
    max_context_tokens: int = K2_CONTEXT_TOKENS
    device_fraction: float | None = None
    kv_dtype_bytes: float = 1.0
    weight_dtype_bytes: float = 1.0
    calibration: str = ""
    schedule_policy: str = "fcfs"

    def __post_init__(self) -> None:
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names) or self.baseline not in names:
            raise ValueError(f"scenario {self.name!r}: variant names {names} must be unique and include "
                             f"the baseline {self.baseline!r}")
        check_choice(f"scenario {self.name!r}: store", self.store, STORES)
        check_int(f"scenario {self.name!r}: workers", self.workers, min_value=1)
        check_real(f"scenario {self.name!r}: kv_dtype_bytes", self.kv_dtype_bytes, min_value=0, min_open=True,
                   max_value=8)
        check_choice(f"scenario {self.name!r}: schedule_policy", self.schedule_policy, SCHEDULE_POLICIES)

    def select(self, names: list[str]) -> Scenario:
        """This scenario with only the variants ``names`` (in that order).

        Raises:
            ValueError: an unknown name, naming the valid ones.
        """
        by_name = {v.name: v for v in self.variants}
        if not names:
            raise ValueError(f"--configs: no configuration named; expected some of {list(by_name)}")
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise ValueError(f"--configs: unknown configuration(s) {unknown} for scenario {self.name!r}; "
                             f"expected some of {list(by_name)}")
        chosen = tuple(by_name[n] for n in names)
        baseline = self.baseline if self.baseline in names else names[0]
        return dataclasses.replace(self, variants=chosen, baseline=baseline)


def _cache_variants(*names: str) -> tuple[Variant, ...]:
    return tuple(Variant(n, CONFIGS[n]) for n in names)


# Engine settings of the MI355X scenarios (assumptions, each with its reason):
_MI355X_ENGINE = {
    "node": "mi355x",
    # 256-token pages (4 trace blocks): prefix hits are rounded down to 256 tokens (< 0.3% of a
    # 100K-token context); 64-token pages take four times as long to simulate.
    "page_size": 256,
    # SGLang's chunked-prefill size for GPUs with more than ~160 GB of memory.
    "max_num_batched_tokens": 16384,
    "efficiency": Efficiency(matrix=MI355X_MATRIX_EFFICIENCY, memory=0.8, layer_overhead_s=60e-6, step_overhead_s=2e-3),
    # bf16 KV (68.6 KiB per token): WORKLOAD.md sizes the published run's cache in bf16, and
    # bf16 is what SGLang's and vLLM's default KV dtype ("auto") gives K2.
    "kv_dtype_bytes": 2.0,
}

# The published replay: 128 sessions at once, ramped in over 5 minutes (a running service's
# sessions are not in phase; an assumption: the published start schedule is not known, and the
# tiered p99 rests on it, see ``perf/sim_calibrate.py --ramp-grid``); turns submitted for one
# hour, all reported (first turns included, as a replay experiment measures them). Think times:
# recorded ones, capped at 600 s, scaled.
# Sessions stop before their first prompt over 128,000 tokens and share a warm tool + system
# prefix: kv-cache-tester's replay defaults (the constants above).
_MI355X_REPLAY = Replay(sessions=256, concurrency=128, max_turns=None, token_scale=1.0, time_scale=THINK_TIME_SCALE,
                        max_think_s=REPLAY_MAX_DELAY_S * THINK_TIME_SCALE,
                        truncate_input_tokens=REPLAY_MAX_CONTEXT_TOKENS,
                        warm_prefix_fraction=REPLAY_WARM_PREFIX_FRACTION, ramp_s=300.0, warmup_s=0.0, duration_s=3600.0)

_TIERED_WT = CONFIGS["tiered-write-through"]

# Two workers, each with the single node's load: 256 sessions at once (the kv-cache-tester
# folder has fewer sessions than that within the context, so the built-in generator is the
# default here). Write-through, so a session's blocks reach the store while it is served.
_MIGRATION_REPLAY = dataclasses.replace(_MI355X_REPLAY, sessions=512, concurrency=256)

_CALIBRATION = ("think-time scale fitted on the device-only p99 TTFT over the kv-cache-tester traces "
                "(--trace ../shared/traces/kv-cache-tester); other workloads carry a different load")

SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario(name="kimi-mi355x-128",
             description="K2 on 8x MI355X (TP8), 128 concurrent coding sessions, each cache configuration",
             model="kimi-k2", workers=1, store="disk", replay=_MI355X_REPLAY, **_MI355X_ENGINE,
             variants=_cache_variants("device-only", "tiered", "tiered-write-through", "tiered-tool-aware"),
             baseline="device-only", calibration=_CALIBRATION),
    Scenario(name="migration",
             description="two 8x MI355X workers, 256 sessions at a time: sticky vs moved to the least-loaded worker, "
                         "cache reachable there or not",
             model="kimi-k2", workers=2, store="network", replay=_MIGRATION_REPLAY, **_MI355X_ENGINE,
             variants=(Variant("sticky", _TIERED_WT), Variant("migrate", _TIERED_WT, router="least-loaded"),
                       Variant("migrate-reachable", _TIERED_WT, router="least-loaded", shared_store=True)),
             baseline="sticky", calibration=_CALIBRATION),
    Scenario(name="tiny", description="CPU-scale smoke run: tiny model, 6 built-in sessions, device-only vs tiered",
             model="tiny", node="h200", workers=1, store="disk", page_size=1, max_num_batched_tokens=64,
             efficiency=Efficiency(), max_context_tokens=8192, device_fraction=0.25,
             replay=Replay(sessions=6, concurrency=3, max_turns=3, token_scale=1 / 64, time_scale=0.01,
                           max_think_s=1.0, ramp_s=1.0),
             variants=_cache_variants("device-only", "tiered"), baseline="device-only"),
)}


def scenario(name: str) -> Scenario:
    """The scenario called ``name``.

    Raises:
        ValueError: unknown name, listing the known ones.
    """
    if name not in SCENARIOS:
        raise ValueError(f"--scenario: unknown scenario {name!r}; expected one of {list(SCENARIOS)}")
    return SCENARIOS[name]
