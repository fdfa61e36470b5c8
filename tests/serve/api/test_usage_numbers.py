"""What the numbers say: a request a stop string ends reports ``usage.kv_last_block`` and
``usage.engine_steps`` as any finished request does (chat and completions, streamed and not,
through the openai SDK), and ``kvtier_prefill_tokens_total`` counts the clients' prompt tokens
only, not the server's start-up probe."""

from __future__ import annotations

import pytest

from tests.serve.api.test_metrics_snapshot import _published, _samples

# Long enough for full pages of 16 tokens, so that the prompt has a last full block.
PROMPT = ("Explain what a tiered KV cache does for a coding agent whose session waits on tools, "
          "and why the prefix of each turn repeats the one before it.")


def _stop_inside(text: str) -> str:
    """A stop string taken from the middle of ``text`` (the greedy reply), so that the same
    request with it stops before ``max_tokens``."""
    assert len(text) >= 6, text
    return text[len(text) // 2:len(text) // 2 + 3]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_stopped_by_a_stop_string_has_kv_last_block_and_engine_steps(server, stream):
    client = server.client()
    ask = dict(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=12, temperature=0,
               extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**ask)
    assert full.choices[0].finish_reason == "length"
    whole = full.usage.model_extra
    assert whole["kv_last_block"] is not None and whole["engine_steps"] >= 12
    stop = _stop_inside(full.choices[0].message.content)
    if stream:
        chunks = list(client.chat.completions.create(**ask, stop=[stop], stream=True,
                                                     stream_options={"include_usage": True}))
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        usage = chunks[-1].usage
    else:
        r = client.chat.completions.create(**ask, stop=[stop])
        finish, usage = [r.choices[0].finish_reason], r.usage
    assert finish == ["stop"]
    assert usage.completion_tokens < 12
    extra = usage.model_extra
    assert extra["kv_last_block"] == whole["kv_last_block"]  # the same prompt: its last full block
    assert isinstance(extra["engine_steps"], int) and 1 <= extra["engine_steps"] < whole["engine_steps"]


def test_completion_stopped_by_a_stop_string_has_kv_last_block_and_engine_steps(server):
    client = server.client()
    ask = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**ask)
    stop = _stop_inside(full.choices[0].text)
    r = client.completions.create(**ask, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    assert r.usage.model_extra["kv_last_block"] == full.usage.model_extra["kv_last_block"] is not None
    assert 1 <= r.usage.model_extra["engine_steps"] < full.usage.model_extra["engine_steps"]


def test_prefill_tokens_exclude_the_start_up_probe(tok_dir):
    """A fresh server: after two chat turns, ``kvtier_prefill_tokens_total`` is the prompt tokens
    the two requests did not find cached, while the engine itself also counts the probe's."""
    import openai
    from fastapi.testclient import TestClient

    from kvtier.serve.api.server import make_app

    app = make_app("tiny", tokenizer=str(tok_dir), num_device_pages=64, page_size=16)
    worker = app.state.kvtier.worker
    with TestClient(app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
        _published(worker, after_steps=0)  # the engine thread's first snapshot
        before = _samples(http.get("/metrics").text)
        assert before[("kvtier_prefill_tokens_total",)] == 0  # the probe ran, and is not counted
        computed = 0
        for _ in range(2):  # the second turn finds the first one's pages
            r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                               max_tokens=2, temperature=0)
            computed += r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens
        assert r.usage.prompt_tokens_details.cached_tokens > 0
        snap = _published(worker, after_steps=worker.engine.num_steps)
        after = _samples(http.get("/metrics").text)
    assert after[("kvtier_prefill_tokens_total",)] == computed > 0
    assert not [k for k in after if k[0].startswith("kvtier_state_")]  # K2: no recurrent-state series
    assert snap.engine.prefill_tokens > computed  # the engine's own count has the probe's tokens too
