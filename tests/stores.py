"""Redis and Mooncake Store servers for tests: started on 127.0.0.1 free ports, stopped by PID.

Import the fixtures into a conftest (``from tests.stores import redis_store, mooncake_store``).
A fixture skips only when the server binary is not installed (``scripts/setup.sh`` installs
both); a server that is installed but does not start is an error.
"""

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

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Store:
    """A running store: its ``url`` (for ``remote_cache_url``) and process."""

    url: str
    proc: subprocess.Popen
    port: int

    def stop(self) -> None:
        """SIGKILL the server (as a crash would) and reap it."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} at start-up")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout_s} s")


def start_redis(log_dir: Path) -> Store:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (scripts/setup.sh installs it with apt-get)")
    port = free_port()
    log = open(log_dir / f"redis-{port}.log", "wb")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--protected-mode", "yes", "--dir", str(log_dir)], stdout=log, stderr=subprocess.STDOUT)
    _wait_port(port, proc, "redis-server")
    return Store(f"redis://127.0.0.1:{port}", proc, port)


def start_mooncake(log_dir: Path) -> Store:
    exe = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
    if not Path(exe).exists():
        pytest.skip("mooncake_master is not installed (pip install 'kvtier[remote]')")
    port, http, metrics = free_port(), free_port(), free_port()
    log = open(log_dir / f"mooncake-{port}.log", "wb")
    proc = subprocess.Popen([exe, "--rpc_address=127.0.0.1", f"--rpc_port={port}", "--enable_http_metadata_server=true",
                             "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={http}",
                             "--metrics_host=127.0.0.1", f"--metrics_port={metrics}", "--rpc_thread_num=2",
                             "--default_kv_lease_ttl=100"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=log_dir)
    _wait_port(port, proc, "mooncake_master")
    return Store(f"mooncake://127.0.0.1:{port}?segment_mib=32&buffer_mib=16", proc, port)


@pytest.fixture(scope="session")
def redis_store(tmp_path_factory):
    store = start_redis(tmp_path_factory.mktemp("redis"))
    yield store
    store.stop()


@pytest.fixture(scope="session")
def mooncake_store(tmp_path_factory):
    store = start_mooncake(tmp_path_factory.mktemp("mooncake"))
    yield store
    store.stop()


@pytest.fixture(params=["redis", "mooncake"])
def any_store(request):
    """Each backend in turn (the session's server)."""
    return request.getfixturevalue(f"{request.param}_store")
