"""``kvtier serve tiny-k3``: the hybrid KDA + MLA preset served over HTTP answers a chat request
(device-only, no prefix reuse across requests; the start-up log says so)."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import TOKENIZER_DIR
from tests.serve.api.conftest import start_listening


@pytest.mark.slow  # a server process: model build, tokenizer and a first forward (~10 s on 2 cores)
def test_serve_tiny_k3_answers_a_chat_request(tmp_path):
    if not (TOKENIZER_DIR / "tiktoken.model").is_file():
        pytest.skip(f"real Kimi tokenizer files not present at {TOKENIZER_DIR}")
    log = tmp_path / "server.log"
    proc, url = start_listening(["serve", "tiny-k3", "--tokenizer", str(TOKENIZER_DIR), "--host", "127.0.0.1",
                                 "--port", "0", "--num-device-pages", "64", "--max-num-seqs", "4"], log)
    try:
        assert url is not None, log.read_text()
        body = {"model": "tiny-k3", "messages": [{"role": "user", "content": "Write a haiku about caches."}],
                "max_tokens": 6, "temperature": 0}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        data = r.json()
        assert data["usage"]["completion_tokens"] == 6 and data["choices"][0]["finish_reason"] == "length"
        assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        again = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
        assert again["choices"][0]["message"] == data["choices"][0]["message"]  # greedy, recomputed in full
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert "prefix caching is off" in log.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
