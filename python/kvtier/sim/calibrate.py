"""Cost models measured on this machine, and ``kvtier bench`` runs re-enacted in the simulator.

The agreement check (``perf/sim_agreement.py``) asks whether the simulator, given step and copy
costs measured here, predicts what a real ``kvtier bench`` run measures. Its pieces:

- :func:`record_steps` times every ``Engine.step`` of a real engine and the shape of the batch
  it ran (the whole step: scheduling, forward pass, sampling, pool bookkeeping);
- :func:`measure_cpu_costs` replays a *calibration* workload (another seed than the one
  compared) through the real engine, fits a :class:`LinearTimer` (the step-time model the
  simulator then uses) to its steps (:func:`fit_linear_timer`), reads the copy costs the pool
  probed and learned (host and disk tiers) and times the copy engine's per-job cost (its thread
  hand-off, which those leave out);
- :func:`simulate_bench` replays a bench workload in the simulator with those costs and the
  bench's own tier sizes.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from dataclasses import dataclass

import numpy as np
from kvtier.bench.configs import BenchConfig, parse_configs
from kvtier.bench.replay import replay
from kvtier.bench.run import BenchOptions, Sizing, prepare, warm_up
from kvtier.sim.copies import SimDisk, TierLinks
from kvtier.sim.engine import SimWorker
from kvtier.sim.hardware import Link
from kvtier.sim.loop import SimRun, simulate
from kvtier.sim.timing import BatchShape
from kvtier.bench.workload import Workload
from kvtier.cache.cost_model import UNPROBED_TIER, CostModel
from kvtier.cache.disk_tier import DiskTier
from kvtier.cache.host_tier import HostTier
from kvtier.cache.prefix_index import Tier
from kvtier.options import check_real
from kvtier.serve import Engine, EngineConfig
from kvtier.serve.step_time import fit_nonnegative


FEATURES = ("step", "prefill_tokens", "decodes", "extend_pairs", "decode_context", "sequences", "sampled")
"""Features of a step (:func:`features`): 1, prefill tokens, decodes, visible query-key pairs of
the prefill chunks, sum of decode contexts, sequences in the batch, rows sampled."""


def features(shape: BatchShape) -> np.ndarray:
    """[len(FEATURES)] float64 values of :data:`FEATURES` for one step of ``shape``."""
    pairs = sum(n * p + n * (n + 1) / 2 for n, p in shape.extends)
    return np.array([1.0, sum(n for n, _ in shape.extends), shape.num_decodes, pairs, shape.decode_context,
                     len(shape.extends) + shape.num_decodes, shape.num_sampled])


@dataclass(frozen=True)
class LinearTimer:
    """A step-time model for the simulator: ``step_s = sum(coefficients[f] * features(shape)[f])``
    over :data:`FEATURES`, fitted on measured steps (:func:`fit_linear_timer`).

    Attributes:
        coefficients: seconds per unit of each feature, all >= 0 (missing features count 0).
        source: where the coefficients were measured.
    """

    coefficients: dict[str, float]
    source: str = ""

    def __post_init__(self) -> None:
        unknown = set(self.coefficients) - set(FEATURES)
        if unknown:
            raise ValueError(f"LinearTimer.coefficients: unknown feature(s) {sorted(unknown)}; expected {FEATURES}")
        for name, v in self.coefficients.items():
            check_real(f"LinearTimer.coefficients[{name!r}]", v, min_value=0)
        object.__setattr__(self, "_w", np.array([self.coefficients.get(f, 0.0) for f in FEATURES]))

    def step_s(self, shape: BatchShape) -> float:
        """Seconds of one step of ``shape``; 0 for an empty step."""
        if shape.num_tokens == 0:
            return 0.0
        return float(features(shape) @ self._w)


@dataclass
class StepLog:
    """Shapes and wall times (seconds) of the steps a real engine ran."""

    shapes: list[BatchShape] = dataclasses.field(default_factory=list)
    seconds: list[float] = dataclasses.field(default_factory=list)


def record_steps(engine: Engine, log: StepLog) -> None:
    """Instrument ``engine`` (this instance only): every ``step()`` that ran a batch appends the
    batch's :class:`BatchShape` (taken when it was scheduled) and the step's wall time."""
    schedule, step = engine.scheduler.schedule, engine.step
    last: list[BatchShape | None] = [None]

    def timed_schedule():
        batch = schedule()
        if batch:
            last[0] = BatchShape.of(batch)
        return batch

    def timed_step():
        last[0] = None
        t0 = time.perf_counter()
        out = step()
        if last[0] is not None:
            log.shapes.append(last[0])
            log.seconds.append(time.perf_counter() - t0)
        return out

    engine.scheduler.schedule = timed_schedule
    engine.step = timed_step


def fit_linear_timer(shapes: list[BatchShape], seconds: list[float], source: str = "") -> LinearTimer:
    """Least-squares :class:`LinearTimer` with non-negative coefficients
    (:func:`kvtier.serve.step_time.fit_nonnegative`).

    Raises:
        ValueError: fewer samples than features, or lengths that differ.
    """
    if len(shapes) != len(seconds) or len(shapes) < len(FEATURES):
        raise ValueError(f"need as many seconds as shapes and >= {len(FEATURES)} samples, "
                         f"got {len(shapes)} shapes and {len(seconds)} seconds")
    w = fit_nonnegative(np.stack([features(s) for s in shapes]), np.asarray(seconds, dtype=np.float64))
    return LinearTimer({f: float(c) for f, c in zip(FEATURES, w) if c > 0}, source)


@dataclass(frozen=True)
class CpuCosts:
    """What :func:`measure_cpu_costs` measured.

    Attributes:
        timer: step time model fitted to the calibration steps.
        host: host <-> device copy link (from the pool's probe and observed copies).
        disk: disk read link.
        steps: steps measured; fit_rel_error: median |fit - measured| / measured over them.
    """

    timer: LinearTimer
    host: Link
    disk: Link
    steps: int
    fit_rel_error: float


def _link(cost_model: CostModel, tier: Tier, job_s: float) -> Link:
    cost = cost_model.tiers.get(tier, UNPROBED_TIER)
    return Link(bandwidth_Bps=cost.bandwidth_Bps, latency_s=cost.latency_s, job_s=job_s)


def measure_cpu_costs(opts: BenchOptions, calibration_seed: int) -> CpuCosts:
    """Replay the built-in workload of ``calibration_seed`` (``opts``' sizes otherwise) through the
    real engine under ``tiered`` and ``device-only``; fit the step timer to every step.

    Raises:
        ValueError: ``calibration_seed`` equals ``opts.seed`` (the check would be circular).
    """
    if calibration_seed == opts.seed:
        raise ValueError("calibration_seed must differ from the compared workload's seed")
    cal = dataclasses.replace(opts, seed=calibration_seed, trace=None, configs="tiered,device-only")
    model, model_id, workload, sizing, base, _ = prepare(cal)
    warm_up(model, base)
    log = StepLog()
    tier_costs, host_job_s, disk_job_s = None, 0.0, 0.0
    for config in parse_configs(cal.configs):
        disk_dir = tempfile.mkdtemp(prefix="kvtier-sim-calibrate-", dir=cal.disk_cache_dir) if config.disk else None
        try:
            cfg = config.engine_config(base, sizing.host_cache_bytes, disk_dir, sizing.disk_cache_bytes)
            engine = Engine(model, cfg, model_id)
            record_steps(engine, log)
            replay(engine, workload, config.name, concurrency=cal.concurrency, tool_aware=config.tool_aware,
                   ramp_s=cal.ramp_s)
            engine.pool.poll(wait=True)
            if config.host:
                tier_costs = engine.pool.costs()
                host_job_s, disk_job_s = engine.pool.copy_job_costs()
            del engine
        finally:
            if disk_dir is not None:
                shutil.rmtree(disk_dir, ignore_errors=True)
    timer = fit_linear_timer(log.shapes, log.seconds, source=f"kvtier bench replay, seed {calibration_seed}")
    errors = sorted(abs(timer.step_s(s) - t) / t for s, t in zip(log.shapes, log.seconds))
    host = _link(tier_costs, Tier.HOST, host_job_s)
    disk = _link(tier_costs, Tier.DISK, disk_job_s)
    return CpuCosts(timer, host, disk, len(log.seconds), errors[len(errors) // 2])


def sim_engine_config(config: BenchConfig, base: EngineConfig, sizing: Sizing) -> tuple[EngineConfig, int]:
    """The bench's engine config with its tiers counted in simulator placeholder blocks
    (``page_size`` bytes each); returns it and the disk tier's capacity in file bytes."""
    ps = sizing.page_size
    host_slots = sizing.host_cache_bytes // HostTier.row_bytes(sizing.block_bytes) if config.host else 0
    disk_slots = sizing.disk_cache_bytes // DiskTier.file_bytes(sizing.block_bytes) if config.disk else 0
    disk_bytes = disk_slots * DiskTier.file_bytes(ps)
    return config.engine_config(base, host_slots * HostTier.row_bytes(ps), None, disk_bytes), disk_bytes


def simulate_bench(opts: BenchOptions, costs: CpuCosts, workload: Workload | None = None) -> list[SimRun]:
    """``opts``' bench run re-enacted in virtual time with ``costs`` (same workload, tier sizes,
    closed loop and configurations)."""
    model, _, wl, sizing, base, _ = prepare(opts)
    wl = wl if workload is None else workload
    links = TierLinks(sizing.block_bytes, costs.host, costs.disk)
    runs = []
    for config in parse_configs(opts.configs):
        cfg, disk_bytes = sim_engine_config(config, base, sizing)
        disk = SimDisk(disk_bytes) if config.disk else None
        engine = SimWorker(cfg, costs.timer, links, model.config, model.config.max_position_embeddings, disk=disk)
        runs.append(simulate([engine], wl, config.name, concurrency=opts.concurrency, tool_aware=config.tool_aware,
                             ramp_s=opts.ramp_s))
    return runs


__all__ = ["FEATURES", "CpuCosts", "LinearTimer", "StepLog", "features", "fit_linear_timer", "measure_cpu_costs",
           "record_steps", "simulate_bench"]
