"""The remote tier on both backends: round trip, header and checksum checks, misses, a dead store."""

import time

import pytest
import torch

from kvtier.cache.disk_tier import BlockMeta
from kvtier.cache.remote import RemoteStatus, block_format, check_remote_url, open_backend, open_remote
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


@pytest.mark.parametrize("start", [start_redis, start_mooncake], ids=["redis", "mooncake"])
def test_dead_store_gives_counted_misses_within_the_timeout(tmp_path, start):
    store = start(tmp_path)
    tier = open_remote(store.url, META, timeout_s=0.5)
    try:
        hs, data = hashes(2, 5), blocks(2, 5)
        assert tier.put(hs, data).result() == [RemoteStatus.OK] * 2
        store.stop()
        t0 = time.monotonic()
        out = torch.zeros_like(data)
        got = tier.get(hs, out).result()
        assert all(s != RemoteStatus.OK for s in got)
        assert tier.exists(hs) == [False, False]
        assert tier.put(hs, data).result() != [RemoteStatus.OK] * 2
        assert time.monotonic() - t0 < 10 * tier.timeout_s + 5  # bounded, not a hang
        assert tier.stats.misses == 2 and not tier.available()
    finally:
        tier.close()
        store.stop()


def test_unreachable_store_names_the_url():
    with pytest.raises(RuntimeError, match="redis://127.0.0.1:1"):
        open_backend("redis://127.0.0.1:1", 0.5)


@pytest.mark.parametrize("url", ["http://x:1", "redis://host", "redis:/nohost", 7, "mooncake://:5"])
def test_bad_urls_are_named(url):
    with pytest.raises(ValueError, match="remote_cache_url"):
        check_remote_url("remote_cache_url", url)
