"""Turns of one conversation sent to a colocated worker and through the P/D router, compared."""

from __future__ import annotations

import json
import socket

import httpx

LOGPROB_ATOL = 1e-4
PAGE_SIZE = 16


def turn(url: str, messages: list[dict], session: str, max_tokens: int = 6,
         model: str = "tiny", **fields) -> tuple[dict, dict | None]:
    """``(response body, transfer report from the x-kvtier-transfer header or None)``; ``fields``:
    more request fields."""
    r = httpx.post(f"{url}/v1/chat/completions", timeout=300, headers={"x-session-id": session},
                   json={"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                         "logprobs": True, "ignore_eos": True, **fields})
    assert r.status_code == 200, r.text
    header = r.headers.get("x-kvtier-transfer")
    return r.json(), (json.loads(header) if header else None)


def answer(body: dict) -> tuple[str, list[float]]:
    choice = body["choices"][0]
    return choice["message"]["content"], [t["logprob"] for t in choice["logprobs"]["content"]]


def assert_same_output(got: dict, want: dict) -> None:
    """Same text and tokens, fp32 logprobs within :data:`LOGPROB_ATOL`, worst index named."""
    (text, lps), (want_text, want_lps) = answer(got), answer(want)
    assert text == want_text
    assert len(lps) == len(want_lps)
    worst = max(range(len(lps)), key=lambda i: abs(lps[i] - want_lps[i]))
    assert abs(lps[worst] - want_lps[worst]) <= LOGPROB_ATOL, (worst, lps[worst], want_lps[worst])


def metric(server, name: str, **labels) -> float:
    return server.metrics().get((name, *sorted(labels.items())), 0.0)


def free_dead_url() -> str:
    """A URL on 127.0.0.1 where nothing listens (a port the OS gave out and took back)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"
