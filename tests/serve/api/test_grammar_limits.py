"""One request must never freeze the server: the probe (a tool needing a million-item array,
tool_choice required, max_tokens 16) and every pathological schema end within their own
max_tokens while a small request started during them is answered in a few engine steps; a
schema llguidance refuses, or a ``pattern`` over the size limit (the issue's
``^(a{1000}){1000}$``, refused before compiling while small requests step and /health answers),
is a 400 naming its keyword; ``/health`` turns 503 while the engine thread is stalled on purpose
and 200 after; through ``kvtier router`` a worker busy with an expensive request leaves the other
serving. Bounds are engine steps (``usage.engine_steps``, ``kvtier_engine_steps_total``), never
wall-clock time."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.conftest import TOKENIZER_DIR
from tests.serve.api.conftest import start_listening, start_server, stop_server
from tests.toolcall.conftest import UNGENERABLE_TOOL
from tests.toolcall.pathological import PATHOLOGICAL, REFUSED

ASK = [{"role": "user", "content": "call the tool"}]
BASE = "tools[0].function.parameters"
MAX_TOKENS = 16
SMALL_STEPS = 4  # a max_tokens=2 request arriving mid-run: its prefill step, a decode, and slack of two
PREFILL_STEPS = 2


def _steps(server) -> float:
    return server.metrics()[("kvtier_engine_steps_total",)]


async def _beside_small(client, tool, max_tokens: int = MAX_TOKENS):
    """Stream a required-tool request; once it is running, send a plain max_tokens=2 request and
    wait for it; then read the rest. Returns (small completion, finish_reason, usage, error)."""
    stream = await client.chat.completions.create(
        model="tiny", messages=ASK, tools=[tool], tool_choice="required", max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True})
    chunks = [await stream.__anext__()]  # accepted: it is in the engine
    small = await client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2,
                                                 extra_body={"ignore_eos": True})
    error = None
    try:
        async for c in stream:
            chunks.append(c)
    except openai.APIError as e:  # an error event ends the stream
        error = e
    finish = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    usage = next((c.usage for c in chunks if c.usage is not None), None)
    return small, (finish or [None])[-1], usage, error


@pytest.mark.parametrize("name", sorted(PATHOLOGICAL))
def test_a_pathological_schema_ends_within_max_tokens_while_a_small_request_is_served(server, name):
    async def main():
        client = server.async_client()
        try:
            return await _beside_small(client, PATHOLOGICAL[name])
        finally:
            await client.close()

    before = _steps(server)
    small, finish, usage, error = asyncio.run(main())
    assert small.usage.completion_tokens == 2 and small.choices[0].finish_reason == "length"
    assert small.usage.model_extra["engine_steps"] <= SMALL_STEPS
    if error is not None:  # only a grammar limit may end it early
        assert "mask_deadline_s" in str(error), error
    else:
        assert finish == "length" and usage.completion_tokens == MAX_TOKENS
        assert usage.model_extra["engine_steps"] <= MAX_TOKENS + PREFILL_STEPS
    time.sleep(0.5)  # the engine counters are published every 0.2 s
    assert _steps(server) >= before + 2  # the step counter went on advancing


def test_the_probe_is_answered_within_its_own_budget(server):
    """The issue's probe, non-streaming: a 400 naming minItems or a length finish at max_tokens."""
    client = server.client()
    try:
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=[PATHOLOGICAL["min_items"]],
                                           tool_choice="required", max_tokens=MAX_TOKENS)
    except openai.BadRequestError as e:
        assert "minItems" in str(e), e
        return
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == MAX_TOKENS
    assert r.usage.model_extra["engine_steps"] <= MAX_TOKENS + PREFILL_STEPS
    assert [p["kind"] for p in r.choices[0].model_extra["tool_call_problems"]] == ["incomplete"]


