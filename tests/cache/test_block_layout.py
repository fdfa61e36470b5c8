"""The layout-generic tier block format: MLA pages and vLLM's K/V pages through host and disk tiers,
bytes equal, and a block of one layout never read as another (the remote tier: tests/cache/remote)."""

import pytest
import torch

from kvtier.cache.block_layout import BlockLayout, gather_blocks, layout_code, layout_name, scatter_blocks
from kvtier.cache.tiers.disk_budget import namespace_dir
from kvtier.cache.disk_tier import BlockMeta, DiskStatus, DiskTier, aligned_empty
from kvtier.cache.host_tier import HostTier
from kvtier.transfer import CopyEngine
from tests.helpers.block_layouts import LAYOUTS, NUM_LAYERS, PAGE, kv_caches, layout_of, mla_caches


def test_mla_meta_is_the_page_first_meta_of_the_pool():
    pools = mla_caches(dtype=torch.bfloat16)
    layout = BlockLayout.of_caches(pools, block_dim=0, token_dim=0)
    assert layout.meta() == BlockMeta.of_pools(pools)
    assert layout.code == 0 and layout.page_shape == (PAGE, 48)


def test_kv_layout_meta_and_names_differ_from_mla_of_equal_bytes():
    mla, kv = layout_of("mla"), layout_of("kv")
    assert kv.page_shape == (2, PAGE, 2, 12) and kv.page_size == PAGE
    assert (mla.block_bytes, mla.meta().row_bytes) == (kv.block_bytes, kv.meta().row_bytes) == (
        NUM_LAYERS * PAGE * 48 * 4, 48 * 4)
    assert kv.code == layout_code((2, PAGE, 2, 12), 1) and 0 < kv.code < 1 << 24
    assert kv.meta().dtype & 0xFF == mla.meta().dtype == 1 and kv.meta() != mla.meta()
    assert layout_name(mla.meta()) == f"kv-2l-{PAGE}p-192r-1d"
    assert layout_name(kv.meta()) == f"kv-2l-{PAGE}p-192r-1d-{kv.code:06x}s"
    assert namespace_dir("/c", b"s", mla.meta()) != namespace_dir("/c", b"s", kv.meta())
    # another head split with the same bytes is another layout too
    assert BlockLayout(2, (2, PAGE, 4, 6), 1, torch.float32).meta() != kv.meta()


def test_vllm_mla_page_is_kvtiers_page_first_page():
    """vLLM's MLA view [num_blocks, 1, block_size, 576] holds the bytes of kvtier's [num_blocks,
    block_size, 576] pages in the same order: one layout, one meta."""
    pools = mla_caches(dtype=torch.bfloat16)
    vllm_view = [p.unsqueeze(1) for p in pools]
    assert BlockLayout.of_caches(vllm_view, 0, 1).meta() == BlockMeta.of_pools(pools)
    a, b = (torch.empty(2 * BlockMeta.of_pools(pools).payload_bytes, dtype=torch.uint8) for _ in range(2))
    gather_blocks(pools, 0, [2, 5], a)
    gather_blocks(vllm_view, 0, [2, 5], b)
    assert torch.equal(a, b)


def test_lbhnc_layout_is_its_own():
    lbhnc = layout_of("lbhnc")
    assert lbhnc.page_shape == (2, PAGE, 24) and lbhnc.page_size == PAGE
    assert lbhnc.meta() not in (layout_of("kv").meta(), layout_of("mla").meta())


@pytest.mark.parametrize("name", ["mla", "kv", "lbhnc"])
def test_gather_scatter_round_trip(name):
    make, block_dim, _ = LAYOUTS[name]
    src, dst = make(seed=1), [torch.zeros_like(c) for c in make()]
    layout = layout_of(name)
    buf = torch.empty(3 * layout.block_bytes, dtype=torch.uint8)
    gather_blocks(src, block_dim, [4, 0, 2], buf)
    blocks = buf.view(torch.float32).view(3, NUM_LAYERS, *layout.page_shape)
    for i, b in enumerate([4, 0, 2]):
        for layer in range(NUM_LAYERS):
            assert torch.equal(blocks[i, layer], src[layer].select(block_dim, b))
    scatter_blocks(buf, dst, block_dim, [1, 5, 3])
    for layer in range(NUM_LAYERS):
        for a, b in [(4, 1), (0, 5), (2, 3)]:
            assert torch.equal(dst[layer].select(block_dim, b), src[layer].select(block_dim, a))
        assert not dst[layer].select(block_dim, 0).any()  # untouched blocks stay as they were


