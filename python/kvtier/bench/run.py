"""``kvtier bench``: one workload, several cache configurations, one run.

Every configuration replays the same sessions through a fresh engine over the same model
weights; only the cache differs. Sizes are derived from the workload so that the device tier
holds clearly less than the sessions' working set (``device_fraction``), as on a real node
where ~1 TiB of agent context meets a few hundred GB of HBM (docs/workload.md, "Sizing").
"""

from __future__ import annotations

import gc
import math
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from kvtier.bench.configs import BenchConfig, parse_configs
from kvtier.bench.conversations import load_conversations
from kvtier.bench.records import ConfigRun
from kvtier.bench.closed_loop import whole_working_set_pages
from kvtier.bench.replay import replay, working_set_pages
from kvtier.bench.workload import Workload, generate_workload, load_trace
from kvtier.cache.checkpoints.options import CheckpointOptions
from kvtier.cache.config import PoolConfig
from kvtier.cache.disk_tier import DiskTier
from kvtier.serve.builder import check_device, load_for_serving
from kvtier.model.kimi_k2 import KimiK2ForCausalLM
from kvtier.ops import resolve_backend
from kvtier.options import flag
from kvtier.provenance import provenance
from kvtier.serve import Engine, EngineConfig, SamplingParams
from kvtier.serve.config import ADMISSION_WATERMARK, PREEMPTION_MODE, SCHEDULE_POLICIES
from kvtier.tokenize import KimiTokenizer, load_tokenizer


