"""``kvtier cluster --launcher ray``: a Ray local cluster on 127.0.0.1 started in this process,
two ``kvtier serve`` workers placed by Ray (each run by an actor), the router, the Redis remote
tier. A multi-turn session is served through the router from cache; the other worker continues
it with the prefix read from the store (KV bytes through the store, not Ray); everything the
test started is stopped."""

import os
import time

import httpx
import openai
import pytest

from kvtier.cache.remote import StoreUnreachableError
from kvtier.cluster import StartupError
from kvtier.cluster.ray_launch import RAY_LOCAL_ENV, start_ray_cluster
from tests.conftest import TOKENIZER_DIR
from tests.serve.api.conftest import ROOT, descendants, pid_alive
from tests.stores import redis_store  # noqa: F401  (skips when redis-server is missing)

SYSTEM = " ".join(f"rule {i}: keep the build green and the tests honest." for i in range(40))


@pytest.fixture
def local_ray(monkeypatch):
    """Ray started here on 127.0.0.1 with 2 CPUs; yields this process's children before it."""
    if not (TOKENIZER_DIR / "tiktoken.model").is_file():
        pytest.skip(f"real Kimi tokenizer files not present at {TOKENIZER_DIR}")
    for k, v in RAY_LOCAL_ENV.items():  # read when ray is first imported: imported below
        monkeypatch.setenv(k, v)
    # Ray's workers (and the kvtier processes they start) inherit this environment.
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    import ray

    before = descendants()
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", object_store_memory=128 << 20,
             log_to_driver=False)
    try:
        yield before
    finally:
        ray.shutdown()


def _turn(url, messages, session, headers=None):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=messages, max_tokens=4, temperature=0.0, extra_headers={"x-session-id": session})
    return raw.headers.get("x-kvtier-worker"), raw.parse()


def test_ray_cluster_serves_a_session_through_the_store_and_stops_everything(local_ray, redis_store):  # noqa: F811
    cluster = start_ray_cluster(
        "tiny", workers=2, policy="kv-aware", store_url=redis_store.url, worker_cpus=1,
        worker_args=["--tokenizer", str(TOKENIZER_DIR), "--num-device-pages", "256", "--max-num-seqs", "2",
                     "--host-cache-bytes", str(16 << 20)])
    try:
        assert not cluster.owns_ray and cluster.store is None  # the caller's Ray and store
        assert [w["node_ip"] for w in cluster.workers] == ["127.0.0.1"] * 2
        assert len({w["pid"] for w in cluster.workers} | {cluster.router["pid"]}) == 3
        workers = {w["url"] for w in cluster.workers}
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Plan the change."}]
        first_url, first = _turn(cluster.router_url, messages, "ray-1")
        assert first_url in workers and first.usage.prompt_tokens > 160
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Now write it."}]
        second_url, second = _turn(cluster.router_url, messages, "ray-1")
        assert second_url == first_url  # kv-aware: the session's prefix is on that worker
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 16 * 16 - 16
        other = (workers - {first_url}).pop()
        _, moved = _turn(other, messages, "ray-1")  # the other Ray-placed worker: the prefix from the store
        assert moved.usage.model_extra["cached_tokens_by_tier"]["remote"] >= 160
        assert moved.choices[0].message.content == second.choices[0].message.content
        health = httpx.get(f"{cluster.router_url}/health", timeout=30).json()
        assert all(health["workers"][u]["healthy"] for u in workers)
    finally:
        cluster.stop()
    import ray

    assert not [p for p in [w["pid"] for w in cluster.workers] + [cluster.router["pid"]] if pid_alive(p)]
    ray.shutdown()
    deadline = time.monotonic() + 60
    while descendants() - local_ray and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not descendants() - local_ray  # Ray's own processes are gone too


def test_ray_cluster_names_an_unreachable_store_and_a_worker_that_cannot_start(local_ray):
    with pytest.raises(StoreUnreachableError, match="redis://127.0.0.1:1"):
        start_ray_cluster("tiny", workers=1, policy="sticky", store_url="redis://127.0.0.1:1", worker_args=[])
    with pytest.raises(StartupError, match="worker-0 on node 127.0.0.1.*no-such-model"):
        start_ray_cluster("no-such-model", workers=1, policy="sticky", store="none", worker_args=[])
    assert not _kvtier_processes(descendants() - local_ray)  # the failed start left no kvtier process


def _kvtier_processes(pids: set[int]) -> set[int]:
    """Those of ``pids`` that run kvtier's CLI (Ray's own helpers come and go; one that ended
    since ``pids`` was read is not left behind)."""
    out = set()
    for p in pids:
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"kvtier.cli" in cmd:
            out.add(p)
    return out
