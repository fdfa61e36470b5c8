"""Two ``kvtier serve`` workers on one Redis remote tier, publishing KV events: a conversation
worker A served continues on a fresh worker B from the remote tier, and A's events show it; a
``kvtier router`` in front keeps a session where its cache is, moves it when that worker is
overloaded (the prefix then comes from the remote tier), and routes around a worker killed
mid-run (its sessions continue elsewhere from the remote tier); a worker whose store is killed
mid-run answers every request correctly and keeps serving; unreachable stores and workers are
start-up errors naming them."""

import os
import signal
import threading
import time

import httpx
import openai
import pytest

from kvtier.cache.kv_events import KVEventSubscriber
from kvtier.cli import main
from tests.conftest import TOKENIZER_DIR
from tests.serve.api.conftest import start_listening, start_server, stop_server
from tests.stores import redis_store, start_redis  # noqa: F401

LONG = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(40))


@pytest.fixture(scope="module")
def workers(tmp_path_factory, redis_store):  # noqa: F811
    args = ("--num-device-pages", "256", "--max-num-seqs", "1", "--host-cache-bytes", str(16 << 20), "--remote-cache-url", redis_store.url,
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
    assert metrics[("kvtier_remote_gets_total", ("status", "ok"))] >= 160 // 16
    again = a.client().chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0.0)
    sub.poll(2.0)
    while sub.poll(0.5):
        pass
    assert sub.view.blocks(endpoint, "device")  # at least the third request's blocks were seen stored
    assert again.usage.prompt_tokens_details.cached_tokens >= 160
    sub.close()


@pytest.fixture(scope="module")
def router(workers, tmp_path_factory):
    log = tmp_path_factory.mktemp("router") / "router.log"
    proc, url = start_listening(["router", "--workers", ",".join(w.url for w in workers), "--policy", "kv-aware",
                                 "--remote", "--port", "0"], log, timeout_s=60)
    assert url, log.read_text(errors="replace")
    yield url
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(20)


def _turn(router_url, messages, session):
    client = openai.OpenAI(base_url=f"{router_url}/v1", api_key="none", max_retries=0, timeout=300)
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=4,
                                                           temperature=0.0, extra_headers={"x-session-id": session})
    return raw.headers["x-kvtier-worker"], raw.parse()


