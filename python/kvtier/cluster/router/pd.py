"""Prefill/decode routing: a turn's prompt runs on a prefill worker, which sends the decode worker
the router chose (by the same cost model: the one whose tiers hold most of the session's prefix)
only the blocks it lacks; then the turn goes to that decode worker, which finds them cached.

The prefill stage is an optimisation, never a gate: when no prefill worker is healthy, or the
prefill call fails or is refused, the turn still goes to the decode worker, which recomputes
what it lacks (counted in :attr:`PrefillStage.stats` as ``fallbacks``).
"""

from __future__ import annotations

import time

import httpx

from kvtier.cluster.router.routing import Router

DECODE_URL_HEADER = "x-kvtier-decode-url"
TRANSFER_HEADER = "x-kvtier-transfer"  # the turn's transfer report (JSON) on the router's response
_FORWARD = ("content-type", "authorization", "x-session-id")


def check_roles(prefill_urls: list[str], decode_urls: list[str], timeout_s: float = 5.0) -> None:
    """Each prefill URL answers ``/v1/kv/info`` with role ``prefill``, each decode URL with
    ``decode`` or ``both``.

    Raises:
        ValueError: the URLs that do not, named with the role they gave.
    """
    bad = []
    for flag, urls, roles in (("--prefill-workers", prefill_urls, ("prefill",)),
                              ("--decode-workers", decode_urls, ("decode", "both"))):
        for u in urls:
            try:
                role = httpx.get(f"{u}/v1/kv/info", timeout=timeout_s).json().get("role")
            except (httpx.HTTPError, ValueError) as e:
                role = f"unreachable ({type(e).__name__})"
            if role not in roles:
                bad.append(f"{flag} {u}: role {role!r}, expected {' or '.join(roles)}")
    if bad:
        raise ValueError("; ".join(bad))


class PrefillStage:
    """Chooses a prefill worker for a turn (``router``: a :class:`Router` over the prefill
    workers, kv-aware by default, so a session's prefill stays where its prefix is) and runs it.

    Attributes:
        stats: counters: ``turns`` (prefills asked), ``fallbacks`` (turns that went to their decode
            worker without a complete prefill), ``refused`` (requests the prefill worker found
            invalid; the decode worker answers them with the same error), ``transfer_failures``, ``blocks_sent``,
            ``blocks_held``, ``blocks_lost``, ``bytes_sent``, ``full_prompt_bytes``,
            ``overlapped_s``, ``exposed_s``.
    """

    def __init__(self, router: Router):
        self.router = router
        self.stats = dict.fromkeys(("turns", "fallbacks", "refused", "transfer_failures", "blocks_sent", "blocks_held",
                                    "blocks_lost", "bytes_sent", "full_prompt_bytes"), 0)
        self.stats.update(overlapped_s=0.0, exposed_s=0.0)

    async def run(self, client: httpx.AsyncClient, path: str, raw: bytes, headers: dict, session_id,
                  prompt_tokens: int, decode_url: str) -> dict | None:
        """Prefill the turn (``path``: ``/v1/chat/completions`` or ``/v1/completions``, ``raw``
        its body) for ``decode_url``; returns the prefill worker's answer (with ``transfer``, its
        report, and ``prefill_url``), or None after a fallback."""
        self.stats["turns"] += 1
        if not self.router.healthy():
            self.stats["fallbacks"] += 1
            return None
        url = self.router.choose(session_id, prompt_tokens)
        w = self.router.workers[url]
        w.inflight += 1
        t0 = time.monotonic()
        try:
            fwd = {k: v for k, v in headers.items() if k.lower() in _FORWARD}
            resp = await client.post(f"{url}/v1/kv/prefill{path[len('/v1'):]}", content=raw,
                                     headers={**fwd, DECODE_URL_HEADER: decode_url})
        except httpx.HTTPError:
            w.healthy = False  # out of prefill routing until a poll succeeds
            self.stats["fallbacks"] += 1
            return None
        finally:
            w.inflight -= 1
        if resp.status_code != 200:  # a bad request (4xx: the decode worker gives the client its error)
            self.stats["refused" if 400 <= resp.status_code < 500 else "fallbacks"] += 1
            return None
        out = resp.json()
        last = out.get("kv_last_block")
        self.router.record(session_id, url, int(out.get("prompt_tokens", prompt_tokens)), time.monotonic() - t0,
                           bytes.fromhex(last) if last else None)
        self._count(out.get("transfer") or {})
        out["prefill_url"] = url
        return out

    def _count(self, t: dict) -> None:
        s = self.stats
        if t.get("failed"):
            s["transfer_failures"] += 1
            s["fallbacks"] += 1
        for k in ("blocks_sent", "blocks_lost", "bytes_sent", "full_prompt_bytes", "overlapped_s", "exposed_s"):
            s[k] += t.get(k, 0)
        s["blocks_held"] += max(t.get("blocks_held", 0), 0)


def prefill_stage(prefill_urls: list[str], decode_urls: list[str], policy: str, remote: bool):
    """The router's :class:`kvtier.cluster.router.pd.PrefillStage` after checking every worker's role.

    Raises:
        ValueError: a prefill worker that does not answer or is not ``--role prefill``, or a
            decode worker that is not ``--role decode`` or ``both`` (named).
    """
    check_roles(prefill_urls, decode_urls)  # prefill workers are placed by where a session's last prefill ran
    return PrefillStage(Router(prefill_urls, policy=policy, remote=remote))
