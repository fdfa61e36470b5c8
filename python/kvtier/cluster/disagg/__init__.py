"""Prefill/decode disaggregation with incremental KV transfer.

A ``--role prefill`` worker computes a turn's prompt and sends the decode worker the router
chose only the full blocks it lacks, batch by batch as prefill chunks finish; a ``--role decode``
worker registers them (checked, complete) and serves the turn as any worker would, recomputing
whatever did not arrive. ``both`` (the default) is a colocated worker that can also receive.

Modules: :mod:`.blocks` (export, wire format, import), :mod:`.transfer` (one turn's sending
thread and its report), :mod:`.worker` (the prefill engine thread, metrics), :mod:`.routes`
(HTTP routes of each role), :func:`reach_decode_workers` and :func:`check_compatible` (the prefill worker's start-up checks).
"""

from __future__ import annotations

import httpx

from kvtier.cluster.disagg.routes import ROLES, check_role

__all__ = ["ROLES", "check_compatible", "check_role", "reach_decode_workers"]


def reach_decode_workers(urls: list[str], timeout_s: float = 5.0) -> dict[str, dict]:
    """``/v1/kv/info`` of each decode worker of a prefill worker that answers with role ``decode``
    or ``both`` (asked before the model loads, so a bad list fails at once).

    Raises:
        ValueError: ``urls`` is empty, or none of them answers as a decode worker (each named,
            with what it answered).
    """
    if not urls:
        raise ValueError("--role prefill needs --decode-workers URL,... (the decode workers it sends KV to)")
    ok, problems = {}, []
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
        else:
            ok[u] = theirs
    if not ok:
        raise ValueError(f"--role prefill: no decode worker reachable among --decode-workers: {'; '.join(problems)}")
    return ok


def check_compatible(infos: dict[str, dict], info: dict) -> None:
    """Every decode worker in ``infos`` (from :func:`reach_decode_workers`) has this worker's
    layouts and salt (``info``, :func:`kvtier.cluster.disagg.routes.worker_info`).

    Raises:
        ValueError: one that does not, named with both layouts and salts.
    """
    for u, theirs in infos.items():
        if theirs.get("layouts") != info["layouts"] or theirs.get("salt") != info["salt"]:
            raise ValueError(f"--decode-workers: {u} has layouts {theirs.get('layouts')} and salt {theirs.get('salt')}, "
                             f"this worker {info['layouts']} and {info['salt']} (another model, dtype, page size or "
                             "--cache-salt): it could never use these blocks")
