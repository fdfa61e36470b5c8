"""The copy engine of device page pools (CUDA/ROCm): page gather/scatter on a copy stream.

Same interface as :class:`kvtier.transfer.CopyEngine` (``gather``, ``scatter``, ``run_io``
returning handles with ``done``, ``wait``, ``result``, ``run_s``), so
:class:`kvtier.cache.pool.KVPool` drives both the same way. Host buffers are the pool's pinned
host tier (one arena allocated once, slots of one page-first block) and pinned disk staging
buffers.

* device -> host (:meth:`DeviceCopyEngine.gather`, write-through and eviction): an event is
  recorded on the compute stream after the forward that wrote the pages; the copy stream waits
  on it, gathers the pages of every layer into a device staging buffer with
  :func:`kvtier.ops.gather_pages`'s kernel (Triton or HIP), then copies that to the pinned slot asynchronously. The
  handle is done when the copy completed: the pool keeps the page referenced until then, so the
  page is never reused under the copy, and indexes the host copy only then.
* host -> device (:meth:`DeviceCopyEngine.scatter`, a load): the copy stream (after the compute
  work enqueued so far, which may still read the destination page's old contents) copies the
  block to a device staging buffer, then :func:`kvtier.ops.scatter_pages`'s kernel writes it into the
  request's pages. The handle is done when that completed (other requests keep running
  meanwhile); its ``result()`` also orders the compute stream after the load's event, so the
  request's forward never reads a page that is not fully written.
* I/O jobs (:meth:`DeviceCopyEngine.run_io`, e.g. the disk tier's reads and writes of the
  pinned buffers, O_DIRECT and checksums): on the native engine's worker threads, as for CPU
  pools.

A copy that raises (when enqueued, or when it runs on :class:`kvtier.cache.streams.CpuStreams`)
fails its handle with :class:`kvtier.transfer.CopyError`; the pool then recomputes the span that
did not load and indexes nothing of it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier import ops  # noqa: F401 - registers torch.ops.kvtier.gather_pages and scatter_pages
from kvtier.cache.streams import CopySpan, Streams, streams_for
from kvtier.transfer import CopyEngine, CopyError


def _gather_kernel(pools: list[torch.Tensor], pages: torch.Tensor, out: torch.Tensor) -> None:
    """:func:`kvtier.ops.gather_pages`'s registered kernel, without the wrapper's checks (which
    read page ids back from the device, a host sync); the engine checks the ids on the host."""
    torch.ops.kvtier.gather_pages(pools, pages, out)


def _scatter_kernel(blocks: torch.Tensor, pools: list[torch.Tensor], pages: torch.Tensor) -> None:
    """:func:`kvtier.ops.scatter_pages`'s registered kernel; see :func:`_gather_kernel`."""
    torch.ops.kvtier.scatter_pages(blocks, pools, pages)