def test_the_pattern_probe_is_a_400_naming_its_path_while_small_requests_step_and_health_answers(server):
    """The issue's probe (``^(a{1000}){1000}$`` in a required property, tool_choice required) sent
    together with two max_tokens=2 requests and /health polls: it is refused before compiling, the
    small requests finish in a few engine steps, and /health answers 200 throughout."""
    probe_tool, where = REFUSED["repeated_group_probe"]

    async def main():
        async with httpx.AsyncClient(timeout=120) as http:
            probe = http.post(f"{server.url}/v1/chat/completions", json={
                "model": "tiny", "messages": ASK, "tools": [probe_tool], "tool_choice": "required",
                "max_tokens": MAX_TOKENS})
            smalls = [http.post(f"{server.url}/v1/chat/completions", json={
                "model": "tiny", "messages": ASK, "max_tokens": 2, "ignore_eos": True}) for _ in range(2)]
            healths = [http.get(f"{server.url}/health") for _ in range(4)]
            return await asyncio.gather(probe, *smalls, *healths)

    time.sleep(0.5)
    before = server.metrics()
    probe, *rest = asyncio.run(main())
    smalls, healths = rest[:2], rest[2:]
    err = probe.json()["error"]
    assert probe.status_code == 400 and err["param"] == BASE + where, probe.text
    assert "max_pattern_size=" in err["message"]
    for r in smalls:
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["completion_tokens"] == 2 and usage["engine_steps"] <= SMALL_STEPS
    assert [h.status_code for h in healths] == [200] * len(healths)
    time.sleep(0.5)  # the engine counters are published every 0.2 s
    after = server.metrics()
    cut = ("kvtier_grammar_requests_cut_total", ("limit", "compile"))
    assert after[cut] == before.get(cut, 0) + 1  # refused at the limit, counted once
    assert after[("kvtier_engine_steps_total",)] >= before[("kvtier_engine_steps_total",)] + 2


@pytest.mark.parametrize("name", sorted(REFUSED) + ["ungenerable"])
def test_a_refused_schema_is_a_400_naming_the_tool_and_keyword(server, name):
    tool, where = REFUSED[name] if name in REFUSED else (UNGENERABLE_TOOL, ".properties.s.minLength")
    body = {"model": "tiny", "messages": ASK, "tools": [tool], "tool_choice": "required", "max_tokens": 4}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == BASE + where, r.text
    assert err["message"].startswith(f"{BASE}{where}: the tool grammar does not compile: "), err


