"""``kvtier serve tiny-k3 --host-cache-bytes ...``: the hybrid KDA + MLA preset served over HTTP
with the tiered pool: a two-turn chat reuses turn 1's prefix on turn 2 (MLA blocks restored with
the recurrent-state checkpoint at the same boundary), and a repeated request gives the same
greedy reply from its cached prefix."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import TOKENIZER_DIR
from tests.serve.api.conftest import start_listening


@pytest.mark.slow  # a server process: model build, tokenizer and a first forward (~10 s on 2 cores)
def test_serve_tiny_k3_reuses_the_prefix_on_turn_two(tmp_path):
    if not (TOKENIZER_DIR / "tiktoken.model").is_file():
        pytest.skip(f"real Kimi tokenizer files not present at {TOKENIZER_DIR}")
    log = tmp_path / "server.log"
    proc, url = start_listening(["serve", "tiny-k3", "--tokenizer", str(TOKENIZER_DIR), "--host", "127.0.0.1",
                                 "--port", "0", "--num-device-pages", "64", "--max-num-seqs", "4",
                                 "--host-cache-bytes", str(16 << 20), "--state-checkpoint-tokens", "64"], log)
    try:
        assert url is not None, log.read_text()
        messages = [{"role": "user", "content": "Write a haiku about caches, then explain each line of it in "
                                                "one sentence, so that the prompt spans a few pages."}]
        body = {"model": "tiny-k3", "messages": messages, "max_tokens": 6, "temperature": 0}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        first = r.json()
        assert first["usage"]["completion_tokens"] == 6 and first["choices"][0]["finish_reason"] == "length"
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # turn 2: turn 1's prompt and reply, then a new message
        turn2 = {**body, "messages": [*messages, first["choices"][0]["message"],
                                      {"role": "user", "content": "Now shorter."}]}
        second = httpx.post(f"{url}/v1/chat/completions", json=turn2, timeout=120).json()
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert 16 <= cached < second["usage"]["prompt_tokens"], second["usage"]
        assert cached % 16 == 0  # whole pages, up to a boundary with a checkpoint
        # the same request again: its cached prefix restored exactly gives the same greedy reply
        again = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
        assert again["choices"][0]["message"] == first["choices"][0]["message"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
