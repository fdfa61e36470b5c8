"""``kvtier cluster --prefill-workers 1 --decode-workers 1 --store none``: decode and prefill
workers and the P/D router as processes; a turn is prefilled, transferred and decoded; SIGTERM
stops every process it started."""

import json
import os
import re
import signal

import httpx
import pytest

from tests.conftest import TOKENIZER_DIR
from tests.serve.api.conftest import pid_alive, start_listening


def test_pd_cluster_serves_and_stops_everything(tmp_path):
    if not (TOKENIZER_DIR / "tiktoken.model").is_file():
        pytest.skip(f"real Kimi tokenizer files not present at {TOKENIZER_DIR}")
    log = tmp_path / "cluster.log"
    proc, url = start_listening(["cluster", "tiny", "--tokenizer", str(TOKENIZER_DIR), "--prefill-workers", "1",
                                 "--decode-workers", "1", "--store", "none", "--port", "0", "--num-device-pages", "256"],
                                log)
    pids = []
    try:
        text = log.read_text(errors="replace")
        assert url, text
        pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", text)]
        assert len(pids) == 2 and "decode http://" in text and "prefill http://" in text
        r = httpx.post(f"{url}/v1/chat/completions", timeout=300, headers={"x-session-id": "c1"},
                       json={"model": "tiny", "max_tokens": 3,
                             "messages": [{"role": "user", "content": " ".join(["a long shared prefix"] * 60)}]})
        assert r.status_code == 200, r.text
        report = json.loads(r.headers["x-kvtier-transfer"])
        assert not report["failed"] and report["blocks_sent"] == report["blocks_needed"] > 0
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == report["blocks_needed"] * 16
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(60)
    assert not [p for p in pids if pid_alive(p)]
