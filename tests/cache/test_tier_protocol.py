"""One test suite for every tier below the device pages (kvtier.cache.tiers.protocol.TierStore):
host memory, disk, and the remote tier (an in-process store, and a real Redis server when
installed). Faults included: a failed read (corrupt bytes, a short value, a store error, a missing
block) ends with a non-zero status, never with a wrong block."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from kvtier.cache.disk_tier import BlockMeta, DiskStatus, DiskTier
from kvtier.cache.host_tier import HostTier
from kvtier.cache.prefix_index import PrefixIndex, Tier
from kvtier.cache.remote import (
    RemoteStatus,
    RemoteTier,
    block_format,
    open_backend,
    open_remote,
)
from kvtier.cache.tiers import Admit, DiskFiles, HostStore, RemoteStore, TierStore
from kvtier.transfer import CopyEngine

from tests.helpers.memory_store import MemoryBackend
from tests.stores import redis_store  # noqa: F401

META = BlockMeta(num_layers=2, page_size=4, row_bytes=48, dtype=1, payload_bytes=2 * 4 * 48)
N = META.payload_bytes
CAPACITY_BLOCKS = 8


def blocks(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n * N,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def hashes(n: int, seed: int) -> list[bytes]:
    return [bytes([seed, i]) + bytes(14) for i in range(n)]


@dataclass
class Harness:
    """A store and the means to damage what it holds behind its back (None: not possible)."""

    store: TierStore
    index: PrefixIndex
    corrupt: Callable[[bytes], None] | None    # flip one payload bit of a stored block
    shorten: Callable[[bytes], None] | None    # drop the last byte of a stored block
    lose: Callable[[bytes], None]              # the block disappears (deleted, evicted elsewhere)
    break_store: Callable[[], None] | None     # every later call of the store fails
    evicts: bool = True                        # evict() drops the block (a shared store keeps it)

    def slots(self, hs: list[bytes]) -> list[int]:
        """The blocks' slots in this tier as the index records them (host); 0 for tiers keyed by hash."""
        if self.store.tier != Tier.HOST:
            return [0] * len(hs)
        out = []
        for h in hs:
            row = self.index.match([h], [Tier.HOST])
            out.append(int(row[0][Tier.HOST]) if len(row) else -1)
        return out

    def read(self, hs: list[bytes]) -> tuple[list[int], torch.Tensor]:
        buf, job = self.store.read(hs, self.slots(hs))
        return job.result(), buf.reshape(-1).view(torch.uint8)[:len(hs) * N].clone()


def _host(tmp_path, request) -> Harness:
    index = PrefixIndex()
    host = HostTier(CAPACITY_BLOCKS * N, N, pin=False)

    def lose(h):  # evicted from the index: the slot is free, nothing reads it as this block
        store.evict([h])

    store = HostStore(host, lambda: index)
    return Harness(store, index, corrupt=None, shorten=None, lose=lose, break_store=None)


def _disk(tmp_path, request) -> Harness:
    engine = CopyEngine(2, max_queued=64)
    disk = DiskTier(tmp_path / "disk", CAPACITY_BLOCKS * DiskTier.file_bytes(N))
    store = DiskFiles(disk, META, lambda: engine)

    def corrupt(h):
        path = disk.path(h)
        data = bytearray(path.read_bytes())
        data[4096 + 7] ^= 0x01  # one payload bit
        path.write_bytes(bytes(data))

    def shorten(h):
        path = disk.path(h)
        os.truncate(path, path.stat().st_size - 1)

    def break_store():  # the files are replaced by directories: every read is an I/O error
        for h, _ in disk.blocks():
            path = disk.path(h)
            path.unlink()
            path.mkdir()

    return Harness(store, PrefixIndex(), corrupt=corrupt, shorten=shorten, lose=lambda h: disk.path(h).unlink(),
                   break_store=break_store)


