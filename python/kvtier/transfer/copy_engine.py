"""Python face of the native copy engine (``kvtier._C.CopyEngine``).

Blocks are page-first: block ``i`` of a staging buffer holds page ``pages[i]`` of every layer
back to back (``num_layers * page_bytes`` bytes). Gather/scatter run as ``memcpy`` on worker
threads for CPU tensors; the tensors a job touches are kept alive until it is collected. I/O
jobs (:class:`kvtier.cache.seams.IOJob`: a tier's blocking reads and writes, which queue
themselves on native workers) run on workers of their own; the engine knows no tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier import _C


class CopyError(RuntimeError):
    """A copy job failed as a whole (the native worker raised)."""


@dataclass(frozen=True)
class PagePoolView:
    """Raw-pointer view of per-layer page pools ``[num_pages, page_size, row]`` (CPU tensors).

    Attributes:
        layer_ptrs: base address of each layer's pool.
        page_stride_bytes: bytes between consecutive pages.
        page_bytes: bytes of one page (``page_size * row * element_size``), contiguous.
        num_pages: pages per pool.
    """

    layer_ptrs: tuple[int, ...]
    page_stride_bytes: int
    page_bytes: int
    num_pages: int

    @property
    def block_bytes(self) -> int:
        """Bytes of one page-first block: ``num_layers * page_bytes``."""
        return len(self.layer_ptrs) * self.page_bytes

    @staticmethod
    def of(pools: Sequence[torch.Tensor]) -> PagePoolView:
        """View of ``pools`` (one per layer, same shape, dtype and strides).

        Raises:
            ValueError: a non-CPU pool, mismatched pools, or pages that are not contiguous.
        """
        first = pools[0]
        for i, p in enumerate(pools):
            if p.device.type != "cpu":
                raise ValueError(f"pools[{i}] is on {p.device}; the native copy engine copies CPU memory")
            if p.shape != first.shape or p.dtype != first.dtype or p.stride() != first.stride():
                raise ValueError(f"pools[{i}] differs from pools[0] in shape, dtype or strides")
            if p.dim() != 3 or not p[0].is_contiguous():
                raise ValueError(f"pools[{i}] must be [num_pages, page_size, row] with contiguous pages, "
                                 f"got shape {tuple(p.shape)} strides {p.stride()}")
        es = first.element_size()
        return PagePoolView(tuple(p.data_ptr() for p in pools), first.stride(0) * es,
                            first.shape[1] * first.shape[2] * es, first.shape[0])


class CopyHandle:
    """A submitted copy; ``wait()`` then ``result()``.

    After ``result()``, ``run_s`` holds the seconds the job ran on its worker thread (copy
    time without queueing or the wait to be noticed): what the cost model learns bandwidth from.
    """

    def __init__(self, native, keepalive: dict[int, tuple], handle: int, num_blocks: int):
        self._native, self._keepalive, self.handle, self.num_blocks = native, keepalive, handle, num_blocks
        self._result: list[int] | None = None
        self.run_s = 0.0

    def done(self) -> bool:
        """True once the job ended (successfully or not); never blocks."""
        return self._result is not None or self._native.poll(self.handle) != _C.JobState.PENDING

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the job ends or ``timeout_s`` passes; True if it ended."""
        if self._result is not None:
            return True
        state = self._native.wait(self.handle, -1.0 if timeout_s is None else timeout_s)
        return state != _C.JobState.PENDING

    def result(self) -> list[int]:
        """Per-block status (0 = ok) after waiting for the job.

        Raises:
            CopyError: the job failed as a whole.
        """
        if self._result is None:
            self.wait()
            state, statuses, error, self.run_s = self._native.collect(self.handle)
            self._keepalive.pop(self.handle, None)
            if state == _C.JobState.FAILED:
                self._result = []
                raise CopyError(error)
            self._result = list(statuses)
        return self._result


class CopyEngine:
    """Worker threads for batched block copies behind bounded queues.

    Memory copies (gather/scatter) and I/O jobs (:meth:`run_io`) run on separate native
    engines, each with ``num_threads`` workers and its own queue, so a copy the serving loop
    waits for (an evicted page's write-back, a load) never queues behind disk writes that sync
    to storage.

    Args:
        num_threads: worker threads of each engine (>= 1).
        max_queued: jobs waiting at most per engine; ``submit`` blocks (GIL released) beyond that.
    """

    def __init__(self, num_threads: int = 2, max_queued: int = 64):
        self._native = _C.CopyEngine(num_threads, max_queued)
        self._native_io = _C.CopyEngine(num_threads, max_queued)
        self._keepalive: dict[int, tuple] = {}
        self._keepalive_io: dict[int, object] = {}
        self._views: dict[int, tuple[Sequence[torch.Tensor], tuple[int, int, int], PagePoolView]] = {}

    def _view(self, pools: Sequence[torch.Tensor]) -> PagePoolView:
        """``PagePoolView.of(pools)``, checked once per pool list: an engine's page pools are
        the same tensors on every copy, and checking every layer per one-block job cost more
        than the copy. A list whose length or first and last tensors changed is checked again."""
        key = (len(pools), pools[0].data_ptr(), pools[-1].data_ptr())
        got = self._views.get(id(pools))
        if got is None or got[0] is not pools or got[1] != key:
            got = self._views[id(pools)] = (pools, key, PagePoolView.of(pools))
        return got[2]

    def _check_staging(self, view: PagePoolView, pages: np.ndarray, staging: torch.Tensor) -> None:
        if staging.device.type != "cpu" or not staging.is_contiguous():
            raise ValueError("staging must be a contiguous CPU tensor")
        need = len(pages) * view.block_bytes
        if staging.numel() * staging.element_size() < need:
            raise ValueError(f"staging holds {staging.numel() * staging.element_size()} bytes, "
                             f"{len(pages)} blocks need {need}")

    def gather(self, pools: Sequence[torch.Tensor], pages: Sequence[int], staging: torch.Tensor) -> CopyHandle:
        """Copy ``pages`` of every layer pool into ``staging`` (page-first), asynchronously.

        Raises:
            ValueError: bad pools or a too-small staging buffer (a page id out of range fails
            the job with CopyError instead).
        """
        return self._pages(self._native.submit_gather, pools, pages, staging)

    def scatter(self, staging: torch.Tensor, pools: Sequence[torch.Tensor], pages: Sequence[int]) -> CopyHandle:
        """Copy page-first blocks from ``staging`` into ``pages`` of every layer pool, asynchronously."""
        return self._pages(self._native.submit_scatter, pools, pages, staging)

    def _pages(self, submit, pools, pages, staging) -> CopyHandle:
        view, pg = self._view(pools), np.asarray(pages, dtype=np.int64)
        self._check_staging(view, pg, staging)
        h = submit(list(view.layer_ptrs), view.page_stride_bytes, view.page_bytes, view.num_pages, pg,
                   staging.data_ptr())
        self._keepalive[h] = (tuple(pools), staging)
        return CopyHandle(self._native, self._keepalive, h, len(pg))

    def run_io(self, job) -> CopyHandle:
        """Run ``job`` (a :class:`kvtier.cache.seams.IOJob`) on the I/O workers, asynchronously;
        the job (and the buffers it holds) is kept alive until it is collected. Per-block results
        are the job's statuses."""
        h = job.submit_native(self._native_io)
        self._keepalive_io[h] = job
        return CopyHandle(self._native_io, self._keepalive_io, h, job.num_blocks)

    @property
    def queued(self) -> int:
        """Jobs waiting in both queues."""
        return self._native.queued() + self._native_io.queued()
