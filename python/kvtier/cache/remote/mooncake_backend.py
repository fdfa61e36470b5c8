"""Mooncake Store backend of the remote tier: batched zero-copy calls on a registered buffer.

Uses ``batch_put_from`` / ``batch_get_into``, which return a code per key (``get()`` returns
empty bytes for a miss and for an error alike). Values pass through one registered staging
arena (one call at a time); over TCP the transfer engine copies anyway, so the extra memcpy
costs little. Needs the ``mooncake-transfer-engine-non-cuda`` wheel on machines without CUDA
and ``libibverbs1`` even for TCP (see docs/cluster.md).
"""

from __future__ import annotations

import os
import threading
from urllib.parse import parse_qs, urlsplit

import numpy as np
import torch

from kvtier.cache.remote.backend import RemoteStatus, StoreUnreachableError

_OBJECT_NOT_FOUND = -704
_BUFFER_OVERFLOW = -600  # the value is longer than expected: not a block of this layout
_MiB = 1 << 20


class MooncakeBackend:
    """A Mooncake Store client of the master at ``url``.

    URL: ``mooncake://MASTER_HOST:PORT[?metadata=URL&segment_mib=N&buffer_mib=N&host=ADDR]``:
    ``metadata`` is the transfer engine's metadata server (default ``P2PHANDSHAKE``: none),
    ``segment_mib`` the memory this client contributes to the store's pool (default 64),
    ``buffer_mib`` the registered staging arena (default 64), ``host`` the address this client
    advertises (default 127.0.0.1; ``MC_TCP_BIND_ADDRESS`` is set to it when unset, without
    which the engine advertises the first non-loopback interface).

    Raises:
        ValueError: a malformed URL (names it).
        RuntimeError: the mooncake package is missing; StoreUnreachableError: the client cannot
            join the store (names ``url``).
    """

    def __init__(self, url: str, timeout_s: float):
        self.url = url
        parts = urlsplit(url)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        try:
            segment = int(query.pop("segment_mib", 64)) * _MiB
            self._arena_bytes = int(query.pop("buffer_mib", 64)) * _MiB
            master = f"{parts.hostname}:{parts.port}"
        except ValueError as e:
            raise ValueError(f"remote_cache_url={url!r}: {e}") from None
        metadata = query.pop("metadata", "P2PHANDSHAKE")
        host = query.pop("host", "127.0.0.1")
        if query or parts.port is None:
            raise ValueError(f"remote_cache_url={url!r}: expected mooncake://HOST:PORT with optional metadata=, "
                             f"segment_mib=, buffer_mib=, host=; got unknown {sorted(query)} or no port")
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise RuntimeError(f"remote_cache_url={url!r} needs the mooncake-transfer-engine-non-cuda package "
                               f"(pip install 'kvtier[remote]'): {e}") from None
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(host, metadata, segment, self._arena_bytes, "tcp", "", master)
        if rc != 0:
            raise StoreUnreachableError(f"remote_cache_url={url!r}: cannot join the Mooncake master at {master} (setup "
                               f"returned {rc}); is mooncake_master running there?")
        self._arena = torch.empty(self._arena_bytes, dtype=torch.uint8)
        if self._store.register_buffer(self._arena.data_ptr(), self._arena_bytes) != 0:
            raise RuntimeError(f"remote_cache_url={url!r}: cannot register a {self._arena_bytes}-byte buffer")
        self._lock = threading.Lock()
        self._closed = False

    def _chunks(self, sizes: list[int]):
        """Index ranges of consecutive keys whose values fit in the arena together."""
        start, used = 0, 0
        for i, n in enumerate(sizes):
            if n > self._arena_bytes:
                raise ValueError(f"a {n}-byte value exceeds buffer_mib of {self.url!r}")
            if used + n > self._arena_bytes:
                yield start, i
                start, used = i, 0
            used += n
        if start < len(sizes):
            yield start, len(sizes)

    def _offsets(self, sizes: list[int]) -> list[int]:
        base, ptrs = self._arena.data_ptr(), []
        for n in sizes:
            ptrs.append(base)
            base += n
        return ptrs

    def batch_put(self, keys: list[str], values: list[bytes]) -> list[RemoteStatus]:
        sizes, out = [len(v) for v in values], []
        with self._lock:
            for a, b in self._chunks(sizes):
                pos = 0
                for v in values[a:b]:
                    self._arena.numpy()[pos:pos + len(v)] = np.frombuffer(v, dtype=np.uint8)
                    pos += len(v)
                codes = self._store.batch_put_from(keys[a:b], self._offsets(sizes[a:b]), sizes[a:b])
                out += [RemoteStatus.OK if c == 0 else RemoteStatus.ERROR for c in codes]
        return out

    def batch_get(self, keys: list[str], outs: list[memoryview]) -> list[RemoteStatus]:
        sizes, out = [len(o) for o in outs], []
        with self._lock:
            for a, b in self._chunks(sizes):
                codes = self._store.batch_get_into(keys[a:b], self._offsets(sizes[a:b]), sizes[a:b])
                pos = 0
                for code, dst, n in zip(codes, outs[a:b], sizes[a:b]):
                    if code == n:
                        dst[:] = self._arena[pos:pos + n].numpy().data
                        out.append(RemoteStatus.OK)
                    else:
                        out.append(RemoteStatus.MISSING if code == _OBJECT_NOT_FOUND else
                                   RemoteStatus.CORRUPT if code >= 0 or code == _BUFFER_OVERFLOW else
                                   RemoteStatus.ERROR)
                    pos += n
        return out

    def exists(self, keys: list[str]) -> list[bool]:
        codes = self._store.batch_is_exist(keys)
        if any(c < 0 for c in codes):
            raise RuntimeError(f"{self.url}: batch_is_exist failed with codes {sorted(set(codes))}")
        return [c == 1 for c in codes]

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._store.unregister_buffer(self._arena.data_ptr())
                self._store.close()
