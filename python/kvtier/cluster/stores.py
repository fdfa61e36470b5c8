"""Start a remote-tier store (Redis or a Mooncake master) on 127.0.0.1 as a process, stop it by PID."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvtier.cluster import StartupError

STORES = ("redis", "mooncake")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class StoreProcess:
    """A running store: ``url`` (a ``remote_cache_url``) and its process."""

    url: str
    proc: subprocess.Popen
    port: int

    def stop(self, sig: int = signal.SIGKILL) -> None:
        """Signal the store (SIGKILL by default: as a crash would) and reap it."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def store_binary(kind: str) -> str | None:
    """Path of the server binary of ``kind`` (``redis`` or ``mooncake``), None when not installed."""
    if kind == "redis":
        return shutil.which("redis-server")
    exe = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
    return exe if Path(exe).exists() else None


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise StartupError(f"{what} exited with {proc.returncode} at start-up")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    raise StartupError(f"{what} did not listen on 127.0.0.1:{port} within {timeout_s} s")


def start_store(kind: str, workdir: Path) -> StoreProcess:
    """Start a store of ``kind`` on a free loopback port, logging to ``workdir``.

    Raises:
        ValueError: an unknown kind; StartupError: the binary is missing or does not start.
    """
    if kind not in STORES:
        raise ValueError(f"store must be one of {list(STORES)}, got {kind!r}")
    exe = store_binary(kind)
    if exe is None:
        raise StartupError(f"the {kind} store is not installed (scripts/setup.sh installs redis-server and "
                           "the mooncake-transfer-engine-non-cuda wheel)")
    port = free_port()
    log = open(Path(workdir) / f"{kind}-{port}.log", "wb")
    if kind == "redis":
        cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--protected-mode", "yes", "--dir", str(workdir)]
        url = f"redis://127.0.0.1:{port}"
    else:
        http, metrics = free_port(), free_port()
        cmd = [exe, "--rpc_address=127.0.0.1", f"--rpc_port={port}", "--enable_http_metadata_server=true",
               "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={http}",
               "--metrics_host=127.0.0.1", f"--metrics_port={metrics}", "--rpc_thread_num=2",
               "--default_kv_lease_ttl=100"]
        url = f"mooncake://127.0.0.1:{port}?segment_mib=32&buffer_mib=16"
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
    log.close()
    _wait_port(port, proc, f"{kind} store ({exe})")
    return StoreProcess(url, proc, port)


def check_store_url(url: str, timeout_s: float = 5.0) -> str:
    """``url`` (a ``remote_cache_url``) once a client could join the store there and leave.

    Raises:
        ValueError: a malformed URL; StoreUnreachableError (a ConnectionError): nothing answers
            there (both name the URL).
    """
    from kvtier.cache.remote import open_backend

    open_backend(url, timeout_s).close()
    return url
