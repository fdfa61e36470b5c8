"""MLA and vLLM K/V tier blocks through the remote tier on both stores: bytes equal, keys of one
layout apart from another's, and a value of one layout refused when read as another."""

import pytest
import torch

from kvtier.cache.block_layout import gather_blocks, scatter_blocks
from kvtier.cache.remote import RemoteStatus, block_format, open_backend, open_remote
from tests.helpers.block_layouts import LAYOUTS, NUM_LAYERS, layout_of


@pytest.mark.parametrize("name", ["mla", "kv", "lbhnc"])
def test_round_trip_bytes_equal(any_store, name):
    make, block_dim, _ = LAYOUTS[name]
    layout, caches = layout_of(name), make(seed=7)
    tier = open_remote(any_store.url, layout.meta(), timeout_s=5.0)
    try:
        hs = [bytes([9, ord(name[0]), i]) + bytes(13) for i in range(2)]
        buf = torch.empty(2 * layout.block_bytes, dtype=torch.uint8)
        gather_blocks(caches, block_dim, [3, 0], buf)
        assert tier.put(hs, buf).result() == [RemoteStatus.OK] * 2
        out = torch.zeros_like(buf)
        assert tier.get(hs, out).result() == [RemoteStatus.OK] * 2
        assert torch.equal(out, buf)
        restored = [torch.zeros_like(c) for c in caches]
        scatter_blocks(out, restored, block_dim, [3, 0])
        for layer in range(NUM_LAYERS):
            for b in (3, 0):
                assert torch.equal(restored[layer].select(block_dim, b), caches[layer].select(block_dim, b))
    finally:
        tier.close()


def test_another_layout_is_not_served(any_store):
    mla, kv = layout_of("mla").meta(), layout_of("kv").meta()
    assert mla.payload_bytes == kv.payload_bytes and block_format.key_prefix(mla) != block_format.key_prefix(kv)
    writer, reader = (open_remote(any_store.url, m, timeout_s=5.0) for m in (kv, mla))
    raw = open_backend(any_store.url, 5.0)
    try:
        h = bytes([11]) * 16
        data = torch.randint(0, 256, (kv.payload_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
        assert writer.put([h], data).result() == [RemoteStatus.OK]
        out = torch.zeros_like(data)
        assert reader.get([h], out).result() == [RemoteStatus.MISSING]  # another key namespace
        # the K/V value copied under the MLA key by hand fails the header check
        value = bytearray(writer.value_bytes)
        assert raw.batch_get([writer.key(h)], [memoryview(value)]) == [RemoteStatus.OK]
        assert raw.batch_put([reader.key(h)], [bytes(value)]) == [RemoteStatus.OK]
        assert reader.get([h], out).result() == [RemoteStatus.CORRUPT]
        assert not out.any()
        assert not block_format.check(value, h, mla) and block_format.check(value, h, kv)
    finally:
        raw.close()
        writer.close()
        reader.close()
