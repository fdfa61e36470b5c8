"""A remote store in this process, for tier and pool tests that need a remote tier."""

from __future__ import annotations

from kvtier.cache.remote import RemoteStatus


class MemoryBackend:
    """A remote store in this process (a dict), with a switch that makes every call fail."""

    url = "memory://test"

    def __init__(self):
        self.values: dict[str, bytes] = {}
        self.down = False

    def _check(self):
        if self.down:
            raise ConnectionError("the store is down")

    def batch_put(self, keys, values):
        self._check()
        self.values.update(zip(keys, (bytes(v) for v in values)))
        return [RemoteStatus.OK] * len(keys)

    def batch_get(self, keys, outs):
        self._check()
        statuses = []
        for k, out in zip(keys, outs):
            v = self.values.get(k)
            if v is None:
                statuses.append(RemoteStatus.MISSING)
            elif len(v) != len(out):
                statuses.append(RemoteStatus.CORRUPT)
            else:
                out[:] = v
                statuses.append(RemoteStatus.OK)
        return statuses

    def exists(self, keys):
        self._check()
        return [k in self.values for k in keys]

    def close(self):
        pass
