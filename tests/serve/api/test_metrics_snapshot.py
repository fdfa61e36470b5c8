"""``/metrics`` reads only the snapshot the engine thread published: once it is published, the
engine, its scheduler, its pool (and the pool's parts), the sessions and the worker's queues are
replaced by objects that fail on any use, and a scrape still answers, with the same engine, pool
and scheduler series, equal to the snapshot's values."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from kvtier.serve.api.worker import WorkerStats


class _Untouchable:
    """Fails on any attribute read, call, length, iteration or truth test, and records it."""

    def __init__(self, name: str, touched: list[str]):
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_touched", touched)

    def _fail(self, what: str):
        self._touched.append(f"{self._name}{what}")
        raise AssertionError(f"/metrics used {self._name}{what} after the snapshot was published")

    def __getattr__(self, attr):
        self._fail(f".{attr}")

    def __len__(self):
        self._fail(" (len)")

    def __iter__(self):
        self._fail(" (iter)")

    def __bool__(self):
        self._fail(" (bool)")

    def __call__(self, *a, **k):
        self._fail(" (call)")


def _samples(text: str) -> dict[tuple, float]:
    return {(s.name, *sorted(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _published(worker, after_steps: int, timeout_s: float = 30.0) -> WorkerStats:
    """The worker's snapshot once it counts at least ``after_steps`` steps and nothing in flight."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = worker.snapshot
        if s is not None and s.engine.steps >= after_steps and s.in_flight == 0 and not s.engine.scheduler.running:
            return s
        time.sleep(0.05)
    raise AssertionError(f"no snapshot after {after_steps} steps within {timeout_s} s: {worker.snapshot}")


def test_metrics_are_served_from_the_published_snapshot_alone(tok_dir):
    from fastapi.testclient import TestClient

    from kvtier.serve.api.server import make_app

    app = make_app("tiny", tokenizer=str(tok_dir), num_device_pages=64, page_size=16)
    worker = app.state.kvtier.worker
    engine = worker.engine
    pool, scheduler = engine.pool, engine.scheduler
    touched: list[str] = []
    with TestClient(app) as client:
        ask = {"model": "tiny", "messages": [{"role": "user", "content": "x " * 40}], "max_tokens": 3,
               "ignore_eos": True, "temperature": 0}
        for _ in range(2):  # the second turn's prompt blocks are device hits
            r = client.post("/v1/chat/completions", json=ask)
            assert r.status_code == 200, r.text
        snap = _published(worker, after_steps=engine.num_steps)
        before = _samples(client.get("/metrics").text)
        worker.shutdown()  # the engine thread ends: nothing publishes or steps from here on
        assert not worker.alive
        snap = worker.snapshot
        saved = []
        for owner, names in [(pool, ("tiers", "pages", "writes", "loads", "reuse", "prefetcher", "block_io")),
                             (engine, ("pool", "scheduler", "runner", "grammar", "_sequences")),
                             (scheduler, ("waiting", "loading", "running", "pool", "policy")),
                             (worker, ("engine", "sessions", "_jobs", "_inbox"))]:
            for name in names:
                saved.append((owner, name, owner.__dict__[name]))
                setattr(owner, name, _Untouchable(f"{type(owner).__name__}.{name}", touched))
        try:
            r = client.get("/metrics")
        finally:
            for owner, name, value in saved:  # the app's shutdown uses them
                setattr(owner, name, value)
        assert r.status_code == 200 and not touched, touched
        after = _samples(r.text)
    assert {k: v for k, v in after.items() if not k[0].startswith("kvtier_requests_")} == \
        {k: v for k, v in before.items() if not k[0].startswith("kvtier_requests_")}
    e, p = snap.engine, snap.engine.pool
    assert after[("kvtier_engine_steps_total",)] == e.steps > 0
    probe = app.state.kvtier.metrics.probe_prefill_tokens  # the start-up probe's, left out
    assert after[("kvtier_prefill_tokens_total",)] == e.prefill_tokens - probe > 0 and probe > 0
    assert after[("kvtier_device_pages_total",)] == p.num_pages == 64
    assert after[("kvtier_device_pages_used",)] == p.num_pages - p.num_free_pages
    assert after[("kvtier_requests_waiting",)] == e.scheduler.waiting == 0
    assert after[("kvtier_requests_running",)] == e.scheduler.running + e.scheduler.loading == 0
    assert after[("kvtier_hit_tokens_total", ("tier", "device"))] == p.hit_tokens["device"] > 0
    assert after[("kvtier_cached_blocks", ("tier", "device"))] == p.cached_blocks["device"] > 0
    assert after[("kvtier_sessions",)] == snap.sessions


def test_metrics_before_the_first_snapshot_has_no_engine_series():
    from kvtier.serve.api.metrics import ServerMetrics

    text = ServerMetrics(lambda: None).render().decode()
    assert "kvtier_request_finish" in text and "kvtier_engine_steps" not in text

