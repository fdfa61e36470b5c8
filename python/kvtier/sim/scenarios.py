"""Named simulation scenarios: the model, the hardware, the workload and the configurations
compared, defined as data in ``scenarios.toml`` (beside this module; every assumption there has
its reason beside it, and the one fitted value is the think-time scale of ``kimi-mi355x-128``).

``kimi-mi355x-128`` reproduces the published measurement (docs/workload.md); ``kimi-k3-mi355x-128``
runs its shape on Kimi K3 (a hybrid KDA + MLA model: recurrent-state checkpoints beside the MLA
blocks, :mod:`kvtier.sim.states`) with 400K-token sessions; ``migration`` puts two such
workers behind a router; ``tiny`` is a seconds-long smoke run at CPU scale.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

from kvtier.bench.configs import CONFIGS, BenchConfig, parse_configs
from kvtier.sim.hardware import Efficiency, from_table
from kvtier.sim.loop import ROUTERS
from kvtier.sim.states import CHECKPOINT_POLICIES
from kvtier.bench.workload import check_replay_options
from kvtier.model.formats import PRESET_FORMATS
from kvtier.model.hybrid_plan import HYBRID_FORMATS, STATE_DTYPE_BYTES
from kvtier.options import check_choice, check_int, check_real
from kvtier.serve.config import SCHEDULE_POLICIES

SCENARIO_FILE = Path(__file__).with_name("scenarios.toml")
STORES = ("disk", "network")


@dataclass(frozen=True)
class Variant:
    """One configuration a scenario simulates.

    Attributes:
        name: column name in the results.
        cache: the pool's tiers and policies (a ``kvtier bench`` configuration).
        router: how turns pick a worker (:data:`kvtier.sim.loop.ROUTERS`).
        shared_store: the tier below host memory is one store all workers read and write
            (else each worker has its own).
        checkpoints: a hybrid model's checkpoint policy (:data:`kvtier.sim.states.CHECKPOINT_POLICIES`):
            ``turn`` (prompt ends, turn ends and the sparse grid, as the engine saves them) or
            ``grid`` (the sparse grid only).
    """

    name: str
    cache: BenchConfig
    router: str = "sticky"
    shared_store: bool = False
    checkpoints: str = "turn"

    def __post_init__(self) -> None:
        check_choice(f"Variant {self.name!r}: router", self.router, ROUTERS)
        check_choice(f"Variant {self.name!r}: checkpoints", self.checkpoints, CHECKPOINT_POLICIES)


@dataclass(frozen=True)
class Replay:
    """The workload and how it is replayed (see :mod:`kvtier.sim.loop`).

    Attributes:
        sessions: sessions taken from the trace or generated (more than ``concurrency``: a
            finished session's slot goes to the next).
        concurrency: sessions active at once.
        max_turns: turns kept per session (None = all).
        token_scale, time_scale, max_think_s: as ``kvtier bench``.
        truncate_input_tokens, warm_prefix_fraction: as :func:`kvtier.bench.workload.load_trace`;
            None = the model's context only; the built-in generator always shares its whole tool +
            system prompt.
        ramp_s: seconds over which the first ``concurrency`` sessions start.
        warmup_s, duration_s: the measurement window, virtual seconds from the window's opening
            (0 without ``warmup_turns``).
        warmup_turns: each session's first turns run before the window and never reported (the
            window opens when every active session has run them, and then no session starts:
            :class:`kvtier.bench.closed_loop.ClosedLoop`); 0 = none, the window opens at 0.
        seed: of the built-in workload generator.
        prefix_tokens, increment_tokens: with both set (and no trace), the sessions are
            :func:`kvtier.sim.long_sessions.long_session_workload`'s: a first prompt of
            ``prefix_tokens`` tokens growing by ``increment_tokens`` per turn; None: the built-in
            generator's.
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
    warmup_turns: int = 0
    seed: int = 0
    prefix_tokens: int | None = None
    increment_tokens: int | None = None

    def __post_init__(self) -> None:
        if (self.prefix_tokens is None) != (self.increment_tokens is None):
            raise ValueError("prefix_tokens and increment_tokens go together: set both or neither, got "
                             f"{self.prefix_tokens!r} and {self.increment_tokens!r}")
        if self.prefix_tokens is not None:
            check_int("prefix_tokens", self.prefix_tokens, min_value=1)
            check_int("increment_tokens", self.increment_tokens, min_value=2)
        check_int("sessions", self.sessions, min_value=1)
        check_int("concurrency", self.concurrency, min_value=1)
        check_real("ramp_s", self.ramp_s, min_value=0)
        check_int("warmup_turns", self.warmup_turns, min_value=0)
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
        kv_dtype_bytes, weight_dtype_bytes: bytes per KV value and per linear weight (the step
            timer's weight traffic).
        weight_format: how the weights are held (:data:`kvtier.model.formats.PRESET_FORMATS`:
            ``fp8`` as K2 ships, ``int4`` as K2.6 ships, ``bf16``): the device tier is what the
            memory plan (:func:`kvtier.model.plan.memory_plan`) leaves for KV.
        calibration: what the scenario's fitted values were fitted on ("" = nothing fitted).
        schedule_policy: the engines' admission order (``EngineConfig.schedule_policy``):
            ``fcfs``, under which the scenarios were calibrated, unless overridden.
        state_dtype: a hybrid model's recurrent-state dtype (``fp32`` | ``bf16``; conv windows bf16).
        state_checkpoint_tokens: a hybrid model's checkpoint grid spacing, tokens (a multiple of
            ``page_size``; 0 = :func:`kvtier.cache.checkpoints.options.default_checkpoint_tokens`).
        state_device_checkpoints: checkpoints kept in HBM per worker (their share of each device
            is taken from the KV pages), beside one state slot per running sequence.
        state_host_bytes, state_disk_bytes: host DRAM and NVMe bytes per worker for checkpoints,
            besides the KV tiers' (``Node.host_kv_bytes``, ``Node.disk_kv_bytes``).
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
    max_context_tokens: int = 262_144  # Kimi K2's context
    device_fraction: float | None = None
    kv_dtype_bytes: float = 1.0
    weight_dtype_bytes: float = 1.0
    weight_format: str = "fp8"
    calibration: str = ""
    schedule_policy: str = "fcfs"
    state_dtype: str = "fp32"
    state_checkpoint_tokens: int = 0
    state_device_checkpoints: int = 0
    state_host_bytes: float = 0.0
    state_disk_bytes: float = 0.0

    def __post_init__(self) -> None:
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names) or self.baseline not in names:
            raise ValueError(f"scenario {self.name!r}: variant names {names} must be unique and include "
                             f"the baseline {self.baseline!r}")
        check_choice(f"scenario {self.name!r}: store", self.store, STORES)
        for name in ("page_size", "max_num_batched_tokens", "max_context_tokens"):
            check_int(f"scenario {self.name!r}: {name}", getattr(self, name), min_value=1)
        check_int(f"scenario {self.name!r}: workers", self.workers, min_value=1)
        check_real(f"scenario {self.name!r}: kv_dtype_bytes", self.kv_dtype_bytes, min_value=0, min_open=True,
                   max_value=8)
        check_choice(f"scenario {self.name!r}: schedule_policy", self.schedule_policy, SCHEDULE_POLICIES)
        check_choice(f"scenario {self.name!r}: weight_format", self.weight_format,
                     (*PRESET_FORMATS, *HYBRID_FORMATS))
        check_choice(f"scenario {self.name!r}: state_dtype", self.state_dtype, tuple(STATE_DTYPE_BYTES))
        for name in ("state_checkpoint_tokens", "state_device_checkpoints"):
            check_int(f"scenario {self.name!r}: {name}", getattr(self, name), min_value=0)
        if self.state_checkpoint_tokens % self.page_size:
            raise ValueError(f"scenario {self.name!r}: state_checkpoint_tokens must be a multiple of "
                             f"page_size={self.page_size}, got {self.state_checkpoint_tokens}")
        for name in ("state_host_bytes", "state_disk_bytes"):
            check_real(f"scenario {self.name!r}: {name}", getattr(self, name), min_value=0)

    def select(self, configs: str) -> Scenario:
        """This scenario with only the variants named in ``configs`` (``"a,b"``, in that order).

        Raises:
            ValueError: an unknown or repeated name, or none, naming the valid ones.
        """
        chosen = tuple(parse_configs(configs, {v.name: v for v in self.variants}, f" for scenario {self.name!r}"))
        names = [v.name for v in chosen]
        baseline = self.baseline if self.baseline in names else names[0]
        return dataclasses.replace(self, variants=chosen, baseline=baseline)


