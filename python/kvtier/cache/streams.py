"""Streams and events of the device copy path, behind one small interface.

Every ordering rule of :class:`kvtier.cache.device_copy.DeviceCopyEngine` is written against
:class:`Streams`; only this module touches ``torch.cuda`` streams and events (ROCm's torch uses
the same ``torch.cuda`` names). :class:`CpuStreams` implements the same interface on the CPU, so
every other line of the GPU path runs in the CPU tests:

* ``CpuStreams()`` runs copy-stream work at once (synchronous);
* ``CpuStreams(deferred=True)`` queues it in order and runs it only when an event on it is
  waited for or :meth:`CpuStreams.run_pending` is called: an asynchronous copy stream whose
  progress the test controls (a copy "in flight" is one still queued).

Ordering contract (both implementations):

* ``record_compute()`` marks the compute work enqueued so far (the forward that wrote a page);
* ``on_copy(work, after)`` runs ``work`` (which enqueues copies) on the copy stream after the
  event ``after``; the returned :class:`CopySpan` completes when that work completed;
* ``compute_wait(span)`` orders compute work enqueued from now on after ``span`` (a request's
  forward after its load): on a GPU without blocking the host.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch

_WAIT_POLL_S = 50e-6  # poll interval of a timed wait on a GPU event


class CopySpan(Protocol):
    """Work enqueued on the copy stream."""

    error: BaseException | None
    """What the work raised when it ran (CPU deferred work only; a GPU enqueue error raises at once)."""

    def query(self) -> bool:
        """True once the work completed (or failed); never blocks."""
        ...

    def synchronize(self) -> None:
        """Block until the work completed."""
        ...

    def wait(self, timeout_s: float) -> bool:
        """Block until the work completed or ``timeout_s`` seconds passed; True if it completed."""
        ...

    def elapsed_s(self) -> float:
        """Seconds the work ran on its stream (0.0 before it completed)."""
        ...


class Streams(Protocol):
    """A compute stream and one copy stream of a device."""

    device: torch.device

    def record_compute(self) -> CopySpan | None:
        """A marker after the compute work enqueued so far (None where compute is synchronous)."""
        ...

    def on_copy(self, work: Callable[[], None], after: CopySpan | None = None) -> CopySpan:
        """Run ``work`` (it enqueues copies and kernels) on the copy stream after ``after``.

        Raises:
            whatever ``work`` raises while it is enqueued (on a GPU; deferred CPU work keeps its
            error on the returned span instead).
        """
        ...

    def compute_wait(self, span: CopySpan) -> None:
        """Order compute work enqueued from now on after ``span`` (never blocks on a GPU)."""
        ...


class _CudaSpan:
    """Two timing events around work on a CUDA/HIP stream."""

    error = None

    def __init__(self, start: torch.cuda.Event, end: torch.cuda.Event):
        self.start, self.end = start, end

    def query(self) -> bool:
        return self.end.query()

    def synchronize(self) -> None:
        self.end.synchronize()

    def wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.end.query():  # torch events have no timed wait: poll
            if time.monotonic() >= deadline:
                return False
            time.sleep(_WAIT_POLL_S)
        return True

    def elapsed_s(self) -> float:
        if self.start is self.end or not self.end.query():  # a compute marker, or not completed yet
            return 0.0
        return self.start.elapsed_time(self.end) / 1e3


class CudaStreams:
    """The current stream of ``device`` as the compute stream, plus a dedicated copy stream.

    Args:
        device: a ``cuda`` device (CUDA or ROCm).

    Raises:
        ValueError: ``device`` is not a usable ``cuda`` device.
    """

    def __init__(self, device: torch.device | str):
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            raise ValueError(f"CudaStreams needs a CUDA/ROCm device, got {device} "
                             f"(torch.cuda.is_available() = {torch.cuda.is_available()})")
        self.device = device
        self.copy_stream = torch.cuda.Stream(device)

    def record_compute(self) -> _CudaSpan:
        ev = torch.cuda.Event()  # an ordering marker only: no timing (cheaper to record and wait on)
        ev.record(torch.cuda.current_stream(self.device))
        return _CudaSpan(ev, ev)

    def on_copy(self, work: Callable[[], None], after: _CudaSpan | None = None) -> _CudaSpan:
        stream = self.copy_stream
        if after is not None:
            stream.wait_event(after.end)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        with torch.cuda.stream(stream):
            work()
        end.record(stream)
        return _CudaSpan(start, end)

    def compute_wait(self, span: _CudaSpan) -> None:
        torch.cuda.current_stream(self.device).wait_event(span.end)


class _CpuSpan:
    def __init__(self, streams: CpuStreams, seq: int):
        self._streams, self.seq = streams, seq
        self.completed, self.error, self.seconds = False, None, 0.0

    def query(self) -> bool:
        return self.completed

    def synchronize(self) -> None:
        self._streams.run_until(self)

    def wait(self, timeout_s: float) -> bool:
        self.synchronize()  # a CPU copy stream makes no progress of its own: waiting runs it
        return True

    def elapsed_s(self) -> float:
        return self.seconds


class CpuStreams:
    """:class:`Streams` on the CPU: compute is synchronous; copy work runs at once or, with
    ``deferred``, in submission order when waited for (see the module docstring).

    Attributes:
        log: ``("copy", seq)`` when copy work ``seq`` ran, ``("compute_wait", seq)`` when compute
            was ordered after it: the order tests check (e.g. a forward waited for its load).
    """

    device = torch.device("cpu")

    def __init__(self, deferred: bool = False):
        self.deferred = deferred
        self.pending: deque[tuple[Callable[[], None], _CpuSpan]] = deque()
        self.log: list[tuple[str, int]] = []
        self._seq = 0

    def record_compute(self) -> None:
        return None  # compute on the CPU is synchronous: everything enqueued has run

    def on_copy(self, work: Callable[[], None], after: _CpuSpan | None = None) -> _CpuSpan:
        if after is not None:
            after.synchronize()
        self._seq += 1
        span = _CpuSpan(self, self._seq)
        self.pending.append((work, span))
        if not self.deferred:
            self.run_until(span)
        return span

    def compute_wait(self, span: _CpuSpan) -> None:
        span.synchronize()
        self.log.append(("compute_wait", span.seq))

    def run_pending(self, n: int | None = None) -> int:
        """Run the first ``n`` queued copy works (None: all); returns how many ran."""
        ran = 0
        while self.pending and (n is None or ran < n):
            self._run_one()
            ran += 1
        return ran

    def run_until(self, span: _CpuSpan) -> None:
        while not span.completed:
            self._run_one()

    def _run_one(self) -> None:
        work, span = self.pending.popleft()
        t0 = time.perf_counter()
        try:
            work()
        except Exception as e:  # noqa: BLE001 - kept on the span, raised by the copy's handle
            span.error = e
        span.seconds = time.perf_counter() - t0
        span.completed = True
        self.log.append(("copy", span.seq))


def streams_for(device: torch.device | str) -> Streams:
    """:class:`CudaStreams` for a ``cuda`` device, synchronous :class:`CpuStreams` for the CPU."""
    device = torch.device(device)
    return CpuStreams() if device.type == "cpu" else CudaStreams(device)