def test_mla_gather_is_the_copy_engines_page_first_bytes():
    pools = mla_caches(seed=2)
    meta = BlockMeta.of_pools(pools)
    ours, native = (torch.empty(2 * meta.payload_bytes, dtype=torch.uint8) for _ in range(2))
    gather_blocks(pools, 0, [3, 1], ours)
    engine = CopyEngine(1)
    assert engine.gather(pools, [3, 1], native).result() == [0, 0]
    assert torch.equal(ours, native)


def test_bad_layouts_and_buffers_are_refused():
    with pytest.raises(ValueError, match="token_dim"):
        BlockLayout(2, (PAGE, 48), 2, torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        BlockLayout(2, (PAGE, 48), 0, torch.int32)
    with pytest.raises(ValueError, match="caches\\[1\\]"):
        BlockLayout.of_caches([kv_caches()[0], mla_caches()[0]], 1, 1)
    with pytest.raises(ValueError, match="at least"):
        gather_blocks(kv_caches(), 1, [0, 1], torch.empty(10, dtype=torch.uint8))
    with pytest.raises(ValueError, match="distinct"):
        scatter_blocks(torch.empty(2 * layout_of("kv").block_bytes, dtype=torch.uint8), kv_caches(), 1, [0, 0])


@pytest.mark.parametrize("name", ["mla", "kv", "lbhnc"])
def test_host_tier_round_trip(name):
    make, block_dim, _ = LAYOUTS[name]
    layout, caches = layout_of(name), make(seed=3)
    host = HostTier(4 * HostTier.row_bytes(layout.block_bytes), layout.block_bytes, pin=False)
    blocks = torch.empty(2, layout.block_bytes, dtype=torch.uint8)
    gather_blocks(caches, block_dim, [5, 2], blocks)
    slots = [host.allocate(), host.allocate()]
    host.write(slots, blocks)
    out = [torch.zeros_like(c) for c in caches]
    scatter_blocks(host.read(slots), out, block_dim, [5, 2])
    for layer in range(NUM_LAYERS):
        assert torch.equal(out[layer].index_select(block_dim, torch.tensor([5, 2])),
                           caches[layer].index_select(block_dim, torch.tensor([5, 2])))


@pytest.mark.parametrize("name", ["mla", "kv", "lbhnc"])
def test_disk_tier_round_trip_and_another_layout_refused(name, tmp_path):
    make, block_dim, _ = LAYOUTS[name]
    layout, caches = layout_of(name), make(seed=4)
    other = layout_of("kv" if name == "mla" else "mla").meta()
    meta = layout.meta()
    disk = DiskTier(namespace_dir(tmp_path, b"salt", meta), 1 << 20)
    buf = aligned_empty(layout.block_bytes)
    gather_blocks(caches, block_dim, [1], buf)
    h = bytes(range(16))
    assert disk.write(h, meta, buf) == DiskStatus.OK
    assert disk.blocks() == [(h, meta)]
    # a restarted tier finds the block with its layout
    again = DiskTier(namespace_dir(tmp_path, b"salt", meta), 1 << 20)
    assert again.blocks() == [(h, meta)]
    out = aligned_empty(layout.block_bytes).zero_()
    assert again.read(h, meta, out) == DiskStatus.OK
    assert torch.equal(out, buf)
    restored = [torch.zeros_like(c) for c in caches]
    scatter_blocks(out, restored, block_dim, [1])
    assert all(torch.equal(r.select(block_dim, 1), c.select(block_dim, 1)) for r, c in zip(restored, caches))
    # read as the other layout (same byte count): refused, never served
    assert other.payload_bytes == meta.payload_bytes
    assert again.read(h, other, aligned_empty(layout.block_bytes)) == DiskStatus.CORRUPT
    assert not again.contains(h)