def _variant(v: str | dict, where: str) -> Variant:
    table = {"name": v, "cache": v} if isinstance(v, str) else dict(v)
    if table.get("cache") not in CONFIGS:
        raise ValueError(f"{where}: cache must be one of {list(CONFIGS)}, got {table.get('cache')!r}")
    return from_table(Variant, {**table, "cache": CONFIGS[table["cache"]]}, where)


def _table(tables: dict, name: str, where: str) -> dict:
    """Scenario ``name``'s table with the one it is ``like`` under it (its own fields win)."""
    t = dict(tables[name])
    like = t.pop("like", None)
    if like is None:
        return t
    base = tables.get(like)
    if not isinstance(base, dict) or "like" in base or like == name:
        raise ValueError(f"{where}: like must name another scenario of the file, without a like of its own; "
                         f"got {like!r}")
    for key in ("efficiency", "replay"):
        t[key] = {**base.get(key, {}), **t.get(key, {})}
    return {**base, **t}


def load_scenarios(path: str | Path = SCENARIO_FILE) -> dict[str, Scenario]:
    """The scenarios a TOML file defines (the format is in ``scenarios.toml``'s header).

    Raises:
        ValueError: a field unknown, missing or out of range; names the scenario and the field.
        OSError: the file cannot be read; tomllib.TOMLDecodeError: it is not TOML.
    """
    path = Path(path)
    tables, scenarios = tomllib.loads(path.read_text()), {}
    for name in tables:
        where = f"{path.name} [{name}]"
        t = _table(tables, name, where)
        t["variants"] = tuple(_variant(v, f"{where} variants[{i}]") for i, v in enumerate(t.get("variants", ())))
        scenarios[name] = from_table(Scenario, {"name": name, "efficiency": {}, **t}, where)
    return scenarios


SCENARIOS: dict[str, Scenario] = load_scenarios()