def test_grammar_metrics_count_compiles_masks_and_refusals(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": ASK, "tools": [REFUSED["length_and_pattern"][0]], "max_tokens": 2})
    assert r.status_code == 400
    ok = server.client().chat.completions.create(model="tiny", messages=ASK, tools=[PATHOLOGICAL["min_length"]],
                                                 max_tokens=3)
    assert ok.usage.completion_tokens <= 3
    time.sleep(0.5)
    m = server.metrics()
    assert m[("kvtier_grammar_compiles_total", ("result", "ok"))] >= 1
    assert m[("kvtier_grammar_compiles_total", ("result", "error"))] >= 1
    assert m[("kvtier_grammar_compile_seconds_total",)] > 0
    assert m[("kvtier_grammar_masks_total",)] >= 1 and m[("kvtier_grammar_mask_seconds_total",)] > 0
    assert m[("kvtier_grammar_requests_cut_total", ("limit", "compile"))] >= 1
    assert ("kvtier_grammar_requests_cut_total", ("limit", "deadline")) in m
    assert ("kvtier_grammar_closing_out_of_fuel_total",) in m


def _poll(url: str, status: int, limit_s: float = 60.0) -> httpx.Response:
    deadline = time.monotonic() + limit_s
    r = httpx.get(url, timeout=10)
    while r.status_code != status and time.monotonic() < deadline:
        time.sleep(0.05)
        r = httpx.get(url, timeout=10)
    return r


def test_health_is_503_while_the_engine_thread_is_stalled_and_200_after(tok_dir):
    import uvicorn

    from kvtier.serve.api.server import listen, make_app

    app = make_app("tiny", tokenizer=str(tok_dir), health_stall_s=0.5, num_device_pages=256)
    sock = listen("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    gate, answers = threading.Event(), []
    try:
        assert _poll(f"{url}/health", 200).status_code == 200
        engine = app.state.kvtier.worker.engine
        step = engine.step

        def stalled_step():  # the engine thread hangs inside a step until the test lets it go
            gate.wait()
            return step()

        engine.step = stalled_step
        client = threading.Thread(target=lambda: answers.append(httpx.post(
            f"{url}/v1/chat/completions", timeout=120,
            json={"model": "tiny", "messages": ASK, "max_tokens": 2, "ignore_eos": True})))
        client.start()
        r = _poll(f"{url}/health", 503)
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert "has not completed a step" in message and "--health-stall-s 0.5" in message and "1 request" in message
        gate.set()
        assert _poll(f"{url}/health", 200).status_code == 200
        client.join(120)
        assert answers and answers[0].status_code == 200 and answers[0].json()["usage"]["completion_tokens"] == 2
    finally:
        gate.set()
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    a = start_server(tmp_path_factory.mktemp("ga"), "--num-device-pages", "256")
    try:
        b = start_server(tmp_path_factory.mktemp("gb"), "--num-device-pages", "256")
    except Exception:
        stop_server(a)
        raise
    yield a, b
    stop_server(a)
    stop_server(b)


def test_through_the_router_a_busy_worker_does_not_stop_the_other(two_workers, tmp_path):
    if not (TOKENIZER_DIR / "tiktoken.model").is_file():
        pytest.skip(f"real Kimi tokenizer files not present at {TOKENIZER_DIR}")
    a, b = two_workers
    by_url = {a.url: a, b.url: b}
    proc, router = start_listening(["router", "--workers", f"{a.url},{b.url}", "--policy", "least-loaded",
                                    "--port", "0"], tmp_path / "router.log", timeout_s=60)
    try:
        assert router, (tmp_path / "router.log").read_text(errors="replace")
        big_tokens = 48

        async def main():
            async with httpx.AsyncClient(timeout=300) as http:
                body = {"model": "tiny", "messages": ASK, "tools": [PATHOLOGICAL["nested_min_items"]],
                        "tool_choice": "required", "max_tokens": big_tokens, "stream": True,
                        "stream_options": {"include_usage": True}}
                async with http.stream("POST", f"{router}/v1/chat/completions", json=body) as big:
                    busy = big.headers["x-kvtier-worker"]
                    lines = big.aiter_lines()
                    first = await lines.__anext__()  # the expensive request is running on ``busy``
                    steps_before = _steps(by_url[busy])
                    small = []
                    for _ in range(4):
                        r = await http.post(f"{router}/v1/chat/completions", json={
                            "model": "tiny", "messages": ASK, "max_tokens": 2, "ignore_eos": True})
                        small.append((r.status_code, r.headers.get("x-kvtier-worker"), r.json()))
                    rest = [first] + [line async for line in lines]
                return busy, steps_before, small, rest

        busy, steps_before, small, rest = asyncio.run(main())
        assert [s for s, _, _ in small] == [200] * 4
        assert all(body["usage"]["completion_tokens"] == 2 for _, _, body in small)
        assert {w for _, w, _ in small} - {busy}, "no small request reached the idle worker"
        for _, w, body in small:
            if w == busy:  # served beside the expensive one, in a few steps
                assert body["usage"]["engine_steps"] <= SMALL_STEPS
        events = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
        usage = next(e["usage"] for e in events if e.get("usage"))
        finish = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
        assert finish == ["length"] and usage["completion_tokens"] == big_tokens
        assert usage["engine_steps"] <= big_tokens + PREFILL_STEPS
        time.sleep(0.5)
        assert _steps(by_url[busy]) > steps_before  # the busy worker's engine went on stepping
        assert httpx.get(f"{router}/health", timeout=10).json()["workers"][busy]["healthy"]
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(20)
