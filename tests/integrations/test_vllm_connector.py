"""kvtier's connector in a real vLLM server (CPU): a session's second turn served from kvtier's host
tier, outputs equal to vLLM without the connector, corrupt disk blocks recomputed, disk blocks
surviving a restart, bad settings refused at start-up.

vLLM lives in its own interpreter (it pins its own torch): the test runs the server with the
Python named by ``KVTIER_VLLM_PYTHON`` (``scripts/setup_vllm.sh`` creates ``.vllm-venv`` with the
``[vllm]`` extra's pin; ``scripts/test.sh`` runs it and sets the variable); it is skipped with the
reason when that interpreter cannot import vllm. Servers listen on 127.0.0.1 and are stopped by PID.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHON = os.environ.get("KVTIER_VLLM_PYTHON", str(ROOT / ".vllm-venv" / "bin" / "python"))
BLOCK = 32


def _vllm_missing() -> str | None:
    if not Path(PYTHON).exists():
        return f"no vLLM interpreter at {PYTHON} (set KVTIER_VLLM_PYTHON, or run KVTIER_WITH_VLLM=1 scripts/setup.sh to create .vllm-venv)"
    r = subprocess.run([PYTHON, "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    return None if r.returncode == 0 else f"{PYTHON} cannot import vllm: {r.stderr.strip()[-300:]}"


_MISSING = _vllm_missing()
pytestmark = [pytest.mark.skip(reason=_MISSING)] if _MISSING else []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """vLLM's OpenAI server on a private port, with or without the kvtier connector."""

    def __init__(self, model: Path, workdir: Path, extra: dict | None, name: str):
        self.port = _free_port()
        self.log = workdir / f"{name}.log"
        args = [PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
                "--port", str(self.port), "--dtype", "float32", "--block-size", str(BLOCK),
                # a device KV cache of 10 blocks (320 tokens): smaller than the sessions' working set
                "--num-gpu-blocks-override", "10", "--max-model-len", "256", "--max-num-seqs", "1",
                "--enable-prompt-tokens-details", "--enforce-eager", "--seed", "0"]
        if extra is not None:
            args += ["--kv-transfer-config", json.dumps({
                "kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra})]
        env = {**os.environ, "PYTHONPATH": str(ROOT / "python"), "VLLM_CPU_KVCACHE_SPACE": "1"}
        self.proc = subprocess.Popen(args, stdout=open(self.log, "w"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vLLM exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise AssertionError(f"vLLM not ready after {timeout_s} s:\n{self.log.read_text()[-3000:]}")

    def complete(self, prompt: list[int], max_tokens: int = 8, **body) -> dict:
        import httpx

        r = httpx.post(f"http://127.0.0.1:{self.port}/v1/completions", timeout=300.0,
                       json={"model": self.proc.args[self.proc.args.index("--model") + 1], "prompt": prompt,
                             "max_tokens": max_tokens, "temperature": 0.0, "return_token_ids": True, **body})
        assert r.status_code == 200, r.text
        return r.json()

    def stop(self) -> None:
        """Stop the server's process group (by the PID it was started with)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("llama")
    subprocess.run([PYTHON, str(ROOT / "tests" / "integrations" / "vllm_checkpoint.py"), str(out)], check=True,
                   capture_output=True, timeout=600)
    return out


def _tokens(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def _run_sessions(server: Server) -> list[dict]:
    """Session A's first turn, two other sessions that push A's blocks out of the device cache, then
    A's second turn (A's first prompt, its answer and a new message)."""
    a1 = _tokens(1, 4 * BLOCK + 5)
    first = server.complete(a1, kv_transfer_params={"session_id": "a", "expected_tool_wait_s": 1.0})
    others = [server.complete(_tokens(s, 5 * BLOCK + 3)) for s in (2, 3)]
    a2 = a1 + first["choices"][0]["token_ids"] + _tokens(4, 10)
    second = server.complete(a2, kv_transfer_params={"session_id": "a"})
    return [first, *others, second]


def _answers(outs: list[dict]) -> list[list[int]]:
    return [o["choices"][0]["token_ids"] for o in outs]


def _cached(out: dict) -> int:
    return (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def _stats(path: Path) -> dict:
    return json.loads(path.read_text())


def test_second_turn_is_served_from_the_host_tier_and_matches_vllm_alone(model, tmp_path):
    stats = tmp_path / "stats.json"
    extra = {"host_cache_bytes": 8 << 20, "disk_cache_dir": str(tmp_path / "disk"), "disk_cache_bytes": 64 << 20,
             "stats_path": str(stats), "prefill_tok_s": 1.0}  # recomputing is slow: load whatever is held
    server = Server(model, tmp_path, extra, "kvtier")
    try:
        server.wait_ready()
        outs = _run_sessions(server)
    finally:
        server.stop()
    counters = _stats(stats)
    second = outs[-1]
    assert _cached(second) >= 4 * BLOCK, second["usage"]  # A's first prompt's full blocks
    assert counters["loaded"]["host"] >= 4 and counters["load_failures"] == {"host": 0, "disk": 0, "remote": 0}
    assert counters["saved_host"] > 0 and counters["written_disk"] > 0

    plain = Server(model, tmp_path, None, "plain")
    try:
        plain.wait_ready()
        alone = _run_sessions(plain)
    finally:
        plain.stop()
    assert _cached(alone[-1]) < _cached(second)  # vLLM alone lost A's blocks from its small cache
    assert _answers(outs) == _answers(alone)


@pytest.mark.slow
def test_a_restarted_server_serves_intact_disk_blocks(model, tmp_path):
    extra = {"host_cache_bytes": 8 << 20, "disk_cache_dir": str(tmp_path / "disk"), "disk_cache_bytes": 64 << 20,
             "stats_path": str(tmp_path / "stats.json"), "prefill_tok_s": 1.0}
    prompt = _tokens(5, 4 * BLOCK + 5)
    server = Server(model, tmp_path, extra, "first")
    try:
        server.wait_ready()
        want = server.complete(prompt)
    finally:
        server.stop()  # SIGTERM: the blocks written so far stay on disk
    assert len(list((tmp_path / "disk").glob("*/*.kvb"))) >= 4
    server = Server(model, tmp_path, {**extra, "stats_path": str(tmp_path / "stats2.json")}, "restarted")
    try:
        server.wait_ready()
        got = server.complete(prompt)
    finally:
        server.stop()
    assert _cached(got) >= 4 * BLOCK, got["usage"]
    counters = _stats(tmp_path / "stats2.json")
    assert counters["loaded"]["disk"] >= 4 and counters["load_failures"]["disk"] == 0
    assert _answers([got]) == _answers([want])


@pytest.mark.slow
def test_a_corrupt_disk_block_is_recomputed_not_served(model, tmp_path):
    stats = tmp_path / "stats.json"
    block_bytes = 2 * 2 * BLOCK * 64 * 4  # 2 layers x [2 KV heads, 32 tokens, K|V 2 x 32] fp32
    extra = {"host_cache_bytes": 4 * block_bytes, "disk_cache_dir": str(tmp_path / "disk"),
             "disk_cache_bytes": 64 << 20, "stats_path": str(stats), "prefill_tok_s": 1.0}
    prompt = _tokens(7, 4 * BLOCK + 5)
    server = Server(model, tmp_path, extra, "corrupt")
    try:
        server.wait_ready()
        want = server.complete(prompt)
        files = {f.name for f in (tmp_path / "disk").glob("*/*.kvb")}
        for s in (8, 9):  # push the prompt's blocks out of vLLM's cache and kvtier's 4-block host tier
            server.complete(_tokens(s, 5 * BLOCK + 3))
        for f in (tmp_path / "disk").glob("*/*.kvb"):
            if f.name in files:  # flip one payload bit of each of the prompt's blocks
                raw = bytearray(f.read_bytes())
                raw[4096 + 100] ^= 0x04
                f.write_bytes(bytes(raw))
        got = server.complete(prompt)
    finally:
        server.stop()
    assert len(files) == 4
    assert _answers([got]) == _answers([want])
    counters = _stats(stats)
    assert counters["load_failures"]["disk"] >= 1 and counters["loaded"]["disk"] == 0, counters


def _bad_extra(case: str, tmp_path: Path) -> dict:
    """A ``kv_connector_extra_config`` with one bad setting."""
    if case == "unknown key":
        return {"host_cache_byte": 1}
    if case == "wrong type":
        return {"disk_cache_bytes": "1G"}
    if case == "unwritable disk dir":
        (tmp_path / "a-file").write_text("not a directory")
        return {"disk_cache_dir": str(tmp_path / "a-file" / "disk"), "disk_cache_bytes": 1 << 20}
    return {"remote_cache_url": f"redis://127.0.0.1:{_free_port()}"}  # unreachable store: nobody listens there


@pytest.mark.parametrize("case, key", [
    ("unknown key", "host_cache_byte"),
    pytest.param("wrong type", "disk_cache_bytes", marks=pytest.mark.slow),
    pytest.param("unwritable disk dir", "disk_cache_dir", marks=pytest.mark.slow),
    pytest.param("unreachable store", "remote_cache_url", marks=pytest.mark.slow)])
def test_bad_settings_fail_at_start_up_naming_the_key(model, tmp_path, case, key):
    server = Server(model, tmp_path, _bad_extra(case, tmp_path), "bad")
    try:
        assert server.proc.wait(600) != 0
    finally:
        server.stop()
    assert f"kv_connector_extra_config['{key}']" in server.log.read_text()
