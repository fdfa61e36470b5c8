"""Prefill/decode disaggregation with incremental KV transfer.

A ``--role prefill`` worker computes a turn's prompt and sends the decode worker the router
chose only the full blocks it lacks, batch by batch as prefill chunks finish; a ``--role decode``
worker registers them (checked, complete) and serves the turn as any worker would, recomputing
whatever did not arrive. ``both`` (the default) is a colocated worker that can also receive.

Modules: :mod:`.blocks` (export, wire format, import), :mod:`.transfer` (one turn's sending
thread and its report), :mod:`.worker` (the prefill engine thread, metrics), :mod:`.routes`
(HTTP routes of each role), :func:`check_decode_workers` (the prefill worker's start-up check).
"""

from __future__ import annotations

import httpx

from kvtier.disagg.routes import ROLES, check_role

__all__ = ["ROLES", "check_decode_workers", "check_role"]


def check_decode_workers(urls: list[str], info: dict, timeout_s: float = 5.0) -> list[str]:
    """The decode workers of a prefill worker whose ``/v1/kv/info`` answers with role ``decode``
    or ``both`` and the same block layout and salt as ``info`` (this worker's).

    Raises:
        ValueError: ``urls`` is empty, none of them is reachable, or one answers with another
            role, layout or salt (each named, with what was expected).
    """
    if not urls:
        raise ValueError("--role prefill needs --decode-workers URL,... (the decode workers it sends KV to)")
    ok, problems = [], []
    for u in urls:
        try:
            r = httpx.get(f"{u}/v1/kv/info", timeout=timeout_s)
            r.raise_for_status()
            theirs = r.json()
        except (httpx.HTTPError, ValueError) as e:
            problems.append(f"{u}: not reachable ({type(e).__name__})")
            continue
        if theirs.get("role") not in ("decode", "both"):
            problems.append(f"{u}: role {theirs.get('role')!r}, expected decode or both")
        elif theirs.get("layout") != info["layout"] or theirs.get("salt") != info["salt"]:
            raise ValueError(f"--decode-workers: {u} has block layout {theirs.get('layout')} and salt "
                             f"{theirs.get('salt')}, this worker {info['layout']} and {info['salt']} (another "
                             "model, dtype, page size or --cache-salt): it could never use these blocks")
        else:
            ok.append(u)
    if not ok:
        raise ValueError(f"--role prefill: no decode worker reachable among --decode-workers: {'; '.join(problems)}")
    return ok
