"""Remote tier: page-first blocks in a store every worker can read (Redis, Mooncake Store).

``remote_cache_url`` names the store: ``redis://HOST:PORT[/DB]`` or
``mooncake://MASTER_HOST:PORT[?metadata=...&segment_mib=...&buffer_mib=...&host=...]``.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from kvtier.cache.disk_tier import BlockMeta
from kvtier.cache.remote.backend import RemoteBackend, RemoteStatus, StoreUnreachableError
from kvtier.cache.remote.tier import RemoteHandle, RemoteStats, RemoteTier

SCHEMES = ("redis", "mooncake")

__all__ = ["SCHEMES", "RemoteBackend", "RemoteHandle", "RemoteStats", "RemoteStatus", "RemoteTier",
           "StoreUnreachableError", "check_remote_url", "open_backend", "open_remote"]


def check_remote_url(name: str, url) -> str | None:
    """``url`` if it is None or ``SCHEME://HOST:PORT...`` with a scheme of :data:`SCHEMES`.

    Raises:
        ValueError: anything else, naming ``name``, the value and what was expected.
    """
    if url is None:
        return None
    expected = "redis://HOST:PORT[/DB] or mooncake://HOST:PORT[?metadata=URL]"
    if not isinstance(url, str):
        raise ValueError(f"{name} must be a str ({expected}) or None, got {url!r} ({type(url).__name__})")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"{name}={url!r} is not a valid URL ({e}); expected {expected}") from None
    if parts.scheme not in SCHEMES or not parts.hostname or port is None:
        raise ValueError(f"{name}={url!r}: expected {expected}")
    return url


def open_backend(url: str, timeout_s: float) -> RemoteBackend:
    """Connect to the store at ``url`` (checked by :func:`check_remote_url`).

    Raises:
        ValueError: a malformed URL; StoreUnreachableError (a ConnectionError and RuntimeError):
            the store cannot be reached (names ``url``).
    """
    check_remote_url("remote_cache_url", url)
    if url.startswith("redis://"):
        from kvtier.cache.remote.redis_backend import RedisBackend
        return RedisBackend(url, timeout_s)
    from kvtier.cache.remote.mooncake_backend import MooncakeBackend
    return MooncakeBackend(url, timeout_s)


def open_remote(url: str, meta: BlockMeta, timeout_s: float = 1.0) -> RemoteTier:
    """A :class:`RemoteTier` for blocks of layout ``meta`` in the store at ``url``."""
    return RemoteTier(open_backend(url, timeout_s), meta, timeout_s=timeout_s)
