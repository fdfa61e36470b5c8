"""Two ``kvtier serve`` workers on one Redis remote tier, publishing KV events: a conversation
worker A served continues on a fresh worker B from the remote tier, and A's events show it."""

import httpx
import pytest

from kvtier.cache.kv_events import KVEventSubscriber
from tests.serve.api.conftest import start_server, stop_server
from tests.stores import redis_store  # noqa: F401

LONG = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(40))


@pytest.fixture(scope="module")
def workers(tmp_path_factory, redis_store):  # noqa: F811
    args = ("--num-device-pages", "256", "--host-cache-bytes", str(16 << 20), "--remote-cache-url", redis_store.url,
            "--kv-events-endpoint", "tcp://127.0.0.1:0")
    a = start_server(tmp_path_factory.mktemp("a"), *args)
    try:
        b = start_server(tmp_path_factory.mktemp("b"), *args)
    except Exception:
        stop_server(a)
        raise
    yield a, b
    stop_server(a)
    stop_server(b)


def test_turn_moves_to_a_fresh_worker_and_loads_from_the_remote_tier(workers):
    a, b = workers
    endpoint = httpx.get(f"{a.url}/health", timeout=10).json()["kv_events"]
    sub = KVEventSubscriber([endpoint])
    messages = [{"role": "system", "content": LONG}, {"role": "user", "content": "Summarise the lines."}]
    first = a.client().chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0.0)
    assert first.usage.prompt_tokens > 160
    moved = b.client().chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0.0)
    by_tier = moved.usage.model_extra["cached_tokens_by_tier"]
    assert by_tier["remote"] >= 160 and by_tier["remote"] == moved.usage.prompt_tokens_details.cached_tokens
    assert moved.choices[0].message.content == first.choices[0].message.content
    metrics = b.metrics()
    assert metrics[("kvtier_hit_tokens_total", ("tier", "remote"))] >= 160
    again = a.client().chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0.0)
    sub.poll(2.0)
    while sub.poll(0.5):
        pass
    assert sub.view.blocks(endpoint, "device")  # at least the third request's blocks were seen stored
    assert again.usage.prompt_tokens_details.cached_tokens >= 160
    sub.close()
