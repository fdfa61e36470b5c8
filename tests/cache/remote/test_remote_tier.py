"""The remote tier on both backends: round trip, header and checksum checks, misses, a dead store."""

import threading

import pytest
import torch

from kvtier.cache.disk_tier import BlockMeta
from kvtier.cache.remote import RemoteStatus, RemoteTier, block_format, check_remote_url, open_backend, open_remote
from tests.stores import start_mooncake, start_redis

META = BlockMeta(num_layers=2, page_size=4, row_bytes=48, dtype=1, payload_bytes=2 * 4 * 48)


def blocks(n, seed):
    return torch.randint(0, 256, (n * META.payload_bytes,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def hashes(n, seed):
    return [bytes([seed, i]) + bytes(14) for i in range(n)]


def test_round_trip(any_store):
    tier = open_remote(any_store.url, META, timeout_s=5.0)
    try:
        hs, data = hashes(3, 1), blocks(3, 1)
        assert tier.put(hs, data).result() == [RemoteStatus.OK] * 3
        assert tier.exists(hs + hashes(1, 2)) == [True, True, True, False]
        out = torch.zeros_like(data)
        assert tier.get(hs, out).result() == [RemoteStatus.OK] * 3
        assert torch.equal(out, data)
        assert tier.stats.gets["ok"] == 3 and tier.stats.puts["ok"] == 3
    finally:
        tier.close()


def test_missing_and_corrupt_values_are_misses(any_store):
    tier = open_remote(any_store.url, META, timeout_s=5.0)
    try:
        hs, data = hashes(3, 3), blocks(3, 3)
        assert tier.put(hs[:1], data).result() == [RemoteStatus.OK]
        payload = data[META.payload_bytes:2 * META.payload_bytes].numpy().tobytes()
        bad = bytearray(block_format.header(hs[1], META, payload) + payload)
        bad[-1] ^= 0x10  # one bit flipped in block 1's stored payload
        writer = open_backend(any_store.url, 5.0)  # a store does not check what it holds
        assert writer.batch_put([tier.key(hs[1])], [bytes(bad)]) == [RemoteStatus.OK]
        out = torch.zeros_like(data)
        got = tier.get(hs, out).result()
        assert got == [RemoteStatus.OK, RemoteStatus.CORRUPT, RemoteStatus.MISSING]
        assert torch.equal(out[:META.payload_bytes], data[:META.payload_bytes])
        assert tier.stats.misses == 2
        writer.close()  # after the read: a Mooncake client's values may live in its own segment
    finally:
        tier.close()


def test_header_rejects_another_layout_or_hash():
    payload = bytes(range(256)) * (META.payload_bytes // 256) + bytes(META.payload_bytes % 256)
    value = block_format.header(b"h" * 16, META, payload) + payload
    assert block_format.check(value, b"h" * 16, META)
    assert not block_format.check(value, b"g" * 16, META)
    assert not block_format.check(value[:-1], b"h" * 16, META)
    other = BlockMeta(2, 4, 48, 2, META.payload_bytes)
    assert not block_format.check(value, b"h" * 16, other)
    flipped = bytearray(value)
    flipped[100] ^= 1
    assert not block_format.check(bytes(flipped), b"h" * 16, META)


def test_crc32c_matches_the_disk_tiers_checksum():
    assert block_format.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value


FAILED = {RemoteStatus.ERROR, RemoteStatus.TIMEOUT, RemoteStatus.UNAVAILABLE}


@pytest.mark.parametrize("start", [start_redis, start_mooncake], ids=["redis", "mooncake"])
def test_dead_store_gives_counted_misses_and_is_left_alone(tmp_path, start):
    store = start(tmp_path)
    tier = open_remote(store.url, META, timeout_s=0.5)
    try:
        hs, data = hashes(2, 5), blocks(2, 5)
        assert tier.put(hs, data).result() == [RemoteStatus.OK] * 2
        store.stop()
        out = torch.zeros_like(data)
        got = tier.get(hs, out).result()
        assert set(got) <= FAILED  # failed or abandoned at the timeout, never a hit
        assert not tier.available()  # the failed call left the store alone for retry_after_s ...
        assert tier.exists(hs) == [False, False]
        assert tier.put(hs, data).result() == [RemoteStatus.UNAVAILABLE] * 2  # ... so it is not called again
        assert tier.stats.misses == 2 and tier.stats.puts["unavailable"] == 2
        assert not torch.any(out)  # nothing from the dead store was served
    finally:
        tier.close()
        store.stop()


class HungBackend:
    """A store whose calls never return until released (a master that accepts and never answers)."""

    url = "hung://test"

    def __init__(self):
        self.release = threading.Event()
        self.calls = 0

    def _hang(self):
        self.calls += 1
        self.release.wait()
        raise ConnectionError("released")

    def batch_put(self, keys, values):
        return self._hang()

    def batch_get(self, keys, outs):
        return self._hang()

    def exists(self, keys):
        return self._hang()

    def close(self):
        self.release.set()


def test_a_hung_store_call_is_abandoned_at_the_timeout():
    backend = HungBackend()
    tier = RemoteTier(backend, META, timeout_s=0.2, retry_after_s=60.0)
    try:
        out = torch.zeros(2 * META.payload_bytes, dtype=torch.uint8)
        handle = tier.get(hashes(2, 7), out)
        assert handle.result() == [RemoteStatus.TIMEOUT] * 2  # returned while the call still hangs
        assert not backend.release.is_set() and backend.calls == 1
        assert tier.stats.gets["timeout"] == 2 and tier.stats.misses == 2 and not tier.available()
        again = tier.get(hashes(2, 7), out).result()
        assert again == [RemoteStatus.UNAVAILABLE] * 2 and backend.calls == 1  # left alone: not called again
    finally:
        tier.close()


def test_unreachable_store_names_the_url():
    with pytest.raises(RuntimeError, match="redis://127.0.0.1:1"):
        open_backend("redis://127.0.0.1:1", 0.5)


@pytest.mark.parametrize("url", ["http://x:1", "redis://host", "redis:/nohost", 7, "mooncake://:5"])
def test_bad_urls_are_named(url):
    with pytest.raises(ValueError, match="remote_cache_url"):
        check_remote_url("remote_cache_url", url)
