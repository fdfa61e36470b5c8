"""``kvtier simulate``: size a scenario's tiers, build its workers, run each configuration.

Tier sizes (per worker) of a hardware scenario:

- a page (block) stands for ``page_size * num_hidden_layers * kv_cache_dim * kv_dtype_bytes``
  bytes of KV (70,272 bytes per token for K2 with bf16 KV, docs/workload.md's sizing of the published
  run; 35,136 with FP8 KV);
- device pages: the KV tokens of the memory plan (:func:`kvtier.model.plan.memory_plan` of the
  scenario's ``weight_format`` on the node's devices, ``tp`` layout: MLA's latent KV is replicated
  on every tensor-parallel device; the node's ``hbm_fraction`` and ``activation_reserve_bytes`` as
  the plan's allowance) over ``page_size``;
- host slots: ``Node.host_kv_bytes`` over one page's bytes; store slots: ``Node.disk_kv_bytes``
  over one page's bytes (a shared store: the workers' sizes added up).

A CPU-scale scenario (``device_fraction`` set) is sized as ``kvtier bench`` sizes its tiers
(:func:`kvtier.bench.run.size_tiers`).

A hybrid KDA + MLA model (Kimi K3) is sized by :func:`kvtier.model.hybrid_plan.hybrid_memory_plan`
(``tp`` layout): a page stands for ``page_size * kv_bytes_per_token`` bytes of MLA KV (27,648 B per
token for K3 in bf16); what the weights leave on a device holds, besides the KV pages, one state
slot per running sequence (``max_num_seqs`` = the replay's concurrency) and
``state_device_checkpoints`` device checkpoints, each ``state_bytes / num_devices`` bytes per
device. Host and disk hold ``state_host_bytes // state_bytes`` and ``state_disk_bytes //
state_bytes`` checkpoints besides their KV blocks; the grid spacing is the scenario's or
:func:`kvtier.cache.checkpoints.options.default_checkpoint_tokens`. Each worker's pool keeps them in its
checkpoint store on virtual-time tiers (:func:`kvtier.sim.states.sim_checkpoints`; configurations
without prefix caching keep none).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import asdict, dataclass

import numpy as np
from kvtier.bench.closed_loop import whole_working_set_pages
from kvtier.bench.pool_sections import sections_json
from kvtier.bench.replay import working_set_pages
from kvtier.bench.resume import resume_misses
from kvtier.sim import hardware
from kvtier.sim.copies import SimDisk, TierLinks
from kvtier.sim.engine import SimWorker
from kvtier.sim.hardware import Node
from kvtier.sim.loop import SimRun, simulate
from kvtier.sim.scenarios import SCENARIOS, Scenario, Variant
from kvtier.sim.long_sessions import long_session_workload
from kvtier.sim.states import CheckpointSizes
from kvtier.sim.timing import HybridRooflineTimer, KernelRates, RooflineTimer, own_prefill_s, prefill_tok_s
from kvtier.bench.workload import Workload, generate_workload, load_trace
from kvtier.cache.config import PoolConfig
from kvtier.cache.disk_tier import DiskTier
from kvtier.cache.host_tier import HostTier
from kvtier.model.config import KimiK2Config, preset
from kvtier.model.hybrid_plan import STATE_DTYPE_BYTES, hybrid_memory_plan
from kvtier.model.kimi_linear_config import KimiLinearConfig
from kvtier.model.plan import GB, memory_plan
from kvtier.provenance import provenance
from kvtier.serve.config import EngineConfig
from kvtier.cache.checkpoints.options import default_checkpoint_tokens


@dataclass(frozen=True)
class SimOptions:
    """What ``kvtier simulate`` runs: a scenario (:data:`kvtier.sim.scenarios.SCENARIOS`) and
    overrides (None = keep) of the :class:`~kvtier.sim.scenarios.Replay` or :class:`Scenario`
    field of the same name (``truncate_input_tokens`` 0 = off; ``matrix_efficiency`` overrides
    ``Efficiency.matrix``).

    Attributes:
        trace: kv-cache-tester or Mooncake trace file or folder; None = the built-in generator.
        configs: comma-separated variant names to run (None = all of the scenario's).
        kernel_csv, kernel_device: ``perf/`` kernel-timing CSVs whose rates replace ``peak x
            efficiency`` (:meth:`KernelRates.from_csv`), and the ``device`` of the rows to use.
        resume_ttft_s: the resume target every worker's pool and scheduler plan for, seconds
            (:meth:`~kvtier.serve.engine.Engine.set_resume_target`; None: none); with one, every
            variant's clients declare their tool waits (the scheduler uses them under any policy).
        declared_waits: variants that tell tool waits tell each one's recorded length, as a client
            that declares it does (:class:`~kvtier.bench.closed_loop.ClosedLoop`), instead of the
            running median.
    """

    scenario: str
    trace: str | None = None
    sessions: int | None = None
    concurrency: int | None = None
    max_turns: int | None = None
    time_scale: float | None = None
    max_think_s: float | None = None
    ramp_s: float | None = None
    duration_s: float | None = None
    warmup_s: float | None = None
    warmup_turns: int | None = None
    seed: int | None = None
    truncate_input_tokens: int | None = None
    warm_prefix_fraction: float | None = None
    kv_dtype_bytes: float | None = None
    configs: str | None = None
    node: str | None = None
    matrix_efficiency: float | None = None
    kernel_csv: tuple[str, ...] = ()
    kernel_device: str | None = None
    schedule_policy: str | None = None
    resume_ttft_s: float | None = None
    declared_waits: bool = False

    def resolve(self) -> Scenario:
        """The scenario with the overrides applied.

        Raises:
            ValueError: an unknown scenario, configuration or node, or an override out of range.
        """
        if self.scenario not in SCENARIOS:
            raise ValueError(f"--scenario: unknown scenario {self.scenario!r}; expected one of {list(SCENARIOS)}")
        scn = SCENARIOS[self.scenario]
        names = ("sessions", "concurrency", "max_turns", "time_scale", "max_think_s", "ramp_s", "duration_s",
                 "warmup_s", "warmup_turns", "seed", "warm_prefix_fraction")
        over = {k: getattr(self, k) for k in names if getattr(self, k) is not None}
        if self.truncate_input_tokens is not None:
            over["truncate_input_tokens"] = self.truncate_input_tokens or None
        if over:
            scn = dataclasses.replace(scn, replay=dataclasses.replace(scn.replay, **over))
        if self.kv_dtype_bytes is not None:
            scn = dataclasses.replace(scn, kv_dtype_bytes=self.kv_dtype_bytes)
        if self.node is not None:
            hardware.node(self.node)  # an unknown name fails here
            scn = dataclasses.replace(scn, node=self.node)
        if self.matrix_efficiency is not None:
            efficiency = dataclasses.replace(scn.efficiency, matrix=self.matrix_efficiency)
            scn = dataclasses.replace(scn, efficiency=efficiency)
        if self.schedule_policy is not None:
            scn = dataclasses.replace(scn, schedule_policy=self.schedule_policy)
        if self.configs is not None:
            scn = scn.select(self.configs)
        if self.resume_ttft_s is not None and not 0 < self.resume_ttft_s < math.inf:
            raise ValueError(f"--resume-ttft-s must be a finite number > 0, got {self.resume_ttft_s!r}")
        return scn


@dataclass(frozen=True)
class SimSizing:
    """Tier sizes of one worker (see the module docstring).

    Attributes:
        page_size: tokens per page.
        block_bytes: modelled KV bytes of one page, all layers.
        weight_bytes: bytes of the model's weights (all devices).
        device_pages: device pages per worker.
        host_slots: host-tier blocks per worker.
        store_slots: blocks of the tier below host memory, per worker.
        working_set_pages: pages the concurrent sessions need at their peak (all workers).
        states: a hybrid model's checkpoint sizes and budgets (None for K2-class models).
        whole_working_set_pages: device pages per worker of the ``ideal`` configuration (every
            page the replay ever caches: :func:`kvtier.bench.closed_loop.whole_working_set_pages`;
            the bound, whatever the HBM holds); a hybrid model's ideal keeps as many device
            checkpoints.
    """

    page_size: int
    block_bytes: float
    weight_bytes: float
    device_pages: int
    host_slots: int
    store_slots: int
    working_set_pages: int
    states: CheckpointSizes | None = None
    whole_working_set_pages: int = 0


def load_workload(scn: Scenario, trace: str | None) -> Workload:
    """The scenario's sessions from ``trace`` (or generated), scaled and filtered as its replay says."""
    r = scn.replay
    common = dict(token_scale=r.token_scale, time_scale=r.time_scale, max_think_s=r.max_think_s,
                  max_turns=r.max_turns, max_input_tokens=scn.max_context_tokens,
                  truncate_input_tokens=r.truncate_input_tokens)
    if trace is None and r.prefix_tokens is not None:
        return long_session_workload(num_sessions=r.sessions, prefix_tokens=r.prefix_tokens,
                                     increment_tokens=r.increment_tokens, max_input_tokens=scn.max_context_tokens,
                                     seed=r.seed, time_scale=r.time_scale, max_think_s=r.max_think_s,
                                     max_turns=r.max_turns)
    if trace is None:
        return generate_workload(num_sessions=r.sessions, seed=r.seed, **common)
    return load_trace(trace, max_sessions=r.sessions, warm_prefix_fraction=r.warm_prefix_fraction, **common)


def size_tiers(scn: Scenario, model: KimiK2Config | KimiLinearConfig, node: Node, workload: Workload) -> SimSizing:
    """Per-worker tier sizes for ``workload`` on ``node`` (module docstring).

    Raises:
        ValueError: the weights (and a hybrid model's state slots and device checkpoints) leave no
            HBM for KV.
    """
    if isinstance(model, KimiLinearConfig):
        return _size_hybrid(scn, model, node, workload)
    ps = scn.page_size
    block = ps * model.kv_cache_bytes_per_token(scn.kv_dtype_bytes)
    plan = memory_plan(model, scn.weight_format, node.num_devices, node.accelerator.hbm_bytes / GB, parallel="tp",
                       kv_dtype_bytes=scn.kv_dtype_bytes, hbm_fraction=node.hbm_fraction,
                       reserve_gb=node.activation_reserve_bytes / GB)
    wb = plan.total_weight_bytes
    ws = working_set_pages(workload, ps, scn.replay.concurrency)
    largest = max(-(-(t.input_tokens + t.output_tokens) // ps) for s in workload.sessions for t in s.turns)
    if scn.device_fraction is None:
        if not plan.fits:
            raise ValueError(f"{wb / GB:.0f} GB of {scn.weight_format} weights over {node.num_devices} x "
                             f"{node.accelerator.name} leave no HBM for KV")
        device = plan.kv_tokens // ps
        host, store = int(node.host_kv_bytes // block), int(node.disk_kv_bytes // block)
    else:  # as kvtier bench: a fraction of the working set, at least the largest turn (+16)
        device = max(math.ceil(scn.device_fraction * ws), largest + 16)
        distinct = len({b for s in workload.sessions for t in s.turns for b in t.block_ids})
        host, store = ws, distinct + 16
    whole = max(whole_working_set_pages(workload, ps, scn.replay.concurrency), device)
    return SimSizing(ps, block, wb, device, host, store, ws, whole_working_set_pages=whole)


def _size_hybrid(scn: Scenario, model: KimiLinearConfig, node: Node, workload: Workload) -> SimSizing:
    if scn.device_fraction is not None:
        raise ValueError(f"scenario {scn.name!r}: device_fraction is not supported for a hybrid model")
    ps, devices = scn.page_size, node.num_devices
    plan = hybrid_memory_plan(model, scn.weight_format, devices, node.accelerator.hbm_bytes / GB, parallel="tp",
                              kv_dtype_bytes=scn.kv_dtype_bytes, state_dtype=scn.state_dtype,
                              hbm_fraction=node.hbm_fraction, reserve_gb=node.activation_reserve_bytes / GB)
    state = plan.state_bytes_per_sequence
    slots = scn.replay.concurrency  # max_num_seqs: one state slot each
    held = (slots + scn.state_device_checkpoints) * state / devices
    free = plan.free_bytes_per_device - held
    block = ps * plan.kv_bytes_per_token
    if free < block:
        raise ValueError(f"{plan.weight_bytes_per_device / GB:.0f} GB of {scn.weight_format} weights and "
                         f"{held / GB:.1f} GB of state slots and device checkpoints per {node.accelerator.name} "
                         "leave no HBM for KV")
    grid = scn.state_checkpoint_tokens or default_checkpoint_tokens(state, round(plan.kv_bytes_per_token), ps)
    states = CheckpointSizes(state_bytes=state, link_bytes=state / devices, checkpoint_tokens=grid,
                             device_checkpoints=scn.state_device_checkpoints,
                             host_checkpoints=int(scn.state_host_bytes // state),
                             disk_checkpoints=int(scn.state_disk_bytes // state), state_slots=slots)
    ws = working_set_pages(workload, ps, scn.replay.concurrency)
    device = int(free // block)
    whole = max(whole_working_set_pages(workload, ps, scn.replay.concurrency), device)
    return SimSizing(ps, block, plan.total_weight_bytes, device, int(node.host_kv_bytes // block),
                     int(node.disk_kv_bytes // block), ws, states, whole)


SIM_PREEMPTION_MODE = "recompute"
"""The victim rule the scenarios run (``EngineConfig.preemption_mode``): the one their published
figures in docs/simulator.md were made with; the engine's default is ``swap`` (measured on the
real engine, docs/scheduling.md), not yet rerun here."""


def _engine_config(scn: Scenario, v: Variant, sizing: SimSizing) -> EngineConfig:
    base = EngineConfig(pool=PoolConfig(page_size=sizing.page_size, num_device_pages=sizing.device_pages),
                        max_num_batched_tokens=scn.max_num_batched_tokens, max_num_seqs=max(scn.replay.concurrency, 1),
                        seed=scn.replay.seed, schedule_policy=scn.schedule_policy,
                        preemption_mode=SIM_PREEMPTION_MODE)
    host_bytes = sizing.host_slots * HostTier.row_bytes(sizing.page_size)  # the pool's blocks: page_size bytes
    store_bytes = sizing.store_slots * DiskTier.file_bytes(sizing.page_size)
    return v.cache.engine_config(base, host_bytes, None, store_bytes,
                                 whole_working_set_pages=sizing.whole_working_set_pages)


def build_engines(scn: Scenario, v: Variant, sizing: SimSizing, timer, node: Node,
                  resume_ttft_s: float | None = None) -> list[SimWorker]:
    """Fresh workers for variant ``v``: each with its own clock, device and host tiers; the tier
    below host memory (when the variant has one) shared or not as ``v`` says; each engine planning
    for the resume target ``resume_ttft_s`` seconds (None: none)."""
    config = _engine_config(scn, v, sizing)
    states = sizing.states
    if states is not None and v.cache.whole_working_set:  # the bound: no checkpoint leaves the device either
        states = dataclasses.replace(states, device_checkpoints=sizing.whole_working_set_pages)
    store_link = node.disk_link if scn.store == "disk" else node.network_link
    links = TierLinks(sizing.block_bytes, node.host_link, store_link)
    shared = SimDisk(config.pool.disk_cache_bytes * scn.workers) if v.cache.disk and v.shared_store else None
    engines = []
    for _ in range(scn.workers):
        disk = shared if shared is not None else (SimDisk(config.pool.disk_cache_bytes) if v.cache.disk else None)
        engines.append(SimWorker(config, timer, links, preset(scn.model), scn.max_context_tokens, disk=disk,
                                 states=states, checkpoints=v.checkpoints))
    if shared is not None:
        for e in engines:
            e.share_store(shared)
    if resume_ttft_s is not None:
        for e in engines:
            e.engine.set_resume_target(resume_ttft_s)
    return engines


def make_timer(scn: Scenario, model: KimiK2Config | KimiLinearConfig, node: Node,
               rates: KernelRates | None = None) -> RooflineTimer:
    if isinstance(model, KimiLinearConfig):
        return HybridRooflineTimer(model, node, scn.efficiency, kv_dtype_bytes=scn.kv_dtype_bytes,
                                   rates=rates or KernelRates(), weight_format=scn.weight_format,
                                   state_dtype_bytes=STATE_DTYPE_BYTES[scn.state_dtype])
    return RooflineTimer(model, node, scn.efficiency, kv_dtype_bytes=scn.kv_dtype_bytes,
                         weight_dtype_bytes=scn.weight_dtype_bytes, rates=rates or KernelRates())


def run_scenario(opts: SimOptions, on_start=None, on_finish=None, workload: Workload | None = None):
    """Run every variant of ``opts``' scenario.

    Args:
        opts: scenario and overrides.
        workload: the sessions to replay; None loads them as ``opts`` says.
        on_start: ``on_start(variant_name)`` before each variant.
        on_finish: ``on_finish(record)`` after each request (warm-up ones included).

    Returns:
        ``(scenario, workload, sizing, sim_runs, provenance)``; ``sim_runs`` is one
        :class:`SimRun` per variant, in order.

    Raises:
        ValueError: bad options, an empty workload, or a kernel CSV without matching rows.
        OSError: a trace or CSV cannot be read.
    """
    scn = opts.resolve()
    model, node = preset(scn.model), hardware.node(scn.node)
    workload = load_workload(scn, opts.trace) if workload is None else workload
    if not workload.sessions:
        raise ValueError(f"the workload has no session within the {scn.max_context_tokens}-token context")
    device = opts.kernel_device or node.accelerator.name
    rates = KernelRates.from_csv(list(opts.kernel_csv), device) if opts.kernel_csv else None
    timer = make_timer(scn, model, node, rates)
    sizing = size_tiers(scn, model, node, workload)
    runs: list[SimRun] = []
    for v in scn.variants:
        if on_start is not None:
            on_start(v.name)
        engines, r = build_engines(scn, v, sizing, timer, node, opts.resume_ttft_s), scn.replay
        # with a resume target every configuration's clients declare their tool waits: the scheduler
        # bounds steps around the expected returns under any cache policy (kvtier.serve.step_time.bound_step)
        tool_aware = v.cache.tool_aware or opts.resume_ttft_s is not None
        runs.append(simulate(engines, workload, v.name, concurrency=r.concurrency, tool_aware=tool_aware,
                             ramp_s=r.ramp_s, router=v.router, warmup_s=r.warmup_s, duration_s=r.duration_s,
                             on_finish=on_finish, shared_store=v.shared_store, declared_waits=opts.declared_waits,
                             warmup_turns=r.warmup_turns))
    return (scn, workload, sizing, runs, sim_provenance(scn, workload, sizing, runs, timer, opts))


def _json_safe(value):
    """``value`` with every non-finite float replaced by None (JSON has no infinity)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def sim_provenance(scn: Scenario, workload: Workload, sizing: SimSizing, runs: list[SimRun], timer,
                   opts: SimOptions) -> dict:
    """Everything needed to reproduce or judge a simulation (``provenance`` in the JSON; an
    infinite ``duration_s`` is written as null)."""
    wl = {"name": workload.name, "source": workload.source, "format": workload.format,
          "sessions": len(workload.sessions), "requests": workload.num_requests()}
    variants = [{"name": v.name, "cache": asdict(v.cache), "router": v.router, "shared_store": v.shared_store}
                for v in scn.variants]
    per_variant = {sr.run.name: {"migrations": sr.migrations, "warmup_requests": len(sr.warmup_records),
                                 "window_s": sr.window_s, "window_sessions": sr.window_sessions,
                                 "end_s": sr.end_s, "busy_s": sr.busy_s,
                                 "ttft_p99_returning_s": ttft_p99(sr.run.records, lambda r: r.turn > 0),
                                 "sections": sections_json(sr.run)}  # as kvtier bench's runs
                   for sr in runs}  # returning turns: after a session's first (those a cache can serve)
    if opts.resume_ttft_s is not None:  # resumes after a tool wait and their misses of the target, by why
        for sr in runs:
            got = resume_misses(workload, sr.run.records, opts.resume_ttft_s, sizing.page_size,
                                prefill_s=functools.partial(own_prefill_s, timer))
            per_variant[sr.run.name]["resume"] = {"target_s": opts.resume_ttft_s, "resumes": got["resumes"],
                                                  "misses": got["misses"]}
    return _json_safe(provenance(kind="simulation", scenario=scn.name, model=scn.model, node=scn.node,
                                 workers=scn.workers, baseline=scn.baseline, efficiency=asdict(scn.efficiency),
                                 kernel_rates=asdict(timer.rates), prefill_tok_s_16k=prefill_tok_s(timer, 16384),
                                 workload=wl, replay=asdict(scn.replay), variants=variants, sizing=asdict(sizing),
                                 options=asdict(opts), per_variant=per_variant))


def ttft_p99(records, keep=lambda r: True) -> float | None:
    """p99 TTFT (seconds, numpy ``linear``) of the reported ``records`` (``RequestRecord``) that
    ``keep`` selects, errors and turns without a first token left out; None without any."""
    ttft = [r.ttft_s for r in records if r.error is None and r.ttft_s is not None and keep(r)]
    return float(np.percentile(ttft, 99)) if ttft else None
