"""Redis (or Valkey) backend of the remote tier: one value per block, MGET and pipelines."""

from __future__ import annotations

from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvtier.cache.remote.backend import RemoteStatus, StoreUnreachableError


class RedisBackend:
    """A Redis server at ``url`` (``redis://HOST:PORT[/DB]``).

    Args:
        url: the server; ``redis://`` only (no TLS, no password in this version).
        timeout_s: socket connect and read timeout in seconds (no retries: a slow or dead
            server is a failed call, which the remote tier counts as misses).

    Raises:
        StoreUnreachableError: the server does not answer a PING at start-up (names ``url``).
    """

    def __init__(self, url: str, timeout_s: float):
        self.url = url
        parts = urlsplit(url)
        db = int(parts.path.strip("/") or 0)
        self._client = redis.Redis(host=parts.hostname or "127.0.0.1", port=parts.port or 6379, db=db,
                                   socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                   retry=Retry(NoBackoff(), 0))
        try:
            self._client.ping()
        except redis.RedisError as e:
            self._client.close()
            raise StoreUnreachableError(f"remote_cache_url={url!r}: the Redis server does not answer ({e})") from None

    def batch_put(self, keys: list[str], values: list[bytes]) -> list[RemoteStatus]:
        pipe = self._client.pipeline(transaction=False)
        for k, v in zip(keys, values):
            pipe.set(k, v)
        results = pipe.execute(raise_on_error=False)
        return [RemoteStatus.OK if r is True else RemoteStatus.ERROR for r in results]

    def batch_get(self, keys: list[str], outs: list[memoryview]) -> list[RemoteStatus]:
        statuses = []
        for value, out in zip(self._client.mget(keys), outs):
            if value is None:
                statuses.append(RemoteStatus.MISSING)
            elif len(value) != len(out):
                statuses.append(RemoteStatus.CORRUPT)
            else:
                out[:] = value
                statuses.append(RemoteStatus.OK)
        return statuses

    def exists(self, keys: list[str]) -> list[bool]:
        pipe = self._client.pipeline(transaction=False)
        for k in keys:
            pipe.exists(k)
        return [bool(r) for r in pipe.execute()]

    def close(self) -> None:
        self._client.close()
