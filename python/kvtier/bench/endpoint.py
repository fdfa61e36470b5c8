"""``kvtier bench --endpoint URL``: the bench's closed-loop replay against any OpenAI-compatible
server, over HTTP with streaming, timed as a client sees it.

The same sessions as the in-process replay (:mod:`kvtier.bench.replay`): up to ``concurrency``
sessions at once, the first ones spread over ``ramp_s``, turn k due ``think_time_s`` after turn
k-1 finished. Trace and built-in turns are sent as token-id prompts to ``/v1/completions``;
text turns (``--conversations``) as messages (and tools) to ``/v1/chat/completions``. Every
request carries its session id (``session_id`` body field and ``X-Session-Id`` header), and a
turn that stopped on ``tool_use`` in the workload declares the wait that follows it
(``expected_tool_wait_s``: the next turn's think time, as a client that knows its tool's run time
would): on kvtier a text completion that declares it ends in a tool wait, so the next turn is a
resume (:class:`kvtier.serve.api.protocol.CompletionRequest`). Servers that do not know these
fields ignore them. Every request asks for ``max_tokens`` = the turn's output length with
``ignore_eos`` (vLLM, SGLang and kvtier honour it), temperature 0, ``stream`` and
``stream_options.include_usage``.

Timing: TTFT from when the turn was due to the first chunk that carries output (text, reasoning
or a tool call; role-only chunks do not count); the finish at the end of the stream. Output
and cached tokens come from the final usage (``prompt_tokens_details.cached_tokens``, and
kvtier's ``cached_tokens_by_tier`` when the server sends it).

Resume target: a server with a Prometheus ``/metrics`` that counts ``kvtier_resumes`` and
``kvtier_resume_slo_misses`` (``kvtier serve --resume-ttft-s``) is read before and after the
replay; the difference (resumes, misses by reason) is reported (:func:`resume_slo_delta`), None
for a server without them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

from kvtier.bench.records import ConfigRun, RequestRecord
from kvtier.bench.replay import working_set_pages
from kvtier.bench.workload import Session, Turn, Workload, prompt_token_ids
from kvtier.serve.api.resume import REASONS

TOKEN_LOW = 256  # synthetic prompt ids start here, as in the in-process replay
SAFE_VOCAB = 32000  # token ids below this exist in the vocabulary of every current LLM


def server_info(url: str, model: str, timeout_s: float = 30.0) -> dict:
    """The ``/v1/models`` entry of ``model`` on the server at ``url``.

    Raises:
        ValueError: the server cannot be reached, or does not serve ``model`` (the message
        lists the models it serves).
    """
    import httpx

    try:
        r = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=timeout_s)
        r.raise_for_status()
        models = r.json().get("data", [])
    except (httpx.HTTPError, ValueError) as e:
        raise ValueError(f"--endpoint {url!r}: GET /v1/models failed: {e}") from None
    for m in models:
        if m.get("id") == model:
            return m
    raise ValueError(f"--model {model!r} is not served by {url}; it serves {[m.get('id') for m in models]}")


def resume_counters(url: str, timeout_s: float = 10.0) -> dict | None:
    """``{"resumes", "misses": {reason: n}, "target_s"}`` from the server's ``/metrics``
    (Prometheus text; ``target_s`` None when the server has no ``--resume-ttft-s``: its misses are
    not counted), None when it does not answer or exposes no ``kvtier_resumes`` counter."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = httpx.get(f"{url.rstrip('/')}/metrics", timeout=timeout_s)
        r.raise_for_status()
        families = list(text_string_to_metric_families(r.text))
    except (httpx.HTTPError, ValueError):
        return None
    out = {"resumes": None, "misses": dict.fromkeys(REASONS, 0), "target_s": None}
    for fam in families:
        for sample in fam.samples:
            if sample.name == "kvtier_resumes_total":
                out["resumes"] = int(sample.value)
            elif sample.name == "kvtier_resume_slo_misses_total" and sample.labels.get("reason") in out["misses"]:
                out["misses"][sample.labels["reason"]] = int(sample.value)
            elif sample.name == "kvtier_resume_ttft_target_seconds":
                out["target_s"] = float(sample.value)
    return out if out["resumes"] is not None else None


