"""Shared helpers of the perf/ scripts that start OpenAI-compatible servers (vLLM, kvtier serve):
a free port, the server's process started in its own process group with its log in a file,
waited for on ``/health`` and stopped by its PID (:func:`timing.stop_process_group`)."""

from __future__ import annotations

import re
import socket
import subprocess
import time
from pathlib import Path

from timing import stop_process_group


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def failure_reason(log: Path) -> str:
    """The root cause a server logged (a vLLM worker's or engine's error, a Python exception),
    else the log's last lines."""
    text = log.read_text(errors="replace")
    found = re.findall(r"Worker failed with error '([^']+)'", text)
    if found:
        return found[-1]
    errors = [m for m in re.findall(r"\b(\w+(?:Error|Exception): .+)", text)
              if "Engine core initialization failed" not in m]
    return errors[-1].strip() if errors else text[-500:]


def wait_ready(proc: subprocess.Popen, port: int, log: Path, timeout_s: float) -> None:
    """Wait until ``GET /health`` on 127.0.0.1:``port`` answers 200.

    Raises:
        RuntimeError: the process exited first (with :func:`failure_reason`), or ``timeout_s``
            seconds passed (with the log's tail).
    """
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {failure_reason(log)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"server not ready after {timeout_s} s:\n{log.read_text(errors='replace')[-2000:]}")


class ServerProcess:
    """``cmd`` (listening on 127.0.0.1:``port``) for the ``with`` block: started in a process
    group of its own with ``env``, its output in ``log``, ready on ``/health`` within
    ``timeout_s`` seconds (``start_s`` says how long it took), stopped by PID on the way out."""

    def __init__(self, cmd: list[str], port: int, log: Path, env: dict, timeout_s: float):
        self.cmd, self.port, self.log, self.env, self.timeout_s = cmd, port, log, env, timeout_s
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.start_s = 0.0

    def __enter__(self):
        t0 = time.monotonic()
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        try:
            wait_ready(self.proc, self.port, self.log, self.timeout_s)
        except BaseException:
            stop_process_group(self.proc)
            raise
        self.start_s = time.monotonic() - t0
        return self

    def __exit__(self, *exc):
        stop_process_group(self.proc)
