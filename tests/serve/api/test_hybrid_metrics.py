"""``/metrics`` of a hybrid model (``tiny-k3`` with a host tier): every counter of
``stats().pool.sections["state"]`` (recurrent-state checkpoint hits, bytes, saves, evictions, refusals,
failures, fallbacks, tokens lost) is a ``kvtier_state_*`` series with the published snapshot's
values, and a second turn's checkpoint hit shows there (a K2 model has none of these series:
tests/serve/api/test_usage_numbers.py)."""

from __future__ import annotations

import dataclasses

from kvtier.cache.checkpoints.index import StateStats
from kvtier.cache.pool_stats import series_table
from tests.serve.api.test_metrics_snapshot import _published, _samples


STATE_METRICS = series_table(StateStats)


def test_every_state_counter_has_a_metric():
    assert {f.name for f in dataclasses.fields(StateStats)} == set(STATE_METRICS)
    names = [name for name, _, _ in STATE_METRICS.values()]
    assert len(set(names)) == len(names) and all(n.startswith("kvtier_state_") for n in names)


def test_hybrid_metrics_have_the_pools_state_counters(tok_dir):
    import openai
    from fastapi.testclient import TestClient

    from kvtier.serve.api.server import make_app

    app = make_app("tiny-k3", tokenizer=str(tok_dir), num_device_pages=64, max_num_seqs=4,
                   host_cache_bytes=16 << 20, state_checkpoint_tokens=64)
    worker = app.state.kvtier.worker
    with TestClient(app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
        messages = [{"role": "user", "content": "Write a haiku about caches, then explain each line of it in one "
                                                "sentence, so that the prompt spans a few pages."}]
        first = client.chat.completions.create(model="tiny-k3", messages=messages, max_tokens=4, temperature=0)
        turn2 = [*messages, first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "Now shorter."}]
        second = client.chat.completions.create(model="tiny-k3", messages=turn2, max_tokens=4, temperature=0)
        assert second.usage.prompt_tokens_details.cached_tokens > 0  # restored with its checkpoint
        snap = _published(worker, after_steps=worker.engine.num_steps)
        m = _samples(http.get("/metrics").text)
    state = snap.engine.pool.sections["state"]
    assert state is not None
    for f in dataclasses.fields(StateStats):
        name, _, label = STATE_METRICS[f.name]
        value = getattr(state, f.name)
        if label is None:
            assert m[(f"{name}_total",)] == value, name
        else:
            got = {dict(k[1:])[label]: v for k, v in m.items() if k[0] == f"{name}_total"}
            assert got == value, (name, got, value)
    assert m[("kvtier_state_checkpoint_hits_total", ("tier", "device"))] >= 1
    assert m[("kvtier_state_checkpoints_saved_total", ("kind", "turn"))] >= 2
    assert m[("kvtier_state_checkpoint_bytes_written_total", ("tier", "host"))] > 0


def test_state_families_are_the_tables_in_field_order():
    from kvtier.serve.api.metrics import _section_families

    assert [f.name for f in _section_families(StateStats())] == [n for n, _, _ in STATE_METRICS.values()]