def resume_slo_delta(before: dict | None, after: dict | None) -> dict | None:
    """What a replay added to the server's resume counters: ``{"resumes", "misses": {reason: n},
    "missed", "target_s"}`` (``missed``: all reasons; ``target_s``: the server's target after the
    replay, None without one: then ``missed`` is None too, as the server counts no miss); None
    when either read failed."""
    if before is None or after is None:
        return None
    misses = {k: after["misses"][k] - before["misses"][k] for k in REASONS}
    target = after.get("target_s")
    return {"resumes": after["resumes"] - before["resumes"], "misses": misses,
            "missed": sum(misses.values()) if target is not None else None, "target_s": target}


def _body(model: str, session: Session, k: int, block_size: int, vocab: int) -> tuple[str, dict]:
    """The path and body of turn ``k`` of ``session`` (module docstring)."""
    turn = session.turns[k]
    common = {"model": model, "max_tokens": turn.output_tokens, "temperature": 0, "ignore_eos": True,
              "stream": True, "stream_options": {"include_usage": True}, "session_id": str(session.session_id)}
    if turn.stop == "tool_use" and k + 1 < len(session.turns):  # declare the tool wait that follows
        common["expected_tool_wait_s"] = session.turns[k + 1].think_time_s
    if turn.chat is None:
        return "/v1/completions", {**common, "prompt": prompt_token_ids(turn, block_size, vocab, low=TOKEN_LOW)}
    body = {**common, "messages": list(turn.chat.messages)}
    if turn.chat.tools:
        body["tools"] = list(turn.chat.tools)
    return "/v1/chat/completions", body


def _has_output(chunk: dict) -> bool:
    for ch in chunk.get("choices") or []:
        if ch.get("text"):
            return True
        d = ch.get("delta") or {}
        if d.get("content") or d.get("reasoning_content") or d.get("tool_calls"):
            return True
    return False


async def _send(client, url: str, path: str, body: dict, session_id: str, t0: float) -> dict:
    """One streamed request: ``{"first", "finish", "usage", "chunks", "error", "headers"}`` (times
    from ``t0``; ``headers``: the response's)."""
    out = {"first": None, "finish": None, "usage": None, "chunks": 0, "error": None, "headers": {}}
    try:
        async with client.stream("POST", url + path, json=body, headers={"X-Session-Id": session_id}) as r:
            out["headers"] = dict(r.headers)
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                out["error"] = f"HTTP {r.status_code}: {text[:300]}"
                out["finish"] = time.perf_counter() - t0
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out["error"] = str(chunk["error"].get("message", chunk["error"]))[:300]
                    break
                if out["first"] is None and _has_output(chunk):
                    out["first"] = time.perf_counter() - t0
                out["chunks"] += _has_output(chunk)
                out["usage"] = chunk.get("usage") or out["usage"]
    except Exception as e:  # noqa: BLE001 - a failed request is a record with its error
        out["error"] = f"{type(e).__name__}: {e}"
    out["finish"] = time.perf_counter() - t0
    return out


def _record(session: Session, k: int, turn: Turn, due: float, res: dict) -> RequestRecord:
    usage = res["usage"] or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    by_tier = usage.get("cached_tokens_by_tier") or {"device": cached, "host": 0, "disk": 0}
    return RequestRecord(session.session_id, k, usage.get("prompt_tokens", turn.input_tokens),
                         usage.get("completion_tokens", res["chunks"]), due, res["first"],
                         res["finish"] if res["error"] is None else None, cached, dict(by_tier), error=res["error"])


