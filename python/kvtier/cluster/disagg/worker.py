"""The prefill worker's engine thread: an :class:`EngineWorker` that, after every step, hands the
full blocks its prefill jobs computed to their :class:`~kvtier.cluster.disagg.transfer.Transfer`.

A prefill job is a turn run with ``max_tokens=1`` (the first token is sampled here and returned
to the router); its transfer starts when the job is accepted and ends when the job finishes (or
is aborted, or the engine fails). Export runs on the engine thread (a device-page gather, no
network); sending runs on the transfer's thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client import Counter, Gauge

from kvtier.cache.block_hash import block_hashes
from kvtier.cluster.disagg.transfer import Transfer, TransferReport
from kvtier.serve.api.jobs import Job
from kvtier.serve.api.worker import EngineWorker


@dataclass
class PrefillJob(Job):
    """A :class:`Job` whose computed blocks go to ``decode_url``; ``transfer`` is set once accepted."""

    decode_url: str = ""
    transfer: Transfer | None = None


class PrefillWorker(EngineWorker):
    """:class:`EngineWorker` of a ``--role prefill`` server.

    Args:
        transfer_timeout_s: limit of each call to a decode worker (its ``held`` query and each
            batch of blocks); a decode worker that does not answer in time gets no more blocks
            this turn and recomputes them.
        (others as :class:`EngineWorker`)
    """

    def __init__(self, engine, tokenizer, session_ttl_s: float = 600.0, metrics=None, *,
                 transfer_timeout_s: float = 5.0):
        super().__init__(engine, tokenizer, session_ttl_s, metrics)
        self.transfer_timeout_s = transfer_timeout_s
        self.client = httpx.Client(timeout=transfer_timeout_s)
        self._transfers: dict[int, tuple[PrefillJob, object]] = {}  # request id -> (job, live Sequence)

    def _submit(self, job: Job) -> None:
        super()._submit(job)
        if not isinstance(job, PrefillJob) or job.request_id is None or job.request_id not in self._jobs:
            return
        seq = self.engine.sequence(job.request_id)
        ps = self.engine.config.pool.page_size
        needed = (len(seq.prompt_token_ids) - 1) // ps  # the last token is never cached
        hashes = seq.block_hashes[:needed]  # hashed once, when the prompt was appended
        if len(hashes) < needed:
            hashes = block_hashes(seq.prompt_token_ids[:needed * ps], ps, None, self.engine.block_hash_salt + seq.kv.salt)
        job.transfer = Transfer(job.decode_url, hashes, self.engine.pool.layouts(), self.transfer_timeout_s,
                                self.client)
        job.transfer.start()
        self._transfers[job.request_id] = (job, seq)

    def _progress(self, finished: dict) -> None:
        for rid, (job, seq) in list(self._transfers.items()):
            gone = rid in finished or self.engine.sequence(rid) is None
            self._export(job.transfer, seq)
            if gone:
                self._export_resume_point(job.transfer)
                job.transfer.end()
                del self._transfers[rid]
        super()._progress(finished)

    def _export(self, t: Transfer, seq) -> None:
        """Offer the blocks ``seq`` completed since the last step (past those the decode worker holds)."""
        avail = min(len(t.hashes), seq.num_computed_tokens // self.engine.config.pool.page_size)
        start = t.exported if t.held is None else max(t.exported, min(t.held, avail))
        if avail > start:
            got = self.engine.pool.export_blocks(t.hashes[start:avail])
            if got is None:  # a block left the device: stop here, the decode side recomputes the rest
                avail = len(t.hashes)
            else:
                t.offer(start, *got)
        t.exported = max(t.exported, avail)

    def _export_resume_point(self, t: Transfer) -> None:
        """What the decode worker needs besides the blocks to resume after the prompt's last reusable
        block, where the pool kept it (saved at the end of the step that finished the prefill)."""
        for kind, payload in (self.engine.pool.export_resume_point(t.hashes[-1]) if t.hashes else {}).items():
            t.offer_value(kind, t.hashes[-1], payload)

    def _fail_all(self, message: str) -> None:
        for job, _ in self._transfers.values():
            job.transfer.end()
        self._transfers.clear()
        super()._fail_all(message)


class DisaggMetrics:
    """Transfer and import series of a worker, on its ``/metrics`` registry."""

    def __init__(self, registry, role: str):
        r = registry
        Gauge("kvtier_worker_role", "this worker's role (1 for its role)", ["role"], registry=r).labels(role).set(1)
        self.transfers = Counter("kvtier_kv_transfers", "turns whose KV was sent to a decode worker, by result",
                                 ["result"], registry=r)
        self.blocks = Counter("kvtier_kv_transfer_blocks", "blocks of prefilled prompts, by what became of them "
                              "(held: the decode worker had them; sent; lost: recomputed there)", ["result"], registry=r)
        self.bytes = Counter("kvtier_kv_transfer_bytes", "bytes sent to decode workers (headers included)", registry=r)
        self.full_bytes = Counter("kvtier_kv_transfer_full_prompt_bytes", "bytes sending every reusable block of "
                                  "each prompt would have moved", registry=r)
        self.seconds = Counter("kvtier_kv_transfer_seconds", "sending time: overlapped with prefill or exposed "
                               "after it", ["part"], registry=r)
        self.imported = Counter("kvtier_kv_import_blocks", "blocks received from prefill workers, by result",
                                ["result"], registry=r)
        self.import_bytes = Counter("kvtier_kv_import_bytes", "bytes received from prefill workers", registry=r)

    def observe_transfer(self, r: TransferReport) -> None:
        self.transfers.labels("failed" if r.failed else "ok").inc()
        self.blocks.labels("held").inc(max(r.blocks_held, 0))
        self.blocks.labels("sent").inc(r.blocks_sent)
        self.blocks.labels("lost").inc(r.blocks_lost)
        self.bytes.inc(r.bytes_sent)
        self.full_bytes.inc(r.full_prompt_bytes)
        self.seconds.labels("overlapped").inc(r.overlapped_s)
        self.seconds.labels("exposed").inc(r.exposed_s)

    def observe_import(self, counts: dict[str, int], nbytes: int) -> None:
        for k, v in counts.items():
            self.imported.labels(k).inc(v)
        self.import_bytes.inc(nbytes)
