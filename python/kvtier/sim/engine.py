"""One simulated worker: the real :class:`~kvtier.serve.engine.Engine` (scheduler, tiered pool,
``begin_step``/``end_step``) with the model replaced by a :class:`TimedRunner` and every copy by
a virtual-time job (the pool's seams, :mod:`kvtier.sim.copies`). The prefill rate the
pool's cost model learns comes from the virtual step times, as the engine's does from measured
ones.

Prompts are lengths plus block hashes (``Engine.add_hashed_request``): hashes are given for
every full block a request will hold, so neither the scheduler nor the pool needs token ids.
"""

from __future__ import annotations

import dataclasses

import torch
from kvtier.cache.checkpoints.index import Checkpoint
from kvtier.cache.pool import KVPool
from kvtier.model.config import KimiK2Config
from kvtier.serve.config import EngineConfig
from kvtier.serve.engine import Engine
from kvtier.serve.hybrid_state import CheckpointPlan
from kvtier.serve.runner import StepResult
from kvtier.serve.step_plan import ScheduledBatch
from kvtier.sim.copies import SimCopyEngine, SimDisk, TierLinks, VirtualClock
from kvtier.sim.states import CheckpointSizes, sim_checkpoints
from kvtier.sim.timing import BatchShape, ending, prefill_tok_s

PLACEHOLDER_TOKEN = 0


class TimedRunner:
    """A :class:`~kvtier.serve.runner.StepRunner` that models each step's time instead of running
    a model: a step lasts ``timer.step_s(BatchShape.of(batch))`` virtual seconds, and a sequence
    that reaches its end gets one placeholder token (requests ignore EOS and finish after
    ``max_tokens``).

    Args:
        timer: anything with ``step_s(BatchShape) -> seconds``.
        model_config: the modelled model; only its limits reach the engine.
        config: the engine's sizes (the placeholder page pool's shape).

    Attributes:
        kv_caches: one layer of one-byte rows, ``[num_device_pages, page_size, 1]``: the pool's
            placeholder storage (``page_size`` bytes per block).
        busy_s: virtual seconds of the steps run.
        checkpoints: a hybrid model's :class:`~kvtier.serve.hybrid_state.CheckpointPlan` (the
            checkpoints each step yields, returned in its result).
        placeholder: the bytes every checkpoint it yields carries (``[checkpoint_bytes]`` uint8,
            zeros; the pool's placeholder unit, as its KV pages are).
    """

    def __init__(self, timer, model_config: KimiK2Config, config: EngineConfig):
        self.timer, self.model_config = timer, model_config
        self.device = torch.device("cpu")
        self.kv_caches = [torch.zeros((config.pool.num_device_pages, config.pool.page_size, 1),
                                      dtype=torch.uint8).view(torch.float8_e4m3fn)]
        self.busy_s = 0.0
        self.checkpoints = CheckpointPlan(config.pool.page_size)  # none taken until a grid is set
        self.placeholder = None

    def run(self, batch: ScheduledBatch) -> StepResult:
        """The step's modelled seconds, a placeholder token for each sequence it ends, and the
        checkpoints it yields (placeholder bytes)."""
        plan, payload = self.checkpoints, self.placeholder
        saved = [Checkpoint(seq.kv, b, payload, kind) for _, seq, b, kind in plan.asked(batch)] + plan.stopped()
        plan.decoded(batch, lambda seq: payload)
        seconds = self.timer.step_s(BatchShape.of(batch))
        self.busy_s += seconds
        return StepResult(tokens=dict.fromkeys((s.seq_id for s in ending(batch)), PLACEHOLDER_TOKEN), seconds=seconds,
                          checkpoints=saved, turn_ends=plan.turn_ends(batch))


