"""The remote tier: blocks in a shared store, read and written on worker threads, lossy by contract.

Every call returns at once with a :class:`RemoteHandle` (the copy engine's handle interface:
``done``/``wait``/``result``/``run_s``), whose result is a per-block :class:`RemoteStatus`.
A value is served only after its header and CRC-32C passed (:mod:`.block_format`). A miss, a
corrupt value, a store error or no answer within ``timeout_s`` is a failed status, counted in
:class:`RemoteStats`, never an exception. After a timeout or a failed call the store is left
alone for ``retry_after_s`` (calls fail at once as ``UNAVAILABLE``), so a dead store costs
each step nothing. A call fails when it raises or when every key in it got ``ERROR``.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import torch

from kvtier.cache.disk_tier import BlockMeta
from kvtier.cache.remote import block_format
from kvtier.cache.remote.backend import RemoteBackend, RemoteStatus


@dataclass
class RemoteStats:
    """Counters of a :class:`RemoteTier` (blocks): ``gets[status name]``, ``puts[status name]``,
    ``exists_failures`` (exists queries that failed or timed out: treated as absent)."""


    gets: dict[str, int] = field(default_factory=lambda: {s.name.lower(): 0 for s in RemoteStatus})
    puts: dict[str, int] = field(default_factory=lambda: {s.name.lower(): 0 for s in RemoteStatus})
    exists_failures: int = 0
    last_error: str = ""
    """The last exception a call raised (for logs and /metrics readers), '' if none."""

    @property
    def misses(self) -> int:
        """Reads that did not give a block, whatever the reason."""
        return sum(n for k, n in self.gets.items() if k != "ok")


class RemoteHandle:
    """A submitted remote read or write of ``num_blocks`` blocks; ends by ``deadline`` at the latest."""

    def __init__(self, tier: RemoteTier, future: Future | None, num_blocks: int, kind: str):
        self._tier, self._future, self.num_blocks, self._kind = tier, future, num_blocks, kind
        self._deadline = time.monotonic() + tier.timeout_s
        self._result: list[int] | None = None if future is not None else [RemoteStatus.UNAVAILABLE] * num_blocks
        self.run_s = 0.0
        if future is None:
            tier._count(kind, self._result)

    def done(self) -> bool:
        return self._result is not None or self._future.done() or time.monotonic() >= self._deadline

    def wait(self, timeout_s: float | None = None) -> bool:
        if self.done():
            return True
        left = self._deadline - time.monotonic()
        try:
            self._future.result(left if timeout_s is None else min(left, timeout_s))
        except FutureTimeout:
            pass
        return self.done()

    def result(self) -> list[int]:
        """Per-block :class:`RemoteStatus` codes (0 = OK); waits until the deadline at most."""
        if self._result is None:
            try:
                statuses, self.run_s = self._future.result(max(0.0, self._deadline - time.monotonic()))
            except FutureTimeout:
                statuses = [RemoteStatus.TIMEOUT] * self.num_blocks
                self._tier._trip()
            self._result = [int(s) for s in statuses]
            self._tier._count(self._kind, self._result)
        return self._result


class RemoteTier:
    """Page-first blocks of one layout in a remote store, keyed by block hash.

    Args:
        backend: the store (:class:`RemoteBackend`).
        meta: layout of the blocks (what every read checks).
        timeout_s: longest wait for a call, in seconds (> 0).
        retry_after_s: seconds the store is left alone after a timeout or failed call.
        threads: worker threads for calls.
    """

    def __init__(self, backend: RemoteBackend, meta: BlockMeta, timeout_s: float = 1.0,
                 retry_after_s: float = 5.0, threads: int = 2):
        self.backend, self.meta = backend, meta
        self.timeout_s, self.retry_after_s = timeout_s, retry_after_s
        self.value_bytes = block_format.HEADER_BYTES + meta.payload_bytes
        self.stats = RemoteStats()
        self._prefix = block_format.key_prefix(meta)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvtier-remote")
        self._lock = threading.Lock()
        self._down_until = 0.0

    @property
    def url(self) -> str:
        return self.backend.url

    def key(self, block_hash: bytes) -> str:
        return self._prefix + block_hash.hex()

    def available(self) -> bool:
        """False while the store is left alone after a timeout or failure."""
        return time.monotonic() >= self._down_until

    def _trip(self) -> None:
        with self._lock:
            self._down_until = time.monotonic() + self.retry_after_s

    def _count(self, kind: str, statuses: list[int]) -> None:
        counts = self.stats.gets if kind == "get" else self.stats.puts
        with self._lock:
            for s in statuses:
                counts[RemoteStatus(s).name.lower()] += 1

    def _submit(self, fn, num_blocks: int, kind: str) -> RemoteHandle:
        if not self.available():
            return RemoteHandle(self, None, num_blocks, kind)
        return RemoteHandle(self, self._pool.submit(self._timed, fn, num_blocks), num_blocks, kind)

    def _timed(self, fn, num_blocks: int):
        t0 = time.perf_counter()
        try:
            statuses = fn()
        except Exception as e:  # the store as a whole failed (connection refused, reset, ...)
            self.stats.last_error = f"{type(e).__name__}: {e}"
            self._trip()
            statuses = [RemoteStatus.ERROR] * num_blocks
        if statuses and all(st == RemoteStatus.ERROR for st in statuses):
            self._trip()  # every key failed: the store itself is failing
        return statuses, time.perf_counter() - t0

    def put(self, hashes: list[bytes], payload: torch.Tensor) -> RemoteHandle:
        """Store blocks ``payload[i * payload_bytes:]`` under ``hashes[i]``, asynchronously.

        ``payload`` (a contiguous CPU tensor) is copied before this returns: the caller may
        reuse it at once.
        """
        n = self.meta.payload_bytes
        raw = payload.contiguous().view(torch.uint8).numpy().tobytes()[:n * len(hashes)]

        def run():
            values = [block_format.header(h, self.meta, raw[i * n:(i + 1) * n]) + raw[i * n:(i + 1) * n]
                      for i, h in enumerate(hashes)]
            return self.backend.batch_put([self.key(h) for h in hashes], values)
        return self._submit(run, len(hashes), "put")

    def get(self, hashes: list[bytes], out: torch.Tensor) -> RemoteHandle:
        """Read blocks ``hashes`` into ``out`` (a contiguous CPU uint8 tensor of at least
        ``len(hashes) * payload_bytes`` bytes) back to back, asynchronously; a block is OK only
        after its header and checksum passed."""
        n = self.meta.payload_bytes
        if out.device.type != "cpu" or not out.is_contiguous() or out.numel() * out.element_size() < n * len(hashes):
            raise ValueError(f"out must be a contiguous CPU tensor of at least {n * len(hashes)} bytes")
        dst = out.view(torch.uint8)

        def run():
            values = [bytearray(self.value_bytes) for _ in hashes]
            statuses = self.backend.batch_get([self.key(h) for h in hashes], [memoryview(v) for v in values])
            for i, (h, v) in enumerate(zip(hashes, values)):
                if statuses[i] == RemoteStatus.OK:
                    if block_format.check(v, h, self.meta):
                        dst[i * n:(i + 1) * n] = torch.frombuffer(v, dtype=torch.uint8)[block_format.HEADER_BYTES:]
                    else:
                        statuses[i] = RemoteStatus.CORRUPT
            return statuses
        return self._submit(run, len(hashes), "get")

    def exists(self, hashes: list[bytes]) -> list[bool]:
        """Which blocks the store holds now (blocks up to ``timeout_s``); all False when it does
        not answer in time or is left alone after a failure (counted in ``exists_failures``)."""
        if not hashes:
            return []
        if self.available():
            keys = [self.key(h) for h in hashes]
            future = self._pool.submit(self._timed, lambda: self.backend.exists(keys), len(hashes))
            try:
                found, _ = future.result(self.timeout_s)
                if all(isinstance(f, bool) for f in found):
                    return found
            except FutureTimeout:
                self._trip()
        self.stats.exists_failures += 1
        return [False] * len(hashes)

    def close(self) -> None:
        """Stop the worker threads (without waiting for a hung call) and close the backend."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            self.backend.close()
        except Exception:  # closing a store that is gone: nothing left to release
            pass
