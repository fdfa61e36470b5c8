"""One simulated worker: the real scheduler and tiered pool, with the model forward replaced by
a step timer and every copy by a virtual-time job.

:meth:`SimEngine.begin_step` / :meth:`SimEngine.end_step` are ``kvtier.serve.Engine.step`` split
at the forward pass: ``Scheduler.schedule()`` runs at the step's start (polling the pool,
collecting ended loads, admitting), the step lasts ``timer.step_s(BatchShape.of(batch))`` virtual
seconds, and at its end each sequence advances by its chunk (``Scheduler.advance``; the pool indexes
its new full blocks, starting write-through copies), and sequences that reached their end get
one token (a placeholder id: the simulator never materialises tokens, requests ignore EOS) and
finish after ``max_tokens``. The prefill rate the pool's cost model learns comes from these
virtual step times, as the engine's does from measured ones.

Prompts are lengths plus block hashes: a :class:`~kvtier.serve.request.Sequence` is created with
its ``block_hashes`` precomputed for every full block it will ever hold, so neither the
scheduler nor the pool needs token ids (:class:`PromptLength` refuses to produce any).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvtier.bench.sim.copies import SimCopyEngine, SimDisk, VirtualClock
from kvtier.bench.sim.hardware import Link
from kvtier.bench.sim.timing import BatchShape
from kvtier.cache.cost_model import CostModel, TierCost
from kvtier.cache.pool import KVPool
from kvtier.cache.prefix_index import Tier
from kvtier.serve.config import EngineConfig
from kvtier.serve.params import RequestMetrics, SamplingParams
from kvtier.serve.request import Sequence
from kvtier.serve.scheduler import ScheduledBatch, Scheduler

_PLACEHOLDER_TOKEN = 0


class PromptLength(bytes):
    """Stands for a prompt's token ids where only its length is known: ``len()`` works (at C
    speed: the scheduler asks for it many times per step), reading tokens does not.

    Raises:
        RuntimeError: on any attempt to read or iterate tokens: the simulator gives sequences
        all their block hashes up front, so reaching for tokens means that contract broke.
    """

    __slots__ = ()

    def __new__(cls, num_tokens: int):
        return super().__new__(cls, num_tokens)

    def __getitem__(self, key):
        raise RuntimeError(
            "a simulated prompt has no token ids: its block hashes must be precomputed"
        )

    def __iter__(self):
        raise RuntimeError(
            "a simulated prompt has no token ids: its block hashes must be precomputed"
        )


@dataclass(frozen=True)
class TierLinks:
    """The links a worker's tiers copy over, and the modelled bytes of one block.

    Attributes:
        block_bytes: bytes one pool block stands for (KV of ``page_size`` tokens, all layers).
        device_to_host, host_to_device: one device's host link, each direction.
        disk: the disk tier's link as seen from host memory.
    """

    block_bytes: float
    device_to_host: Link
    host_to_device: Link
    disk: Link

    def cost_model(self, pool_block_bytes: int, prefill_tok_s: float) -> CostModel:
        """The pool's starting cost model, in the pool's units.

        The pool measures blocks in its own (placeholder) bytes, so bandwidths are scaled by
        ``pool_block_bytes / block_bytes``; a disk load goes disk -> host -> device, so its rate is
        the two links in series. As on a real pool, observed copies and steps then update it.
        """
        scale = pool_block_bytes / self.block_bytes
        h2d, disk = self.host_to_device, self.disk
        serial = 1.0 / (1.0 / disk.bandwidth_Bps + 1.0 / h2d.bandwidth_Bps)
        return CostModel(
            tiers={
                Tier.HOST: TierCost(h2d.latency_s, h2d.bandwidth_Bps * scale),
                Tier.DISK: TierCost(disk.latency_s + h2d.latency_s, serial * scale),
            },
            prefill_tok_s=prefill_tok_s,
        )


@dataclass
class Step:
    """A step in flight: its batch, its shape (sizes before it ran) and when it ends."""

    batch: ScheduledBatch
    shape: BatchShape
    start_s: float
    end_s: float


class SimEngine:
    """A worker in virtual time.

    Args:
        config: the engine's sizes and cache policies (``disk_cache_dir`` is ignored; pass
            ``disk``).
        timer: anything with ``step_s(BatchShape) -> seconds`` and ``prefill_tok_s(n)``.
        links: tier links and the modelled block size.
        clock: this worker's clock (a pool that waits on a copy moves it).
        disk: the disk tier (None = none); may be shared with other workers.
        salt: block-hash salt of this worker's pool (workers that share a store share a salt).

    Attributes:
        pool, scheduler: the real :class:`KVPool` and :class:`Scheduler`.
        num_prefill_tokens: tokens run as prefill (prompt chunks and recomputation).
        busy_s: virtual seconds spent in steps.
    """

    def __init__(
        self,
        config: EngineConfig,
        timer,
        links: TierLinks,
        clock: VirtualClock,
        *,
        disk: SimDisk | None = None,
        salt: bytes = b"",
    ):
        self.config, self.timer, self.links, self.clock = config, timer, links, clock
        # One layer of one-byte rows: the pool's placeholder storage (page_size bytes per block).
        kv_caches = [
            torch.zeros(
                (config.pool.num_device_pages, config.pool.page_size, 1), dtype=torch.uint8
            ).view(torch.float8_e4m3fn)
        ]
        self.copy_engine = SimCopyEngine(
            clock,
            links.block_bytes,
            device_to_host=links.device_to_host,
            host_to_device=links.host_to_device,
            disk=links.disk,
            owner=self,
        )
        pool_config = config.pool_config(salt)
        pool_block_bytes = (
            config.pool.page_size
        )  # BlockMeta of kv_caches: 1 layer x page_size x 1 byte
        cost = links.cost_model(
            pool_block_bytes, timer.prefill_tok_s(config.max_num_batched_tokens)
        )
        self.pool = KVPool(
            pool_config,
            kv_caches,
            cost,
            copy_engine=self.copy_engine,
            disk=disk,
            clock=clock,
        )
        self.scheduler = Scheduler(config, self.pool, clock=clock)
        self.num_prefill_tokens = 0
        self.busy_s = 0.0
        self._next_id = 0

    @property
    def bytes_scale(self) -> float:
        """Modelled bytes per byte of the pool's placeholder blocks."""
        return self.links.block_bytes / self.pool.block_bytes

    def new_sequence(
        self,
        num_prompt_tokens: int,
        max_tokens: int,
        block_hashes: list[bytes],
        arrival_s: float,
    ) -> Sequence:
        """A request of ``num_prompt_tokens`` tokens generating ``max_tokens``, not yet queued.

        ``block_hashes`` must cover every full block of prompt + output (``(num_prompt_tokens +
        max_tokens) // page_size`` hashes).

        Raises:
            ValueError: too few hashes.
        """
        need = (num_prompt_tokens + max_tokens) // self.config.pool.page_size
        if len(block_hashes) < need:
            raise ValueError(
                f"block_hashes has {len(block_hashes)} hashes; {need} full blocks need one each"
            )
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        seq = Sequence(
            self._next_id,
            PromptLength(num_prompt_tokens),
            params,
            RequestMetrics(arrival_s),
            prompt_block_hashes=block_hashes,
        )
        self._next_id += 1
        return seq

    def share_store(self, disk: SimDisk) -> None:
        """Index every block other workers store in ``disk`` (this engine's disk tier, shared)."""
        disk.on_store.append(
            lambda block_hash, writer: (
                writer is not self and self.pool.index_disk_block(block_hash)
            )
        )

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def begin_step(self) -> Step | float:
        """Schedule at ``clock.now``: a :class:`Step`, or (nothing runnable while prefix loads run)
        the virtual time at which the next copy ends.

        Raises:
            RuntimeError: nothing can be scheduled and nothing is loading (the page pool is too
                small for the waiting requests), as ``Engine.step``.
        """
        batch = self.scheduler.schedule()
        if (
            not batch and not self.scheduler.loading
        ):  # pages may be held by copies: let them end, retry once
            self.pool.poll(wait=True)
            batch = self.scheduler.schedule()
        for _ in range(
            2
        ):  # loads that ended while the pool stalled on a copy: collect them now
            ended = self.copy_engine.next_end_s()
            if (
                batch
                or not self.scheduler.loading
                or ended is None
                or ended > self.clock.now
            ):
                break
            batch = self.scheduler.schedule()
            if (
                not batch and not self.scheduler.loading
            ):  # the loaded sequences could not be placed and gave their pages back: retry once
                self.pool.poll(wait=True)
                batch = self.scheduler.schedule()
        if not batch:
            wake = self.copy_engine.next_end_s(after=self.clock.now)
            if not self.scheduler.loading or wake is None:
                raise RuntimeError(
                    "no request can be scheduled: the page pool is too small for the waiting requests"
                )
            return wake
        shape = BatchShape.of(batch)
        start = self.clock.now
        return Step(batch, shape, start, start + self.timer.step_s(shape))

    def end_step(self, step: Step) -> list[Sequence]:
        """Apply ``step`` at its end (the clock is there); returns the sequences that finished."""
        batch, seconds = step.batch, step.end_s - step.start_s
        self.busy_s += seconds
        prefill = sum(n for _, n in batch.extends)
        self.num_prefill_tokens += prefill
        if batch.extends:
            self.pool.cost_model.observe_prefill(batch.num_tokens, seconds)
        finished = []
        now = self.clock.now
        for seq, n in [*batch.extends, *((s, 1) for s in batch.decodes)]:
            self.scheduler.advance(seq, n)
            if seq.num_computed_tokens < seq.num_tokens:
                continue
            seq.output_token_ids.append(_PLACEHOLDER_TOKEN)
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                seq.metrics.finish_time = now
                self.scheduler.finish(seq, "length")
                finished.append(seq)
        return finished

    def pool_bytes_moved(self) -> dict[str, int]:
        """The pool's byte counters in modelled bytes, keyed as ``ConfigRun.bytes_moved``."""
        s, k = self.pool.stats, self.bytes_scale
        return {
            "device->host": round(s.bytes_written["host"] * k),
            "host->device": round(s.bytes_loaded["host"] * k),
            "host->disk": round(s.bytes_written["disk"] * k),
            "disk->device": round(s.bytes_loaded["disk"] * k),
        }