def test_router_keeps_moves_and_reroutes_a_session(workers, router):
    by_url = {w.url: w for w in workers}
    messages = [{"role": "system", "content": LONG.replace("fox", "cat")}, {"role": "user", "content": "Go."}]
    first_url, r1 = _turn(router, messages, "s1")
    messages += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "More."}]
    second_url, r2 = _turn(router, messages, "s1")
    assert second_url == first_url  # kv-aware: the prefix is on that worker
    assert r2.usage.model_extra["cached_tokens_by_tier"]["device"] >= 160
    assert len(bytes.fromhex(r2.usage.model_extra["kv_last_block"])) == 16  # what the router looks up in events
    busy = by_url[first_url]
    flood = [threading.Thread(target=lambda i=i: busy.client().completions.create(
        model="tiny", prompt=f"busy {i}", max_tokens=150, temperature=0.0, extra_body={"ignore_eos": True}))
        for i in range(6)]
    for t in flood:
        t.start()
    deadline = time.monotonic() + 60
    while httpx.get(f"{router}/health").json()["workers"][first_url]["waiting"] < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    messages += [{"role": "assistant", "content": r2.choices[0].message.content}, {"role": "user", "content": "Again."}]
    third_url, r3 = _turn(router, messages, "s1")
    assert third_url != first_url  # overloaded: the turn moves
    assert r3.usage.model_extra["cached_tokens_by_tier"]["remote"] >= 160
    moved_to = by_url[third_url]
    assert moved_to.metrics()[("kvtier_hit_tokens_total", ("tier", "remote"))] >= 160  # hits counted by tier
    other = [{"role": "system", "content": LONG.replace("fox", "owl")}, {"role": "user", "content": "Go."}]
    puts_before = _puts(moved_to)
    only_url, o1 = _turn(router, other, "s2")  # a new session while A is still overloaded: it runs on B only
    assert only_url == third_url
    for t in flood:
        t.join()
    _written(moved_to, puts_before + o1.usage.prompt_tokens // 16)
    os.kill(moved_to.proc.pid, signal.SIGKILL)  # the worker holding both sessions dies
    moved_to.proc.wait(10)
    messages += [{"role": "assistant", "content": r3.choices[0].message.content}, {"role": "user", "content": "End."}]
    fourth_url, r4 = _turn(router, messages, "s1")
    assert fourth_url == first_url and r4.choices[0].message.content is not None
    other += [{"role": "assistant", "content": o1.choices[0].message.content}, {"role": "user", "content": "More."}]
    o2_url, o2 = _turn(router, other, "s2")
    assert o2_url == first_url  # served elsewhere, its prefix from the remote tier
    assert o2.usage.model_extra["cached_tokens_by_tier"]["remote"] >= 160
    health = httpx.get(f"{router}/health").json()
    assert health["workers"][third_url]["healthy"] is False
    assert health["session_moves"] == 3  # s1 to B and back to A, s2 from B to A


def _puts(worker) -> float:
    return worker.metrics().get(("kvtier_remote_puts_total", ("status", "ok")), 0)


def _written(worker, blocks: float, timeout_s: float = 60) -> None:
    """Wait until ``worker`` has written ``blocks`` blocks to the remote tier in all (its
    write-through runs in the background after a response)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _puts(worker) >= blocks:
            return
        time.sleep(0.2)
    raise AssertionError(f"{worker.url} did not write {blocks} blocks to the remote tier: {worker.metrics()}")


def test_router_names_unreachable_workers(capsys):
    assert main(["router", "--workers", "http://127.0.0.1:1", "--port", "0"]) == 2
    assert "http://127.0.0.1:1" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["cluster", "tiny", "--store-url", "redis://127.0.0.1:1", "--port", "0"],
                                  ["cluster", "tiny", "--launcher", "ray", "--store-url", "redis://127.0.0.1:1"],
                                  ["serve", "tiny", "--tokenizer", str(TOKENIZER_DIR), "--port", "0",
                                   "--host-cache-bytes", str(1 << 20), "--remote-cache-url", "redis://127.0.0.1:1"]],
                         ids=["cluster", "cluster-ray", "serve"])
def test_unreachable_store_is_a_start_up_error_naming_it(argv, capsys):
    if not (TOKENIZER_DIR / "tiktoken.model").is_file():
        pytest.skip(f"real Kimi tokenizer files not present at {TOKENIZER_DIR}")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "redis://127.0.0.1:1" in err and "Traceback" not in err


def test_store_killed_mid_run_the_worker_answers_every_request_and_keeps_serving(tmp_path):
    store = start_redis(tmp_path)
    worker = start_server(tmp_path, "--num-device-pages", "256", "--max-num-seqs", "2", "--host-cache-bytes",
                          str(16 << 20), "--remote-cache-url", store.url, "--remote-timeout-s", "0.5")
    try:
        messages = [{"role": "system", "content": LONG.replace("fox", "eel")}, {"role": "user", "content": "Go."}]
        before = worker.client().chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0.0)
        answers = []
        in_flight = [threading.Thread(target=lambda i=i: answers.append(worker.client().completions.create(
            model="tiny", prompt=f"{LONG} {i}", max_tokens=24, temperature=0.0, extra_body={"ignore_eos": True})))
            for i in range(4)]
        for t in in_flight:
            t.start()
        store.stop()  # SIGKILL while the worker prefills and writes blocks through to it
        for t in in_flight:
            t.join()
        assert [a.usage.completion_tokens for a in answers] == [24] * 4
        after = worker.client().chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0.0)
        assert after.choices[0].message.content == before.choices[0].message.content
        fresh = worker.client().completions.create(model="tiny", prompt=LONG.replace("dog", "yak"), max_tokens=4,
                                                   temperature=0.0, extra_body={"ignore_eos": True})
        assert fresh.usage.completion_tokens == 4  # a new prefix: the dead store is asked, or left alone
        metrics = worker.metrics()
        assert metrics[("kvtier_remote_lookup_failures_total",)] >= 1  # counted, not raised
        assert metrics[("kvtier_engine_errors_total",)] == 0
    finally:
        stop_server(worker)
        store.stop()