class SimWorker:
    """A worker in virtual time: a real engine over a timed runner and a pool on modelled links.

    Args:
        config: the engine's sizes and cache policies (``disk_cache_dir`` is ignored; pass
            ``disk``).
        timer: anything with ``step_s(BatchShape) -> seconds``.
        links: tier links and the modelled block size.
        model_config: the modelled model.
        max_context_tokens: longest prompt the worker accepts (its ``max_position_embeddings``).
        clock: this worker's clock (a pool that waits on a copy moves it); None = a new one at 0.
        disk: the disk tier (None = none); may be shared with other workers.
        states: a hybrid model's checkpoint sizes and budgets (None: a K2-class model). With
            prefix caching, the pool keeps checkpoints in its store on virtual-time tiers
            (:func:`~kvtier.sim.states.sim_checkpoints`: device slots; host and disk slots when the
            configuration has those tiers) and the runner saves them.
        checkpoints: the checkpoint policy (:attr:`kvtier.serve.hybrid_state.CheckpointPlan.POLICIES`).

    Attributes:
        engine: the real :class:`Engine`; ``engine.pool``, ``engine.scheduler`` its pool and
            scheduler.
        runner: its :class:`TimedRunner`; copy_engine: its :class:`SimCopyEngine`.
        busy, step: a step (or a wait for a copy to end) is in flight; that step (None: a wait).
        running: the closed loop's session of each request id it runs (:mod:`kvtier.sim.loop`).
    """

    def __init__(self, config: EngineConfig, timer, links: TierLinks, model_config: KimiK2Config,
                 max_context_tokens: int, clock: VirtualClock | None = None, *, disk: SimDisk | None = None,
                 states: CheckpointSizes | None = None, checkpoints: str = "turn"):
        clock = clock or VirtualClock()
        self.config, self.links, self.clock = config, links, clock
        model_config = dataclasses.replace(model_config, max_position_embeddings=max_context_tokens)
        self.runner = TimedRunner(timer, model_config, config)
        self.copy_engine = SimCopyEngine(clock, links)
        # the placeholder pages' blocks: 1 layer x page_size x 1 byte
        cost = links.cost_model(config.pool.page_size, prefill_tok_s(timer, config.max_num_batched_tokens))
        store = None
        pool_config = config.pool_config()
        if states is not None and pool_config.enable_prefix_caching:
            scale = config.pool.page_size / links.block_bytes  # placeholder bytes per modelled byte
            store = sim_checkpoints(states, self.copy_engine, scale, host=bool(pool_config.host_cache_bytes),
                                    disk=disk is not None)
            self.runner.checkpoints = CheckpointPlan(config.pool.page_size, states.checkpoint_tokens, checkpoints)
            self.runner.placeholder = torch.zeros(store.checkpoint_bytes, dtype=torch.uint8)
        pool = KVPool(pool_config, self.runner.kv_caches, cost, copy_engine=self.copy_engine,
                      disk=disk, clock=clock, checkpoints=store)
        self.engine = Engine(None, config, runner=self.runner, pool=pool, clock=clock)
        self.pool, self.scheduler = pool, self.engine.scheduler
        self.busy, self.step = False, None
        self.running: dict[int, object] = {}

    @property
    def bytes_scale(self) -> float:
        """Modelled bytes per byte of the pool's placeholder blocks."""
        return self.links.block_bytes / self.pool.block_bytes

    def share_store(self, disk: SimDisk) -> None:
        """Index every block other workers store in ``disk`` (this worker's disk tier, shared): a
        block stored while this worker's copy engine collects a job is its own pool's write."""
        disk.on_store.append(lambda block_hash: not self.copy_engine.collecting
                             and self.pool.index_disk_block(block_hash))

    def begin(self) -> tuple[float, StepResult | None]:
        """Begin a step at ``clock.now``: ``(end_s, result)`` of the step, or ``(wake_s, None)``
        when nothing can run until a prefix load ends (the virtual time at which the next copy
        ends). A pool that stalled on a copy while scheduling may have let loads end: they are
        collected by scheduling again (at most twice), as the real engine's next step would.

        Raises:
            RuntimeError: nothing can be scheduled and nothing is loading (from ``begin_step``), or
                there is no request (an idle worker has no step to begin).
        """
        if not self.engine.has_unfinished():
            raise RuntimeError("begin: this worker has no request (nothing waits, loads or runs)")
        batch = self.engine.begin_step()
        for _ in range(2):
            ended = self.copy_engine.next_end_s()
            if batch or not self.scheduler.loading or ended is None or ended > self.clock.now:
                break
            batch = self.engine.begin_step()
        if not batch:
            wake = self.copy_engine.next_end_s(after=self.clock.now)
            if wake is None:
                raise RuntimeError("no request can be scheduled: prefix loads are in flight but no copy will end")
            return wake, None
        result = self.runner.run(batch)
        return self.clock.now + result.seconds, result