class DeviceCopyHandle:
    """A copy on the copy stream; the interface of :class:`kvtier.transfer.CopyHandle`.

    ``run_s`` (after ``result()``): seconds the copy ran on its stream, without the wait for
    the compute work before it.
    """

    def __init__(self, streams: Streams, span: CopySpan | None, num_blocks: int, *, load: bool,
                 error: BaseException | None = None, keepalive: tuple = ()):
        self._streams, self._span, self.num_blocks, self._load = streams, span, num_blocks, load
        self._error = error
        self._keepalive = keepalive  # host and device buffers the copy reads or writes
        self._result: list[int] | None = None
        self.run_s = 0.0

    def done(self) -> bool:
        """True once the copy completed (successfully or not); never blocks."""
        return self._result is not None or self._error is not None or self._span.query()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the copy completes or ``timeout_s`` seconds pass; True if it completed."""
        if self.done():
            return True
        if timeout_s is None:
            self._span.synchronize()
            return True
        return self._span.wait(timeout_s)

    def result(self) -> list[int]:
        """``[0] * num_blocks`` after waiting for the copy; a load also orders the compute
        stream after it.

        Raises:
            CopyError: the copy failed (nothing it wrote may be used).
        """
        if self._result is None:
            if self._error is None:
                self.wait()
                self._error = self._span.error
            self._keepalive = ()
            if self._error is not None:
                raise CopyError(f"{type(self._error).__name__}: {self._error}")
            if self._load:
                self._streams.compute_wait(self._span)
            self.run_s = self._span.elapsed_s()
            self._result = [0] * self.num_blocks
        elif self._error is not None:
            raise CopyError(f"{type(self._error).__name__}: {self._error}")
        return self._result


class DeviceCopyEngine:
    """Block copies between device page pools and pinned host buffers on a copy stream.

    Args:
        device: the page pools' device (``cuda``; ``cpu`` runs the same path on synchronous
            :class:`kvtier.cache.streams.CpuStreams`).
        streams: the compute/copy streams; None = :func:`kvtier.cache.streams.streams_for`.
        io_threads: worker threads of the native engine that runs I/O jobs.

    Example (CPU, copy stream deferred until waited for):
        >>> from kvtier.cache.streams import CpuStreams
        >>> pools = [torch.arange(12.).view(3, 2, 2) + 100 * l for l in range(2)]
        >>> host = torch.empty(2 * 2 * 2 * 4, dtype=torch.uint8)
        >>> h = DeviceCopyEngine("cpu", CpuStreams(deferred=True)).gather(pools, [1], host)
        >>> h.done(), h.result(), host.view(torch.float32)[:2].tolist()
        (False, [0], [4.0, 5.0])
    """

    def __init__(self, device: torch.device | str, streams: Streams | None = None, *, io_threads: int = 2):
        self.device = torch.device(device)
        self.streams = streams if streams is not None else streams_for(self.device)
        self._io = CopyEngine(io_threads, max_queued=256)

    # ---- device pages <-> host buffers -----------------------------------------------------------
    def gather(self, pools: Sequence[torch.Tensor], pages: Sequence[int], staging: torch.Tensor) -> DeviceCopyHandle:
        """Copy ``pages`` of every layer pool into host ``staging`` (page-first), asynchronously,
        after the compute work enqueued so far.

        Args:
            pools: per-layer ``[num_pages, page_size, row]`` page pools on this engine's device.
            pages: page ids.
            staging: contiguous CPU buffer (pinned for an asynchronous copy) of at least
                ``len(pages) * num_layers * page_bytes`` bytes.

        Raises:
            ValueError: a staging buffer that is not a contiguous CPU tensor or is too small (a
            page id out of range fails the handle with CopyError instead).
        """
        host = self._host_view(pools, len(pages), staging)
        first = pools[0]

        def work():
            ids = self._page_tensor(pages, first.shape[0], distinct=False)
            dev = torch.empty(len(pages), len(pools), *first.shape[1:], dtype=first.dtype, device=self.device)
            _gather_kernel(list(pools), ids, dev)
            host.copy_(dev.reshape(-1).view(torch.uint8), non_blocking=True)

        return self._submit(work, len(pages), load=False, keepalive=(tuple(pools), staging))

    def scatter(self, staging: torch.Tensor, pools: Sequence[torch.Tensor], pages: Sequence[int]) -> DeviceCopyHandle:
        """Copy page-first blocks from host ``staging`` into ``pages`` of every layer pool,
        asynchronously, after the compute work enqueued so far; ``result()`` orders later
        compute work after the copy.

        Raises:
            ValueError: as :meth:`gather`.
        """
        host = self._host_view(pools, len(pages), staging)
        first = pools[0]

        def work():
            ids = self._page_tensor(pages, first.shape[0], distinct=True)
            dev = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
            dev.copy_(host, non_blocking=True)
            blocks = dev.view(first.dtype).view(len(pages), len(pools), *first.shape[1:])
            _scatter_kernel(blocks, list(pools), ids)

        return self._submit(work, len(pages), load=True, keepalive=(tuple(pools), staging))

    def _page_tensor(self, pages: Sequence[int], num_pages: int, *, distinct: bool) -> torch.Tensor:
        """``pages`` as an int64 tensor on the device, checked on the host: no device value is
        read back, so enqueueing never waits for the copy stream."""
        ids = [int(p) for p in pages]
        if any(not 0 <= p < num_pages for p in ids):
            raise ValueError(f"pages must be in [0, num_pages={num_pages}), got {ids}")
        if distinct and len(set(ids)) != len(ids):
            raise ValueError(f"pages must be distinct for a scatter, got {ids}")
        t = torch.tensor(ids, dtype=torch.int64)
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _host_view(self, pools: Sequence[torch.Tensor], num_blocks: int, staging: torch.Tensor) -> torch.Tensor:
        """The first ``num_blocks`` blocks' bytes of ``staging`` as a flat uint8 view."""
        first = pools[0]
        need = num_blocks * len(pools) * first.shape[1] * first.shape[2] * first.element_size()
        have = staging.numel() * staging.element_size()
        if staging.device.type != "cpu" or not staging.is_contiguous() or have < need:
            raise ValueError(f"staging must be a contiguous CPU tensor of at least {need} bytes "
                             f"({num_blocks} blocks), got {have} bytes on {staging.device}"
                             f"{'' if staging.is_contiguous() else ', not contiguous'}")
        return staging.reshape(-1).view(torch.uint8)[:need]

    def _submit(self, work, num_blocks: int, *, load: bool, keepalive: tuple) -> DeviceCopyHandle:
        try:
            span = self.streams.on_copy(work, after=self.streams.record_compute())
        except Exception as e:  # noqa: BLE001 - a copy that cannot be enqueued fails its handle
            return DeviceCopyHandle(self.streams, None, num_blocks, load=load, error=e)
        return DeviceCopyHandle(self.streams, span, num_blocks, load=load, keepalive=keepalive)

    # ---- blocking I/O jobs (the native engine's worker threads) ---------------------------------
    def run_io(self, job):
        """Run an I/O job on the native workers; see :meth:`kvtier.transfer.CopyEngine.run_io`."""
        return self._io.run_io(job)

    @property
    def queued(self) -> int:
        """I/O jobs waiting for a worker."""
        return self._io.queued


