"""What a remote store must offer the remote tier (:class:`RemoteBackend`), and its status codes."""

from __future__ import annotations

import enum
from typing import Protocol


class RemoteStatus(enum.IntEnum):
    """Per-key result of a remote read or write (0 = OK)."""

    OK = 0
    MISSING = 1     # no value under the key (never written, evicted, or the store restarted)
    CORRUPT = 2     # a value that failed the header or checksum check (or has the wrong length)
    ERROR = 3       # the store refused or failed the call (down, full, connection lost)
    TIMEOUT = 4     # no answer within the tier's timeout
    UNAVAILABLE = 5  # not tried: the store timed out or failed recently (see RemoteTier.retry_after_s)


class StoreUnreachableError(ConnectionError, RuntimeError):
    """The store named by a ``remote_cache_url`` cannot be reached at start-up (the message names
    the URL). A ``ConnectionError`` (so an ``OSError``: the CLI reports it as a start-up error
    without a traceback) and, as before, a ``RuntimeError``."""


class RemoteBackend(Protocol):
    """A key-value store holding whole blocks as values, one value per key.

    Calls may block (a network round trip) and are made from the remote tier's worker threads,
    never from an engine step; a backend may serialise them. A backend never raises for a
    per-key failure: it reports it in the returned statuses. A call may raise when the whole
    store is unreachable (the tier counts that as ``ERROR`` for every key).
    """

    url: str
    """Where the store is (as given), for messages."""

    def batch_put(self, keys: list[str], values: list[bytes]) -> list[RemoteStatus]:
        """Store ``values[i]`` under ``keys[i]``; per-key status (OK does not promise the value
        stays: stores evict)."""
        ...

    def batch_get(self, keys: list[str], outs: list[memoryview]) -> list[RemoteStatus]:
        """Read ``keys[i]`` into ``outs[i]`` (a writable byte buffer of the expected value
        length); OK only when a value of exactly that length was read."""
        ...

    def exists(self, keys: list[str]) -> list[bool]:
        """Whether each key holds a value now."""
        ...

    def close(self) -> None:
        """Release connections and registered memory; the backend is unusable after."""
        ...