async def replay_http(url: str, model: str, workload: Workload, name: str, *, concurrency: int, ramp_s: float = 0.0,
                      vocab_size: int = SAFE_VOCAB, timeout_s: float = 600.0,
                      on_finish: Callable[[RequestRecord], None] | None = None,
                      on_response: Callable[[RequestRecord, dict], None] | None = None) -> ConfigRun:
    """Replay ``workload`` against the server at ``url`` serving ``model``; returns the run.
    ``on_response(record, response_headers)`` is called after each turn (e.g. to read what a
    router reports per turn).

    Raises:
        ValueError: ``concurrency`` < 1 or ``ramp_s`` < 0.
    """
    import httpx

    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if not 0 <= ramp_s < float("inf"):
        raise ValueError(f"ramp_s must be a finite number >= 0, got {ramp_s}")
    url = url.rstrip("/")
    queue = [s for s in workload.sessions if s.turns]
    queue.reverse()
    records: list[RequestRecord] = []
    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def run_session(client, session: Session, start: float) -> None:
        due = start
        for k, turn in enumerate(session.turns):
            due = max(due, 0.0) if k == 0 else due + turn.think_time_s
            await asyncio.sleep(max(0.0, due - (time.perf_counter() - t0)))
            path, body = _body(model, session, k, workload.block_size, vocab_size)
            res = await _send(client, url, path, body, str(session.session_id), t0)
            rec = _record(session, k, turn, due, res)
            records.append(rec)
            if on_finish is not None:
                on_finish(rec)
            if on_response is not None:
                on_response(rec, res["headers"])
            due = res["finish"]

    async def slot(client, i: int) -> None:
        first = True
        while queue:
            session = queue.pop()
            start = i * ramp_s / concurrency if first else time.perf_counter() - t0
            first = False
            await run_session(client, session, start)

    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        await asyncio.gather(*(slot(client, i) for i in range(concurrency)))
    wall = time.perf_counter() - t0
    recomputed = sum(max(r.input_tokens - r.cached_tokens, 0) for r in records if r.error is None)
    return ConfigRun(name=name, records=records, wall_s=wall, recomputed_tokens=recomputed,
                     working_set_pages=working_set_pages(workload, workload.block_size, concurrency),
                     server_counters=False)


def server_root(url: str) -> str:
    """``url`` without a trailing ``/`` or ``/v1``: an OpenAI client's ``base_url``
    (``http://host:port/v1``) names the same server as ``http://host:port``."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def run_endpoint(opts, url: str, on_start=None, on_finish=None) -> tuple[Workload, ConfigRun, dict]:
    """Load the workload ``opts`` (a :class:`kvtier.bench.run.BenchOptions`; ``opts.model`` is
    the served model's name) describes and replay it against ``url`` (a server root, or an OpenAI
    client's ``base_url`` ending in ``/v1``): ``(workload, run,
    provenance)``; ``provenance["resume_slo"]`` is the server's resume-target counts for the
    replay (:func:`resume_slo_delta`; None without them). Token-id prompts use ids below the preset's vocabulary when ``opts.model``
    names a kvtier preset, else below :data:`SAFE_VOCAB`.

    Raises:
        ValueError: the server does not serve ``opts.model``, or the workload is empty.
    """
    from kvtier.bench.run import load_tokenizer_for, load_workload, options_json
    from kvtier.model.config import PRESETS, preset
    from kvtier.provenance import provenance

    url = server_root(url)
    info = server_info(url, opts.model)
    known = preset(opts.model) if opts.model in PRESETS else None
    max_len = info.get("max_model_len") or (known.max_position_embeddings if known else 1 << 20)
    vocab = known.vocab_size if known else SAFE_VOCAB
    tokenizer = load_tokenizer_for(opts) if opts.conversations is not None else None
    workload = load_workload(opts, max_len, tokenizer)
    if not workload.sessions:
        raise ValueError(f"the workload has no session that fits the server's context ({max_len} tokens)")
    name = f"endpoint {opts.model}"
    if on_start is not None:
        on_start(name, workload.num_requests())
    before = resume_counters(url)
    run = asyncio.run(replay_http(url, opts.model, workload, name, concurrency=opts.concurrency, ramp_s=opts.ramp_s,
                                  vocab_size=vocab, on_finish=on_finish))
    resume_slo = resume_slo_delta(before, resume_counters(url))
    prov = provenance(endpoint=url, model=opts.model, max_model_len=max_len, token_vocab=vocab,
                      workload={"name": workload.name, "source": workload.source, "format": workload.format,
                                "sessions": len(workload.sessions), "requests": workload.num_requests(),
                                "block_size": workload.block_size},
                      token_scale=opts.token_scale, time_scale=opts.time_scale, max_think_s=opts.max_think_s,
                      options=options_json(opts), resume_slo=resume_slo)
    return workload, run, prov
