"""One turn's KV transfer from a prefill worker to a decode worker, on a thread of its own.

The engine thread hands the transfer batches of newly computed full blocks (after each prefill
chunk, :meth:`Transfer.offer`) and returns to the next chunk at once; the transfer's thread
first asks the decode worker which leading blocks it already holds (``POST /v1/kv/held``), then
sends every offered block at or past that point (``POST /v1/kv/blocks``), so sending overlaps
the following chunks. What the decode worker needs besides the blocks to resume at their end
(:meth:`kvtier.cache.pool.KVPool.export_resume_point`: a hybrid model's recurrent state) follows
them (``POST /v1/kv/<kind>``, :meth:`Transfer.offer_value`): without it they are of no use there. A failed or timed-out call ends sending for this turn: the blocks not
delivered are counted as ``lost`` and the decode worker recomputes them. Nothing here ever makes
the engine thread wait on the network.

Time accounting: ``overlapped_s`` is the sending time that fell before the prefill ended,
``exposed_s`` the time from the prefill's end to the last block delivered (what the turn waits
for after computing).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from kvtier.cache.disk_tier import BlockMeta
from kvtier.cluster.disagg.blocks import encode_values, value_bytes

_END = object()


@dataclass
class TransferReport:
    """What one turn's transfer did (JSON-ready via :meth:`to_dict`). Blocks are full KV pages
    of the prompt that a request can reuse (``(prompt_tokens - 1) // page_size``); bytes count
    wire values (64-byte header + payload)."""

    decode_url: str
    blocks_needed: int = 0
    blocks_held: int = -1  # leading blocks the decode worker already had (-1: it did not answer)
    blocks_sent: int = 0
    blocks_stored: int = 0  # the decode worker confirmed them registered (checked, complete)
    # Needed, not held, not confirmed: the decode side recomputes them (except values of a cut
    # batch that arrived complete before the cut: registered there, never confirmed here).
    blocks_lost: int = 0
    bytes_sent: int = 0
    full_prompt_bytes: int = 0  # what sending every needed block would move
    overlapped_s: float = 0.0
    exposed_s: float = 0.0
    values_sent: Counter = field(default_factory=Counter)  # values of other kinds sent, by kind
    values_stored: Counter = field(default_factory=Counter)  # ... that the decode worker kept
    failed: bool = False
    error: str | None = None

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass
class Transfer:
    """The sending side of one turn.

    Args:
        decode_url: the decode worker's base URL.
        hashes: the block hashes of the prompt's reusable full blocks, in order.
        layouts: the layout of each kind of object, by name (:meth:`kvtier.cache.pool.KVPool.layouts`;
            ``blocks`` the blocks').
        timeout_s: limit of each call to the decode worker.
        client: the httpx client to use (shared by a worker's transfers).
    """

    decode_url: str
    hashes: list[bytes]
    layouts: dict[str, BlockMeta]
    timeout_s: float
    client: httpx.Client
    exported: int = 0  # blocks offered so far (engine thread)
    held: int | None = None  # set by the transfer thread once the decode worker answered
    prefill_end: float | None = None
    report: TransferReport = field(init=False)

    def __post_init__(self):
        self.meta = self.layouts["blocks"]
        self.report = TransferReport(self.decode_url, blocks_needed=len(self.hashes),
                                     full_prompt_bytes=len(self.hashes) * value_bytes(self.meta))
        self._queue: queue.Queue = queue.Queue()
        self._sends: list[tuple[float, float]] = []
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-transfer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- engine thread ----------------------------------------------------------------------------
    def offer(self, start: int, hashes: list[bytes], payload) -> None:
        """Blocks ``start..start+len(hashes)`` (payloads back to back in ``payload``) are ready."""
        self._queue.put((start, hashes, payload))

    def offer_value(self, kind: str, key: bytes, payload) -> None:
        """A value of ``kind`` keyed ``key`` (the block it follows) is ready: sent after the blocks
        offered before it."""
        self._queue.put((kind, key, payload))

    def end(self, ok: bool = True) -> None:
        """No more blocks: the prefill ended (``ok``) or the rest cannot be exported."""
        self.prefill_end = time.perf_counter()
        self._queue.put(_END)

    # -- transfer thread --------------------------------------------------------------------------
    def _run(self) -> None:
        r = self.report
        try:
            self.held = self._ask_held()
            r.blocks_held = self.held
        except Exception as e:  # noqa: BLE001 - the decode worker is gone: it will recompute
            self._fail(e)
        while True:
            item = self._queue.get()
            if item is _END:
                break
            if r.failed:
                continue
            if isinstance(item[0], str):
                self._send_value(*item)
                continue
            start, hashes, payload = item
            self._send(start, hashes, payload)
        self._finish()

    def _ask_held(self) -> int:
        resp = self.client.post(f"{self.decode_url}/v1/kv/held", json={"block_hashes": [h.hex() for h in self.hashes]},
                                timeout=self.timeout_s)
        resp.raise_for_status()
        return min(int(resp.json()["held"]), len(self.hashes))

    def _send(self, start: int, hashes: list[bytes], payload) -> None:
        skip = max(0, self.held - start)
        if skip >= len(hashes):
            return
        n = self.meta.payload_bytes
        body = encode_values(hashes[skip:], payload[skip * n:], self.meta)
        stored = self._post("/v1/kv/blocks", body)
        if stored is None:  # cut, refused, timed out: stop sending, it recomputes
            return
        self.report.blocks_sent += len(hashes) - skip
        self.report.bytes_sent += len(body)
        self.report.blocks_stored += int(stored.get("stored", 0)) + int(stored.get("duplicate", 0))

    def _send_value(self, kind: str, key: bytes, payload) -> None:
        body = encode_values([key], payload, self.layouts[kind])
        stored = self._post(f"/v1/kv/{kind}", body)
        if stored is None:  # the decode worker recomputes the prompt then
            return
        self.report.values_sent[kind] += 1
        self.report.bytes_sent += len(body)
        self.report.values_stored[kind] += int(stored.get("stored", 0)) + int(stored.get("duplicate", 0))

    def _post(self, path: str, body: bytes) -> dict | None:
        """POST ``body`` (wire values) to the decode worker's ``path``; its JSON counts, or None
        when the call failed (the transfer is then marked failed and sends nothing more)."""
        t0 = time.perf_counter()
        try:
            resp = self.client.post(f"{self.decode_url}{path}", content=body, timeout=self.timeout_s,
                                    headers={"content-type": "application/octet-stream"})
            resp.raise_for_status()
            return resp.json()
        except Exception as e:  # noqa: BLE001 - cut, refused, timed out: the decode side recomputes
            self._fail(e)
            return None
        finally:
            self._sends.append((t0, time.perf_counter()))

    def _fail(self, e: Exception) -> None:
        self.report.failed = True
        self.report.error = f"{type(e).__name__}: {e}"

    def _finish(self) -> None:
        r = self.report
        held = max(r.blocks_held, 0)
        r.blocks_lost = max(0, r.blocks_needed - held - r.blocks_stored)
        end = self.prefill_end if self.prefill_end is not None else time.perf_counter()
        busy = sum(b - a for a, b in self._sends)
        last = max((b for _, b in self._sends), default=end)
        r.exposed_s = max(0.0, last - end)
        r.overlapped_s = max(0.0, busy - r.exposed_s)
        self.done.set()

    def wait(self, timeout_s: float) -> bool:
        """Block until the transfer ended (True) or ``timeout_s`` passed."""
        return self.done.wait(timeout_s)