@dataclass(frozen=True)
class BenchOptions:
    """What ``kvtier bench`` runs. Sizes in pages are per layer; bytes are bytes.

    Attributes:
        model: preset name or weights directory.
        trace: trace file or folder (kv-cache-tester or Mooncake); None = built-in workload.
        conversations: a JSONL file of text chat sessions (:mod:`kvtier.bench.conversations`),
            instead of a trace; its turns are encoded with ``tokenizer`` in pages of
            ``page_size`` tokens (``token_scale`` does not apply to text).
        tokenizer: directory with the Kimi tokenizer files (None: the model directory).
        page_size: tokens per KV page for ``conversations`` (None: 16).
        max_output_tokens: cap on each response length of ``conversations`` (None = none).
        sessions: sessions replayed (the first N after filtering).
        concurrency: sessions active at once.
        configs: comma-separated configuration names (see ``kvtier.bench.configs``).
        token_scale: factor on every token length (block sizes scale with it).
        time_scale: factor on think times; ``max_think_s`` caps a scaled think time (seconds).
        max_turns: turns kept per session (None = all).
        ramp_s: seconds over which the first ``concurrency`` sessions start
            (see :mod:`kvtier.bench.replay`).
        device_fraction: device pages as a fraction of the working set (ignored when
            ``num_device_pages`` is given); raised, with a warning, to the pages of the
            largest single turn plus 16 when that is more (a request must fit on its own).
        host_fraction: host tier bytes as a fraction of the working set's KV bytes (ignored
            when ``host_cache_bytes`` is given).
        disk_cache_dir: parent of the per-run disk tier directories (None = the system temp dir).
        max_num_batched_tokens: token budget per engine step.
        seed: model weights, built-in workload and sampling.
        workload_seed: which workload is drawn (None: today's default): the built-in
            workload's seed instead of ``seed``, or, with a trace, the seed with which
            ``sessions`` sessions are sampled from it instead of taking the first ones
            (:func:`kvtier.bench.workload.load_trace`'s ``sample_seed``). ``--repeat`` sets it
            per repeat (:mod:`kvtier.bench.repeat`); text ``conversations`` do not take one.
        threads: torch intra-op threads during the run. Default 1: the model's ops are small
            at CPU scale and the copy engine's worker threads need cores too; with every core
            given to torch, an op's threads wait on each other whenever another thread is
            scheduled (on 2 cores a 4-request decode run took 34 s with 2 threads under
            contention vs 0.55 s with 1).
        schedule_policy: admission order of every configuration's engine (``cache-aware`` or
            ``fcfs``; see :mod:`kvtier.serve.admission`).
        preemption_mode, admission_watermark: every configuration's engine's
            (:class:`kvtier.serve.config.EngineConfig`): ``swap`` or ``recompute``, and the share
            of device pages admission keeps free for the running sequences.
        device: ``cpu`` or ``cuda`` (CUDA or ROCm): where the model and its page pools live;
            every configuration runs there (host and disk tiers through the device copy path).
        checkpoints: a hybrid model's recurrent-state checkpoint options (grid spacing, a multiple
            of the workload's page size, and per-tier budgets; the host and disk ones apply to the
            configurations with that tier), checked against the model and workload before any
            configuration runs (:func:`prepare_workload`). Written flat in the provenance's
            ``options``, as the command line names them.
    """

    model: str = "tiny"
    trace: str | None = None
    conversations: str | None = None
    tokenizer: str | None = None
    page_size: int | None = None
    max_output_tokens: int | None = None
    sessions: int = 16
    concurrency: int = 8
    configs: str = "device-only,tiered,ideal"
    token_scale: float = 1 / 64
    time_scale: float = 0.01
    max_think_s: float = 1.0
    max_turns: int | None = 8
    ramp_s: float = 10.0
    device_fraction: float = 0.25
    num_device_pages: int | None = None
    host_fraction: float = 1.0
    host_cache_bytes: int | None = None
    disk_cache_dir: str | None = None
    max_num_batched_tokens: int = 1024
    seed: int = 0
    workload_seed: int | None = None
    threads: int = 1
    schedule_policy: str = "cache-aware"
    preemption_mode: str = PREEMPTION_MODE
    admission_watermark: float = ADMISSION_WATERMARK
    device: str = "cpu"
    checkpoints: CheckpointOptions = CheckpointOptions()

    def __post_init__(self) -> None:
        check_device("--device", self.device)
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"--schedule-policy must be one of {', '.join(SCHEDULE_POLICIES)}, "
                             f"got {self.schedule_policy!r}")
        if self.trace is not None and self.conversations is not None:
            raise ValueError("--trace and --conversations are exclusive: give one workload")
        if self.workload_seed is not None:
            if isinstance(self.workload_seed, bool) or not isinstance(self.workload_seed, int) or self.workload_seed < 0:
                raise ValueError(f"workload_seed must be None or an int >= 0, got {self.workload_seed!r}")
            if self.conversations is not None:
                raise ValueError("--conversations replays a fixed set of text sessions: it cannot be drawn per "
                                 "seed (workload_seed, as --repeat sets it); give --trace or the built-in workload")
        if self.conversations is None:
            given = [flag(n) for n in ("tokenizer", "page_size", "max_output_tokens")
                     if getattr(self, n) is not None]
            if given:
                raise ValueError(f"{', '.join(given)} apply to --conversations only (traces and the built-in "
                                 "workload take their page size from --token-scale)")
        elif self.page_size is not None and self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        for name in ("sessions", "concurrency", "max_num_batched_tokens", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("token_scale", "device_fraction"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{flag(name)} must be a finite number > 0, got {getattr(self, name)}")
        for name in ("time_scale", "host_fraction", "ramp_s"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{flag(name)} must be a finite number >= 0, got {getattr(self, name)}")
        if not 0 <= self.max_think_s:  # inf = no cap
            raise ValueError(f"--max-think-s must be >= 0, got {self.max_think_s}")
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"--max-turns must be >= 1, got {self.max_turns}")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ValueError(f"--max-output-tokens must be >= 1, got {self.max_output_tokens}")
        for name, low in (("num_device_pages", 1), ("host_cache_bytes", 0)):
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"{flag(name)} must be >= {low}, got {value}")
        if not isinstance(self.checkpoints, CheckpointOptions):
            raise ValueError(f"checkpoints must be a CheckpointOptions, got {self.checkpoints!r}")
        configs = parse_configs(self.configs)
        if self.disk_cache_dir is not None and any(c.disk for c in configs):
            d = Path(self.disk_cache_dir)
            if not d.is_dir() or not os.access(d, os.W_OK | os.X_OK):
                raise ValueError(f"--disk-cache-dir {self.disk_cache_dir!r} must be an existing, writable directory")


@dataclass(frozen=True)
class Sizing:
    """Tier sizes derived for a workload.

    Attributes:
        page_size: tokens per page (= the workload's scaled block size).
        working_set_pages: see :func:`kvtier.bench.replay.working_set_pages`.
        device_pages: device pages per layer.
        block_bytes: KV bytes of one page over all layers.
        host_cache_bytes: host tier budget.
        disk_cache_bytes: disk tier budget (room for every distinct block of the workload).
        device_floor_applied: the device tier was raised above ``device_fraction`` of the
            working set so that the largest turn fits.
        checkpoint_bytes: bytes of one recurrent-state checkpoint of a hybrid model (0: none).
        checkpoint_tokens: the checkpoint grid spacing in tokens the engines use (0: none).
        whole_working_set_pages: device pages of the ``ideal`` configuration, every page the
            replay ever caches (:func:`kvtier.bench.closed_loop.whole_working_set_pages`).
    """

    page_size: int
    working_set_pages: int
    device_pages: int
    block_bytes: int
    host_cache_bytes: int
    disk_cache_bytes: int
    device_floor_applied: bool = False
    checkpoint_bytes: int = 0
    checkpoint_tokens: int = 0
    whole_working_set_pages: int = 0


def load_tokenizer_for(opts: BenchOptions) -> KimiTokenizer:
    """The tokenizer a text workload needs: ``opts.tokenizer``, else the model directory.

    Raises:
        ValueError: neither holds the Kimi tokenizer files.
    """
    where = opts.tokenizer or (opts.model if Path(opts.model).is_dir() else None)
    if where is None:
        raise ValueError(f"--conversations needs --tokenizer DIR (the model {opts.model!r} is a preset, "
                         "with no tokenizer files)")
    return load_tokenizer(where)


def load_workload(opts: BenchOptions, max_input_tokens: int, tokenizer: KimiTokenizer | None = None) -> Workload:
    """The trace, text sessions or built-in workload, scaled and filtered as ``opts`` says."""
    if opts.conversations is not None:
        return load_conversations(opts.conversations, tokenizer, page_size=opts.page_size or 16,
                                  time_scale=opts.time_scale, max_think_s=opts.max_think_s,
                                  max_sessions=opts.sessions, max_turns=opts.max_turns,
                                  max_input_tokens=max_input_tokens, max_output_tokens=opts.max_output_tokens)
    common = dict(token_scale=opts.token_scale, time_scale=opts.time_scale, max_think_s=opts.max_think_s,
                  max_turns=opts.max_turns, max_input_tokens=max_input_tokens)
    if opts.trace is None:
        seed = opts.seed if opts.workload_seed is None else opts.workload_seed
        return generate_workload(num_sessions=opts.sessions, seed=seed, **common)
    return load_trace(opts.trace, max_sessions=opts.sessions, sample_seed=opts.workload_seed, **common)


def size_tiers(opts: BenchOptions, workload: Workload, model: KimiK2ForCausalLM) -> Sizing:
    """Device pages, host and disk bytes for ``workload`` (see :class:`BenchOptions`)."""
    ps = workload.block_size
    ws = working_set_pages(workload, ps, opts.concurrency)
    largest = max(-(-(t.input_tokens + t.output_tokens) // ps) for s in workload.sessions for t in s.turns)
    floor = largest + 16
    wanted = opts.num_device_pages or math.ceil(opts.device_fraction * ws)
    device = max(wanted, floor) if opts.num_device_pages is None else wanted
    spec = model.cache_spec()
    block_bytes = ps * spec.kv_bytes_per_token
    host = opts.host_cache_bytes if opts.host_cache_bytes is not None else int(opts.host_fraction * ws * block_bytes)
    distinct = len({b for s in workload.sessions for t in s.turns for b in t.block_ids})
    disk = (distinct + 16) * DiskTier.file_bytes(block_bytes)
    ckpt_bytes = spec.state_bytes
    ckpt_tokens = opts.checkpoints.grid_tokens(ckpt_bytes, block_bytes // ps, ps) if ckpt_bytes else 0
    return Sizing(ps, ws, device, block_bytes, host, disk, device_floor_applied=device > wanted,
                  checkpoint_bytes=ckpt_bytes, checkpoint_tokens=ckpt_tokens,
                  whole_working_set_pages=max(whole_working_set_pages(workload, ps, opts.concurrency), device))


def warm_up(model: KimiK2ForCausalLM, base: EngineConfig) -> None:
    """One uncached prefill and a few decodes, so the first timed request pays no one-time costs."""
    pool = PoolConfig(page_size=base.pool.page_size, num_device_pages=base.pool.num_device_pages,
                      enable_prefix_caching=False)
    engine = Engine(model, EngineConfig(pool=pool, max_num_batched_tokens=base.max_num_batched_tokens))
    n = max(1, min(base.max_num_batched_tokens, model.config.max_position_embeddings - 8,
                   (base.pool.num_device_pages - 1) * base.pool.page_size - 4))
    engine.add_request(list(range(300, 300 + n)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def run_config(config: BenchConfig, model: KimiK2ForCausalLM, model_id: bytes, base: EngineConfig,
               sizing: Sizing, workload: Workload, opts: BenchOptions, on_finish=None,
               tokenizer: KimiTokenizer | None = None) -> ConfigRun:
    """Replay ``workload`` under ``config`` with a fresh engine (and a fresh disk directory)."""
    disk_dir = tempfile.mkdtemp(prefix=f"kvtier-bench-{config.name}-", dir=opts.disk_cache_dir) if config.disk else None
    try:
        engine = Engine(model, config.engine_config(base, sizing.host_cache_bytes, disk_dir, sizing.disk_cache_bytes,
                                                    whole_working_set_pages=sizing.whole_working_set_pages), model_id)
        # As a server does once started: what exists now (model, workload, engine) leaves the
        # collector's generations, so a full collection no longer scans it (they paused steps
        # for ~150 ms each on the trace; ~55 ms frozen).
        gc.collect()
        gc.freeze()
        try:
            run = replay(engine, workload, config.name, concurrency=opts.concurrency, tool_aware=config.tool_aware,
                         ramp_s=opts.ramp_s, on_finish=on_finish, tokenizer=tokenizer)
        finally:
            gc.unfreeze()
        engine.pool.poll(wait=True)  # no copy may still write into disk_dir when it is removed
        del engine
        gc.collect()
        return run
    finally:
        if disk_dir is not None:
            shutil.rmtree(disk_dir, ignore_errors=True)


def bench_provenance(opts: BenchOptions, workload: Workload, sizing: Sizing, model: KimiK2ForCausalLM) -> dict:
    """Everything needed to reproduce or judge a run (``provenance`` in the JSON)."""
    device = model.embed_tokens.device
    return provenance(
        model=opts.model, dtype=str(model.dtype),
        backend=resolve_backend("mla_decode", "auto", device, model.dtype),
        workload={"name": workload.name, "source": workload.source, "format": workload.format,
                  "sessions": len(workload.sessions), "requests": workload.num_requests()},
        token_scale=opts.token_scale, time_scale=opts.time_scale, max_think_s=opts.max_think_s,
        sizing=asdict(sizing), options=options_json(opts), torch_threads=torch.get_num_threads())


def options_json(opts: BenchOptions) -> dict:
    """``opts`` as JSON, the checkpoint options flat beside the others (as the command line names them)."""
    out = asdict(opts)
    return out | out.pop("checkpoints")


def prepare(opts: BenchOptions):
    """Load the model, the tokenizer (text workloads; else None) and the workload, and size the
    tiers: ``(model, model_id, workload, sizing, base, tokenizer)``."""
    tokenizer = load_tokenizer_for(opts) if opts.conversations is not None else None
    model, model_id = load_for_serving(opts.model, seed=opts.seed, device=opts.device)
    workload, sizing, base = prepare_workload(opts, model, tokenizer)
    return model, model_id, workload, sizing, base, tokenizer


def prepare_workload(opts: BenchOptions, model: KimiK2ForCausalLM, tokenizer: KimiTokenizer | None = None):
    """Load ``opts``'s workload for ``model`` and size the tiers: ``(workload, sizing, base)``
    with ``base`` the engine configuration every configuration starts from.

    Raises:
        ValueError: no session fits the model's context; a checkpoint option the model or the
            workload's page size refuses (:class:`~kvtier.cache.checkpoints.options.CheckpointOptions`).
    """
    workload = load_workload(opts, model.config.max_position_embeddings, tokenizer)
    if not workload.sessions:
        raise ValueError("the workload has no session that fits the model's context "
                         f"(max_position_embeddings={model.config.max_position_embeddings} tokens after scaling)")
    nbytes, ps = model.cache_spec().state_bytes, workload.block_size  # as the engine sizes its checkpoints
    opts.checkpoints.check_model(nbytes, opts.model)  # a budget the pool would refuse fails before any run
    if nbytes:
        opts.checkpoints.check(ps, f"the page size ({ps} tokens here: the workload's block size times --token-scale)")
    sizing = size_tiers(opts, workload, model)
    pool = PoolConfig(page_size=sizing.page_size, num_device_pages=sizing.device_pages,
                      **opts.checkpoints.pool_fields())
    base = EngineConfig(pool=pool,
                        max_num_batched_tokens=opts.max_num_batched_tokens, max_num_seqs=max(opts.concurrency, 1),
                        seed=opts.seed, schedule_policy=opts.schedule_policy, preemption_mode=opts.preemption_mode,
                        admission_watermark=opts.admission_watermark)
    return workload, sizing, base


def _start(opts: BenchOptions):
    """What every bench run does first: parse ``opts.configs``, set the threads, load the model,
    workload and sizes (:func:`prepare`) and warm up; returns ``(configs, prepare(opts))``."""
    configs = parse_configs(opts.configs)
    torch.set_num_threads(opts.threads)
    prepared = prepare(opts)
    warm_up(prepared[0], prepared[4])
    return configs, prepared


def run_all(opts: BenchOptions, on_start=None, on_finish=None) -> tuple[Workload, Sizing, list[ConfigRun], dict]:
    """Run every configuration of ``opts``; returns ``(workload, sizing, runs, provenance)``.

    ``on_start(config_name, num_requests)`` and ``on_finish(record)`` report progress.
    """
    configs, (model, model_id, workload, sizing, base, tokenizer) = _start(opts)
    runs = []
    for config in configs:
        if on_start is not None:
            on_start(config.name, workload.num_requests())
        runs.append(run_config(config, model, model_id, base, sizing, workload, opts, on_finish, tokenizer))
    return workload, sizing, runs, bench_provenance(opts, workload, sizing, model)


def at_load(opts: BenchOptions, load: float) -> BenchOptions:
    """``opts`` with every think time, and the cap on it, divided by ``load`` (> 0)."""
    return replace(opts, time_scale=opts.time_scale / load, max_think_s=opts.max_think_s / load)


def run_sweep(opts: BenchOptions, loads: tuple[float, ...], on_start=None, on_finish=None):
    """Run every configuration of ``opts`` at each offered load of ``loads`` (see
    :mod:`kvtier.bench.sweep`); returns ``(workload, sizing, points, provenance)`` with
    ``points = [(load, runs)]``. The tiers are sized once, for the workload at ``opts``'s
    think times (lengths do not change with load). ``on_start(name, num_requests)`` gets
    ``name@xLOAD``."""
    configs, (model, model_id, workload, sizing, base, tokenizer) = _start(opts)
    points = []
    for load in loads:
        o = at_load(opts, load)
        wl = load_workload(o, model.config.max_position_embeddings, tokenizer)
        runs = []
        for config in configs:
            if on_start is not None:
                on_start(f"{config.name}@x{load:g}", wl.num_requests())
            runs.append(run_config(config, model, model_id, base, sizing, wl, o, on_finish, tokenizer))
        points.append((load, runs))
    return workload, sizing, points, bench_provenance(opts, workload, sizing, model) | {"load_sweep": list(loads)}


__all__ = ["BenchOptions", "Sizing", "at_load", "options_json", "prepare", "prepare_workload",
           "run_all", "run_config", "run_sweep", "size_tiers"]