# ---- the pool's choice of copy engine, and the checks of a tiered pool on a GPU ----------------------
PINNED_FRACTION = 0.8
"""Share of the host's available memory (``MemAvailable``) a pinned host tier may take: page-locked
memory cannot be swapped, so a tier near the whole memory starves the rest of the process."""

_PAGE_KERNEL_BACKENDS = ("triton", "hip")


def available_host_bytes() -> int:
    """Memory the host can still give without swapping (``MemAvailable`` of /proc/meminfo; the
    physical memory where that file does not exist)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_device_tiers(host_cache_bytes: int, disk_cache_dir, kv_caches: Sequence[torch.Tensor]) -> None:
    """Check that a pool over ``kv_caches`` can have its host and disk tiers; nothing for CPU pools
    or a device-only pool.

    Raises:
        ValueError: GPU page pools with a host or disk tier on a device where neither the Triton
            nor the HIP page gather/scatter kernels run (naming ``host_cache_bytes`` /
            ``disk_cache_dir`` and why), or ``host_cache_bytes`` larger than
            :data:`PINNED_FRACTION` of the host's available memory (pinned memory).
    """
    device = kv_caches[0].device
    if device.type == "cpu" or not (host_cache_bytes or disk_cache_dir):
        return
    from kvtier.ops.dispatch import unavailable_reason

    reasons = [f"{b}: {unavailable_reason(op, b, device)}" for op in ("gather_pages", "scatter_pages")
               for b in _PAGE_KERNEL_BACKENDS if unavailable_reason(op, b, device)]
    if len(reasons) == 2 * len(_PAGE_KERNEL_BACKENDS):
        raise ValueError(f"host_cache_bytes={host_cache_bytes} / disk_cache_dir={disk_cache_dir!r} need the GPU "
                         f"page kernels (gather_pages/scatter_pages on triton or hip) on {device}, and none "
                         f"runs here ({'; '.join(reasons[:2])}); install triton or build kvtier._hip, or set "
                         "host_cache_bytes=0 and disk_cache_dir=None for a device-only pool")
    limit = int(available_host_bytes() * PINNED_FRACTION)
    if host_cache_bytes > limit:
        raise ValueError(f"host_cache_bytes={host_cache_bytes:,} exceeds the pinned memory this host allows for "
                         f"a GPU pool's host tier: {limit:,} bytes ({PINNED_FRACTION:.0%} of the "
                         f"{available_host_bytes():,} bytes available); expected at most that")


def copy_engine_for(kv_caches: Sequence[torch.Tensor], copy_threads: int):
    """The copy engine a pool over ``kv_caches`` starts: the native memcpy engine for CPU page
    pools, a :class:`DeviceCopyEngine` on the device's streams for GPU page pools."""
    device = kv_caches[0].device
    if device.type == "cpu":
        return CopyEngine(copy_threads, max_queued=256)
    return DeviceCopyEngine(device, io_threads=copy_threads)