def _remote(tier: RemoteTier, backend_url: str | None, backend: MemoryBackend | None) -> Harness:
    index = PrefixIndex()
    store = RemoteStore(tier, lambda: index)
    writer = backend if backend is not None else open_backend(backend_url, 5.0)

    def value_of(h):
        out = bytearray(tier.value_bytes)
        assert writer.batch_get([tier.key(h)], [memoryview(out)]) == [RemoteStatus.OK]
        return out

    def corrupt(h):
        v = value_of(h)
        v[-1] ^= 0x10
        writer.batch_put([tier.key(h)], [bytes(v)])

    def shorten(h):
        writer.batch_put([tier.key(h)], [bytes(value_of(h)[:-1])])

    def lose(h):
        if backend is not None:
            del backend.values[tier.key(h)]
        else:
            writer._client.delete(tier.key(h))

    def break_store():
        if backend is not None:
            backend.down = True
        else:
            tier.backend.close()

    return Harness(store, index, corrupt=corrupt, shorten=shorten, lose=lose,
                   break_store=break_store if backend is not None else None, evicts=False)


def _remote_memory(tmp_path, request) -> Harness:
    backend = MemoryBackend()
    return _remote(RemoteTier(backend, META, timeout_s=5.0, retry_after_s=60.0), None, backend)


def _remote_redis(tmp_path, request) -> Harness:
    server = request.getfixturevalue("redis_store")
    tier = open_remote(server.url, META, timeout_s=5.0)
    request.addfinalizer(tier.close)
    tier.backend._client.flushdb()
    return _remote(tier, server.url, None)


@pytest.fixture(params=[_host, _disk, _remote_memory, _remote_redis], ids=["host", "disk", "remote", "remote-redis"])
def tier(tmp_path, request) -> Harness:
    return request.param(tmp_path, request)


def test_is_a_tier_store(tier):
    assert isinstance(tier.store, TierStore)
    assert tier.store.name == tier.store.tier.name.lower()


def test_round_trip_bytes_equal(tier):
    hs, data = hashes(3, 1), blocks(3, 1)
    assert tier.store.write(hs, data).result() == [0, 0, 0]
    assert tier.store.contains(hs + hashes(1, 2)) == [True, True, True, False]
    status, got = tier.read(hs)
    assert status == [0, 0, 0]
    assert torch.equal(got, data)
    status, got = tier.read(hs[1:2])  # one block on its own
    assert status == [0] and torch.equal(got, data[N:2 * N])


def test_capacity(tier):
    cap = tier.store.capacity_blocks()
    assert cap == (CAPACITY_BLOCKS if tier.store.tier != Tier.REMOTE else -1)


def test_evict(tier):
    hs, data = hashes(2, 3), blocks(2, 3)
    assert tier.store.write(hs, data).result() == [0, 0]
    dropped = tier.store.evict(hs[:1] + hashes(1, 4))  # one held, one never written
    if tier.evicts:
        assert dropped == 1 and tier.store.contains(hs) == [False, True]
    else:  # other workers may still read it: the store's own eviction decides
        assert dropped == 0 and tier.store.contains(hs) == [True, True]
    assert tier.read(hs[1:])[0] == [0]


def _assert_failed_read_is_a_miss(tier, hs, data, bad: int, *, drop: bool | None):
    """Read ``hs`` (block ``bad`` damaged): it fails, the others are served intact."""
    status, got = tier.read(hs)
    assert status[bad] != 0
    for i, s in enumerate(status):
        if i != bad:
            assert s == 0 and torch.equal(got[i * N:(i + 1) * N], data[i * N:(i + 1) * N])
    failure = tier.store.failed_read(status[bad])
    if drop is not None:
        assert failure.drop == drop
    return status[bad]


