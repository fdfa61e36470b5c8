"""``kvtier serve tiny`` started as a subprocess on 127.0.0.1 (a free port the server picks and
prints), shared by the tests of this folder and stopped by its PID."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvtier.cluster.launch import WorkerProcess, wait_worker
from tests.conftest import TOKENIZER_DIR

ROOT = Path(__file__).resolve().parents[3]
START_TIMEOUT_S = 180


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=120, **kw)

    def async_client(self, **kw):
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=300, **kw)

    def metrics(self) -> dict[tuple, float]:
        """``/metrics`` parsed with prometheus_client's text parser: ``{(name, labels...): value}``."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for fam in text_string_to_metric_families(httpx.get(f"{self.url}/metrics", timeout=30).text):
            for s in fam.samples:
                out[(s.name, *sorted(s.labels.items()))] = s.value
        return out

    def pages_used(self) -> float:
        return self.metrics()[("kvtier_device_pages_used",)]

    def wait_pages_free(self, timeout_s: float = 60) -> float:
        """Device pages in use once nothing runs (the engine thread publishes every 0.2 s)."""
        deadline = time.monotonic() + timeout_s
        used = self.pages_used()
        while used and time.monotonic() < deadline:
            time.sleep(0.3)
            used = self.pages_used()
        return used


def start_server(tmp_path: Path, *args: str, model: str = "tiny") -> Server:
    """Start ``kvtier serve MODEL --port 0 ARGS`` and wait until ``/health`` answers."""
    if not (TOKENIZER_DIR / "tiktoken.model").is_file():
        pytest.skip(f"real Kimi tokenizer files not present at {TOKENIZER_DIR}")
    log = tmp_path / "server.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "kvtier.cli", "serve", model, "--tokenizer", str(TOKENIZER_DIR),
           "--host", "127.0.0.1", "--port", "0", *args]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        worker = wait_worker(proc, log, START_TIMEOUT_S)
    except RuntimeError as e:
        raise RuntimeError(f"kvtier serve did not start: {e}") from None
    return Server(proc, worker.url, log)


def start_listening(argv: list[str], log: Path, timeout_s: float = 300) -> tuple[subprocess.Popen, str | None]:
    """Start ``python -m kvtier.cli ARGV`` (output to ``log``) and wait for its ``listening on URL``
    line; returns the process (the caller stops it) and the URL, None if it exited or timed out."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli", *argv], stdout=f, stderr=subprocess.STDOUT,
                                env=env, cwd=ROOT)
    url, deadline = None, time.monotonic() + timeout_s
    while url is None and time.monotonic() < deadline and proc.poll() is None:
        m = re.search(rb"listening on (http://127\.0\.0\.1:\d+)", log.read_bytes())
        url = m.group(1).decode() if m else time.sleep(0.1)
    return proc, url


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def descendants(pid: int | None = None) -> set[int]:
    """PIDs of every live process below ``pid`` (default: this one), from ``/proc``."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parent[int(d)] = int(fields[1])
    out, frontier = set(), {os.getpid() if pid is None else pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - out
        out |= frontier
    return out


def stop_server(server: Server) -> None:
    """SIGTERM, then SIGKILL after 20 s (by PID), as ``kvtier cluster`` stops its workers."""
    WorkerProcess(server.url, server.proc, server.log).stop()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """A server with room for the load test: 64 requests at once, 1024 device pages of 16 tokens."""
    s = start_server(tmp_path_factory.mktemp("serve"), "--num-device-pages", "1024", "--max-num-seqs", "64",
                     "--max-queue", "512", "--session-ttl-s", "600")
    yield s
    stop_server(s)
    assert "Traceback" not in s.log.read_text(errors="replace"), s.log.read_text(errors="replace")[-3000:]


@contextmanager
def in_process_k3(tok_dir: Path, tmp_path_factory, name: str, **engine: int):
    """``(app, openai client, anthropic client, HTTP client)`` of a ``tiny-k3`` checkpoint made with
    K3's tokenizer files (``create-checkpoint --preset tiny-k3 --tokenizer tok_dir``, float32) and
    served in-process as model ``k3``; ``engine``: ``make_app``'s engine sizes."""
    import anthropic
    import openai
    from fastapi.testclient import TestClient

    from kvtier.cli import main
    from kvtier.serve.api.server import make_app

    ck = tmp_path_factory.mktemp(name) / "ck"
    assert main(["create-checkpoint", str(ck), "--preset", "tiny-k3", "--dtype", "float32",
                 "--tokenizer", str(tok_dir)]) == 0
    app = make_app(str(ck), tokenizer=None, served_model_name="k3", **engine)
    with TestClient(app) as http:
        yield (app,
               openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0),
               anthropic.Anthropic(base_url="http://testserver", api_key="none", http_client=http, max_retries=0),
               http)
