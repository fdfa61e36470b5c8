"""A colocated worker, a decode worker, a prefill worker and a P/D router as processes on
127.0.0.1 (free ports), all stopped by PID; a proxy in front of the decode worker cuts or freezes
transfers on purpose, and a dead URL stands for a decode worker that is gone."""

from __future__ import annotations

import os
import signal

import pytest

from tests.cluster.disagg.helpers import free_dead_url
from tests.cluster.disagg.proxy import TransferProxy
from tests.serve.api.conftest import start_listening, start_server, stop_server

# Small prefill chunks (4 blocks of 16 tokens), so that a prompt's blocks go out in several batches.
WORKER_ARGS = ("--dtype", "float32", "--page-size", "16", "--num-device-pages", "512",
               "--max-num-batched-tokens", "64", "--max-num-seqs", "8")
TRANSFER_TIMEOUT_S = 3.0


@pytest.fixture(scope="package")
def pd(tmp_path_factory):
    """``{"colocated", "decode", "prefill"}`` servers, ``proxy`` (to the decode worker) and ``dead``."""
    started = {}
    proxy = None
    try:
        started["colocated"] = start_server(tmp_path_factory.mktemp("colocated"), *WORKER_ARGS)
        started["decode"] = start_server(tmp_path_factory.mktemp("decode"), *WORKER_ARGS, "--role", "decode",
                                         "--kv-events-endpoint", "tcp://127.0.0.1:0")
        proxy = TransferProxy(int(started["decode"].url.rsplit(":", 1)[1]))
        dead = free_dead_url()
        started["prefill"] = start_server(tmp_path_factory.mktemp("prefill"), *WORKER_ARGS, "--role", "prefill",
                                          "--decode-workers", f"{started['decode'].url},{proxy.url},{dead}",
                                          "--transfer-timeout-s", str(TRANSFER_TIMEOUT_S))
        yield {**started, "proxy": proxy, "dead": dead}
    finally:
        for s in started.values():
            stop_server(s)
        if proxy is not None:
            proxy.close()
    for name, s in started.items():
        log = s.log.read_text(errors="replace")
        assert "Traceback" not in log, f"{name}: {log[-3000:]}"


@pytest.fixture(scope="package")
def router(pd, tmp_path_factory):
    """``kvtier router --prefill-workers P --decode-workers D`` (its URL)."""
    log = tmp_path_factory.mktemp("router") / "router.log"
    proc, url = start_listening(["router", "--prefill-workers", pd["prefill"].url, "--decode-workers",
                                 pd["decode"].url, "--port", "0"], log, timeout_s=60)
    try:
        assert url, log.read_text(errors="replace")
        yield url
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(20)
