"""The server's sessions waiting on tools, as ``/metrics`` publishes them (for tool-loop tests)."""

from __future__ import annotations

import time


def tool_waits(server) -> tuple[float, float]:
    """(sessions waiting on a tool, sessions expired so far) from ``/metrics``, read after the
    engine thread's next publication (every 0.2 s), so what ended before is counted."""
    time.sleep(0.5)
    m = server.metrics()
    expired = m.get(("kvtier_sessions_expired_total",), m.get(("kvtier_sessions_expired",), 0.0))
    return m[("kvtier_sessions_waiting_on_tools",)], expired


def settle(server, want: float, expired0: float, timeout_s: float = 30.0) -> bool:
    """Whether the waiting-sessions gauge reaches ``want`` (published every 0.2 s). Sessions of
    other tests that expire meanwhile (the expired counter moved past ``expired0``) may each
    have been waiting: the gauge may then be lower by as many."""
    deadline = time.monotonic() + timeout_s
    while True:
        waiting, expired = tool_waits(server)
        if want - (expired - expired0) <= waiting <= want:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
