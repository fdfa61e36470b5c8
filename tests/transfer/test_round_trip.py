"""Random blocks device -> host -> disk -> host -> device come back bit-identical."""

import pytest
import torch

from kvtier.cache import block_hashes
from kvtier.cache.disk_tier import BlockMeta, DiskStatus, DiskTier
from kvtier.cache.host_tier import HostTier
from kvtier.cache.tiers import DiskFiles
from kvtier.transfer import CopyEngine


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_device_host_disk_round_trip(dtype, tmp_path):
    g = torch.Generator().manual_seed(0)
    layers, pages, page_size, row = 4, 9, 16, 40
    device = [torch.randn(pages, page_size, row, generator=g).to(dtype) for _ in range(layers)]
    meta = BlockMeta.of_pools(device)
    host = HostTier(4 * HostTier.row_bytes(meta.payload_bytes), meta.payload_bytes)
    disk = DiskTier(tmp_path, 1 << 20)
    engine = CopyEngine(num_threads=3, max_queued=8)
    files = DiskFiles(disk, meta, lambda: engine)  # the disk tier's jobs, on the engine's I/O workers
    src_pages, dst_pages = [6, 1, 3, 8], [0, 2, 4, 5]
    hashes = block_hashes(list(range(16 * 4)), 16)
    # device -> host (one job per block, into its own slot)
    slots = [host.allocate() for _ in src_pages]
    for h in [engine.gather(device, [p], host.slot(s)) for p, s in zip(src_pages, slots)]:
        assert h.result() == [0]
    # host -> disk, then clobber the host slots so the way back must come from disk
    for i, s in enumerate(slots):
        assert files.write([hashes[i]], host.slot(s)).result() == [DiskStatus.OK]
    host.storage.zero_()
    # disk -> host -> device
    for i, s in enumerate(slots):
        assert files.read_into([hashes[i]], host.slot(s)).result() == [DiskStatus.OK]
    before = [t.clone() for t in device]
    for h in [engine.scatter(host.slot(s), device, [p]) for p, s in zip(dst_pages, slots)]:
        assert h.result() == [0]
    for layer in range(layers):
        for s_page, d_page in zip(src_pages, dst_pages):
            assert torch.equal(device[layer][d_page].view(torch.uint8), before[layer][s_page].view(torch.uint8))
    assert DiskTier(tmp_path, 1 << 20).blocks() and len(DiskTier(tmp_path, 1 << 20).blocks()) == 4


def test_meta_mismatch_is_refused_and_dropped(tmp_path):
    pools = [torch.zeros(2, 4, 8)]
    meta = BlockMeta.of_pools(pools)
    disk = DiskTier(tmp_path, 1 << 20)
    h = block_hashes(list(range(4)), 4)[0]
    buf = torch.arange(meta.payload_bytes, dtype=torch.uint8)
    assert disk.write(h, meta, buf) == DiskStatus.OK
    other = BlockMeta(meta.num_layers, meta.page_size, meta.row_bytes, meta.dtype + 1, meta.payload_bytes)
    assert disk.read(h, other, torch.empty_like(buf)) == DiskStatus.CORRUPT
    assert disk.read(h, meta, torch.empty_like(buf)) == DiskStatus.MISSING
    with pytest.raises(ValueError, match="at least"):
        disk.write(h, meta, buf[:3])
