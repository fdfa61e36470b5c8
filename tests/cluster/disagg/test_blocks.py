"""The wire format of a transfer: values cut from a stream however it is split, checked, counted."""

import pytest
import torch

from kvtier.cache.disk_tier import BlockMeta
from kvtier.cluster.disagg.blocks import ValueReader, encode_values, value_bytes

META = BlockMeta(num_layers=3, page_size=4, row_bytes=24, dtype=1, payload_bytes=3 * 4 * 24)


def _blocks(n: int):
    hashes = [bytes([i]) * 16 for i in range(n)]
    payload = torch.randint(0, 256, (n * META.payload_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    return hashes, payload


@pytest.mark.parametrize("piece", [1, 7, 64, 1000, 10_000])
def test_values_survive_any_split(piece):
    hashes, payload = _blocks(5)
    wire = encode_values(hashes, payload, META)
    assert len(wire) == 5 * value_bytes(META)
    reader, got = ValueReader(META), []
    for i in range(0, len(wire), piece):
        got += reader.feed(wire[i:i + piece])
    reader.close()
    assert [h for h, _ in got] == hashes
    assert b"".join(p for _, p in got) == payload.numpy().tobytes()
    assert reader.corrupt == reader.truncated == 0


def test_a_flipped_byte_or_a_cut_is_never_served():
    hashes, payload = _blocks(3)
    wire = bytearray(encode_values(hashes, payload, META))
    size = value_bytes(META)
    wire[size + 100] ^= 0xFF  # block 1's payload
    reader = ValueReader(META)
    got = reader.feed(bytes(wire[:-10]))  # block 2 cut short
    reader.close()
    assert [h for h, _ in got] == hashes[:1]
    assert reader.corrupt == 1 and reader.truncated == 1


def test_a_value_of_another_layout_is_corrupt():
    hashes, payload = _blocks(1)
    other = BlockMeta(num_layers=3, page_size=4, row_bytes=24, dtype=2, payload_bytes=META.payload_bytes)
    reader = ValueReader(META)
    assert reader.feed(encode_values(hashes, payload, other)) == []
    assert reader.corrupt == 1
