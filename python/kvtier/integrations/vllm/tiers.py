"""The connector's two halves over kvtier's tiers, free of vLLM imports.

The tiers themselves are ``cache/``'s (:mod:`kvtier.cache.tiers.foreign`: host slots and their
eviction, disk budget and recovery, remote store, probes). What is vLLM's here:

* :class:`SchedulerIndex`: the tiers where vLLM's scheduler decides, with the cost model's prefill
  rate taken from the connector (:class:`kvtier.integrations.vllm.rate.PrefillRate`).
* :class:`WorkerTiers`: the tiers in a vLLM worker, and when their copies run relative to vLLM's
  step. Loads run on a loader thread, either layer by layer within the step that needs them
  (:meth:`WorkerTiers.start_layered`: the blocks are read, then scattered one layer after
  another while the forward pass runs; :meth:`WorkerTiers.wait_layer` holds a layer's attention
  until its blocks are in) or as vLLM's asynchronous loads (:meth:`WorkerTiers.submit_load`: a
  request waits in ``WAITING_FOR_REMOTE_KVS`` until :meth:`WorkerTiers.finished_loads` reports
  it). A step's saves
  run on a saver thread: one gather per layer of all of the step's new blocks into their host
  slots, then the writes to disk and the remote store from a private copy.
  :meth:`WorkerTiers.fence`, called before the next forward pass, waits for the gathers only (a
  block vLLM frees may be overwritten by that pass); the writes below the host run on.

Order: a host slot the scheduler reuses is never one a load in flight reads (the scheduler locks
a load's host copies until the load is reported finished), and a step's gathers end before the
next step's loads start (:meth:`WorkerTiers.fence` runs first), so a load never reads a slot
before its save filled it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch

from kvtier.cache.block_layout import BlockLayout
from kvtier.cache.config import PoolConfig
from kvtier.cache.remote import RemoteTier
from kvtier.cache.tiers.foreign import MISSING, ForeignIndex, ForeignPages, LoadJob, SaveJob, StepPlan
from kvtier.integrations.vllm.config import open_remote_checked

__all__ = ["MISSING", "LoadJob", "SaveJob", "SchedulerIndex", "StepPlan", "WorkerTiers"]


class SchedulerIndex(ForeignIndex):
    """kvtier's tiers in vLLM's scheduler (:class:`kvtier.cache.tiers.foreign.ForeignIndex`).

    Args:
        config: the tiers' settings (``page_size`` = vLLM's block size).
        layout: the layout of one tier block (the same the workers compute from their caches).
        prefill_tok_s: the prefill rate the cost model starts from (tokens/s; the connector then
            sets it from the steps it sees).
        remote: a :class:`kvtier.cache.remote.RemoteTier` to ask which blocks it holds, or None.
    """

    def __init__(self, config: PoolConfig, layout: BlockLayout, prefill_tok_s: float,
                 remote: RemoteTier | None = None):
        super().__init__(config, layout.meta(), remote)
        self.layout = layout
        self.cost_model.prefill_tok_s = float(prefill_tok_s)


class WorkerTiers(ForeignPages):
    """kvtier's tiers in one vLLM worker (:class:`kvtier.cache.tiers.foreign.ForeignPages`), with
    the threads that keep their copies off vLLM's step.

    Args:
        config: the tiers' settings.
        caches: vLLM's KV cache tensors, one per layer in model order.
        block_dim: the dim of each cache that block ids index (0 for vLLM's per-layer
            ``[num_blocks, H, block_size, C]`` view, 1 for a ``[2, num_blocks, ...]`` K/V cache).
        token_dim: the dim of one page that counts tokens.
        stats_path: a JSON file the counters are written to after each step that changed them, or None.

    Raises:
        ValueError: caches of different shapes or dtypes, or the remote store does not answer
            (names ``remote_cache_url``); RuntimeError: the disk directory cannot be opened.
    """

    def __init__(self, config: PoolConfig, caches: Sequence[torch.Tensor], block_dim: int, token_dim: int,
                 stats_path: str | None = None):
        super().__init__(config, caches, block_dim, token_dim)
        if config.remote_cache_url:
            self.remote = open_remote_checked(config.remote_cache_url, self.meta, config.remote_timeout_s)
        self.stats_path = stats_path
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvtier-save")
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvtier-load")
        self._gathered: list[threading.Event] = []
        self._saves: list[Future] = []
        self._loads: dict[str, list[Future]] = {}
        self._layered: Future | None = None
        self._layer_events: list[threading.Event] = []

    # ---- synchronous (tests, shutdown) -----------------------------------------------------------
    def load(self, jobs: Sequence[LoadJob]) -> set[int]:
        """Run loads now; returns the vLLM block ids that failed."""
        failed: set[int] = set()
        for job in jobs:
            failed.update(super().load(job))
        return failed

    def save(self, plan: StepPlan) -> None:
        """Run a step's spills, saves and disk removals now, to the end."""
        self._save_step(plan, threading.Event())

    # ---- asynchronous (the connector) ------------------------------------------------------------
    def submit_save(self, plan: StepPlan) -> None:
        """Queue a step's spills, saves and disk removals on the saver thread; returns at once."""
        if plan.empty():
            return
        gathered = threading.Event()
        self._gathered.append(gathered)
        self._saves = [f for f in self._saves if not f.done()]
        self._saves.append(self._saver.submit(self._save_step, plan, gathered))

    def fence(self) -> None:
        """Wait until every queued save has copied its blocks out of vLLM's caches (call it
        before a forward pass that may overwrite freed blocks); writes below the host go on."""
        for event in self._gathered:
            event.wait()
        self._gathered.clear()

    def saves_in_flight(self) -> int:
        """Queued saves whose writes have not all ended."""
        return sum(not f.done() for f in self._saves)

    def submit_load(self, job: LoadJob) -> None:
        """Queue one request's load on the loader thread; returns at once."""
        self._loads.setdefault(job.req_id, []).append(self._loader.submit(super().load, job))

    def start_layered(self, jobs: Sequence[LoadJob]) -> None:
        """Queue a step's loads on the loader thread, layer by layer: every block read first,
        then layer 0 of every block scattered, then layer 1, ...; returns at once."""
        self._layer_events = [threading.Event() for _ in self.caches]
        self._layered = self._loader.submit(self._run_layered, list(jobs), self._layer_events)

    def wait_layer(self, layer: int | None) -> None:
        """Wait until layer ``layer`` (index into the caches; None: every layer) of the step's
        loads is in vLLM's cache (at once when none is in flight)."""
        events = self._layer_events if layer is None else self._layer_events[layer:layer + 1]
        for event in events:
            event.wait()

    def end_layered(self) -> set[int]:
        """Wait for the step's layer-by-layer loads to end; the vLLM block ids that failed."""
        if self._layered is None:
            return set()
        future, self._layered, self._layer_events = self._layered, None, []
        return set(future.result())

    def _run_layered(self, jobs: list[LoadJob], events: list[threading.Event]) -> list[int]:
        failed, reads, t0 = [], [], time.perf_counter()
        native = [job for job in jobs if self.native_host_load(job)]
        try:
            for job in jobs:
                if job in native:
                    self.stats.loaded["host"] += len(job.hashes)
                    continue
                staging, good = self.read(job)
                reads.append((staging, job.block_ids[:good]))
                failed += job.block_ids[good:]
            tmp = torch.empty(max((len(j.hashes) for j in native), default=0) * self.layout.page_bytes,
                              dtype=torch.uint8)
            for layer, event in enumerate(events):
                for job in native:
                    self.load_layer(job, layer, tmp)
                for staging, ids in reads:
                    self.scatter(staging, ids, [layer])
                event.set()
        finally:
            for event in events:  # a failed read must not leave the forward pass waiting
                event.set()
        self.stats.load_jobs += len(jobs)
        self.stats.load_s += time.perf_counter() - t0
        return failed

    def loading(self, req_id: str) -> bool:
        return req_id in self._loads

    def finished_loads(self) -> tuple[set[str], set[int]]:
        """``(req_ids, failed_block_ids)``: the requests whose loads all ended since the last
        call, and the blocks of theirs that failed to load."""
        done, failed = set(), set()
        for req_id, futures in list(self._loads.items()):
            if all(f.done() for f in futures):
                del self._loads[req_id]
                done.add(req_id)
                for f in futures:
                    failed.update(f.result())
        return done, failed

    def _save_step(self, plan: StepPlan, gathered: threading.Event) -> None:
        try:
            jobs = self.spill(plan.spills)  # reads private copies of the slots before the gather refills them
            blocks = self.gather(plan.saves) if plan.saves else None
        finally:
            gathered.set()
        if blocks is not None:
            jobs += self.write_down(plan.saves, blocks)
        self.ended(jobs)
        self.remove(plan.disk_removes)
        self.write_stats()

    def wait_idle(self) -> None:
        """Wait for every queued save and load to end."""
        for f in [*self._saves, *(f for fs in self._loads.values() for f in fs)]:
            f.result()
        self.end_layered()

    def write_stats(self) -> None:
        """Write the counters to ``stats_path`` (atomically), if set."""
        if self.stats_path is None:
            return
        tmp = f"{self.stats_path}.{os.getpid()}.{threading.get_ident()}.tmp"
        Path(tmp).write_text(json.dumps(asdict(self.stats)))
        os.replace(tmp, self.stats_path)

    def close(self) -> None:
        self.wait_idle()
        self._saver.shutdown()
        self._loader.shutdown()
        self.write_stats()
        super().close()
