"""``kvtier cluster``: store + 2 workers + router as processes; a session's second turn is served
from cache through the router; SIGTERM stops every process it started."""

import os
import re
import signal

import openai
import pytest

from tests.conftest import TOKENIZER_DIR
from tests.serve.api.conftest import pid_alive, start_listening
from tests.stores import redis_store  # noqa: F401  (skips when redis-server is missing)


def test_cluster_serves_and_stops_everything(tmp_path, redis_store):  # noqa: F811
    if not (TOKENIZER_DIR / "tiktoken.model").is_file():
        pytest.skip(f"real Kimi tokenizer files not present at {TOKENIZER_DIR}")
    log = tmp_path / "cluster.log"
    proc, url = start_listening(["cluster", "tiny", "--tokenizer", str(TOKENIZER_DIR), "--workers", "2", "--store",
                                 "redis", "--port", "0", "--host-cache-bytes", str(16 << 20), "--num-device-pages",
                                 "256"], log)
    try:
        text = log.read_text(errors="replace")
        assert url, text
        pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", text)]
        assert len(pids) == 3  # the store and two workers
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
        messages = [{"role": "user", "content": " ".join(["a long shared prefix"] * 60)}]
        first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3,
                                               extra_headers={"x-session-id": "c1"})
        again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3,
                                               extra_headers={"x-session-id": "c1"})
        assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 16 * 16 - 16
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(60)
    assert not [p for p in pids if pid_alive(p)]