@pytest.mark.parametrize("fault", ["corrupt", "shorten"])
def test_damaged_block_is_a_miss_never_a_wrong_block(tier, fault):
    damage = getattr(tier, fault)
    if damage is None:
        pytest.skip(f"{tier.store.name} memory holds no checksum: nothing behind the tier's back changes a slot")
    hs, data = hashes(3, 5), blocks(3, 5)
    assert tier.store.write(hs, data).result() == [0, 0, 0]
    damage(hs[1])
    status = _assert_failed_read_is_a_miss(tier, hs, data, 1, drop=True)
    assert status in (DiskStatus.CORRUPT, RemoteStatus.CORRUPT)
    if tier.store.tier == Tier.DISK:  # a block that failed its check is deleted, never served later
        assert tier.store.contains(hs[1:2]) == [False]


def test_missing_block_is_a_miss(tier):
    hs, data = hashes(3, 6), blocks(3, 6)
    assert tier.store.write(hs, data).result() == [0, 0, 0]
    tier.lose(hs[2])
    if tier.store.tier == Tier.HOST:  # no slot holds it any more: no read can name it
        assert tier.store.contains(hs) == [True, True, False]
        with pytest.raises(ValueError, match="slots must be one host slot"):
            tier.read(hs)
        return
    _assert_failed_read_is_a_miss(tier, hs, data, 2, drop=True)


def test_store_error_is_a_miss(tier):
    if tier.break_store is None:
        pytest.skip("host memory has no store to fail; a real server is stopped in test_remote_tier")
    hs, data = hashes(2, 7), blocks(2, 7)
    assert tier.store.write(hs, data).result() == [0, 0]
    tier.break_store()
    _, job = tier.store.read(hs, tier.slots(hs))
    status = job.result()
    assert len(status) == 2 and all(s != 0 for s in status)
    if tier.store.tier == Tier.REMOTE:  # the store is left alone now: later reads are not even tried
        assert status == [RemoteStatus.ERROR] * 2
        assert tier.store.read(hs, [0, 0])[1].result() == [RemoteStatus.UNAVAILABLE] * 2
        assert not tier.store.failed_read(RemoteStatus.UNAVAILABLE).drop  # it may still be there
        assert tier.store.admit(set()) == Admit.SKIP
        assert not tier.store.failed_read(RemoteStatus.ERROR).error  # lossy: counted in remote.stats
    else:
        assert all(tier.store.failed_read(s).error for s in status)


def test_failed_write_is_never_indexed(tier):
    h = hashes(1, 8)
    assert not tier.store.stored(h[0], [3]).indexed
    assert not tier.store.stored(h[0], [-1]).indexed
    assert tier.store.admit(set()) == Admit.YES


def test_host_write_past_capacity_is_refused_not_overwritten():
    index = PrefixIndex()
    store = HostStore(HostTier(2 * N, N, pin=False), lambda: index)
    hs, data = hashes(3, 9), blocks(3, 9)
    status = store.write(hs, data).result()
    assert status[:2] == [0, 0] and status[2] != 0
    assert store.stored(hs[2], status[2:]).refused and store.admit(set()) == Admit.FULL
    buf, job = store.read(hs[:2], [int(index.match([h], [Tier.HOST])[0][Tier.HOST]) for h in hs[:2]])
    assert job.result() == [0, 0] and torch.equal(buf.reshape(-1), data[:2 * N])


def test_remote_value_of_another_block_is_not_served():
    backend = MemoryBackend()
    tier = RemoteTier(backend, META, timeout_s=5.0)
    store = RemoteStore(tier)
    hs, data = hashes(2, 10), blocks(2, 10)
    assert store.write(hs[:1], data[:N]).result() == [0]
    backend.values[tier.key(hs[1])] = backend.values[tier.key(hs[0])]  # a value under the wrong key
    _, job = store.read(hs, [0, 0])
    assert job.result() == [0, RemoteStatus.CORRUPT]
    assert block_format.check(backend.values[tier.key(hs[0])], hs[0], META)
    tier.close()
