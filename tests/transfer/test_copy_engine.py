"""Copy engine: gather/scatter round trips through page-first staging, bit-identical."""

import pytest
import torch

from kvtier.transfer import CopyEngine, CopyError, PagePoolView

DTYPES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn]


def pools(num_layers, num_pages, page_size, row, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(num_pages, page_size, row, generator=g).to(dtype) for _ in range(num_layers)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_scatter_round_trip_bit_identical(dtype):
    src = pools(3, 13, 16, 72, dtype, seed=1)
    dst = [torch.zeros_like(p) for p in src]
    engine = CopyEngine(num_threads=2, max_queued=4)
    pages = torch.randperm(13)[:7].tolist()
    view = PagePoolView.of(src)
    staging = torch.empty(len(pages) * view.block_bytes, dtype=torch.uint8)
    assert engine.gather(src, pages, staging).result() == [0] * 7
    for i, p in enumerate(pages):  # page-first: block i = page p of layer 0, 1, 2
        block = staging[i * view.block_bytes:(i + 1) * view.block_bytes].view(dtype).view(3, 16, 72)
        for layer in range(3):
            assert torch.equal(block[layer].view(torch.uint8), src[layer][p].view(torch.uint8))
    targets = [12, 0, 5, 3, 9, 1, 7]
    assert engine.scatter(staging, dst, targets).result() == [0] * 7
    for layer in range(3):
        for p, t in zip(pages, targets):
            assert torch.equal(dst[layer][t].view(torch.uint8), src[layer][p].view(torch.uint8))
        untouched = [q for q in range(13) if q not in targets]
        assert torch.count_nonzero(dst[layer][untouched].view(torch.uint8)) == 0


def test_page_out_of_range_fails_the_job_not_the_process():
    src = pools(2, 4, 4, 8, torch.float32, seed=2)
    engine = CopyEngine()
    staging = torch.empty(2 * PagePoolView.of(src).block_bytes, dtype=torch.uint8)
    handle = engine.gather(src, [1, 4], staging)
    with pytest.raises(CopyError, match=r"pages\[1\] = 4 is outside \[0, 4\)"):
        handle.result()
    assert engine.gather(src, [1, 3], staging).result() == [0, 0]


def test_bad_arguments():
    src = pools(2, 4, 4, 8, torch.float32, seed=3)
    engine = CopyEngine()
    with pytest.raises(ValueError, match="staging holds"):
        engine.gather(src, [0, 1], torch.empty(10, dtype=torch.uint8))
    with pytest.raises(ValueError, match="pools\\[1\\] differs"):
        PagePoolView.of([src[0], src[1][:, :2]])
    with pytest.raises(ValueError, match="num_threads"):
        CopyEngine(num_threads=0)


def test_many_jobs_in_flight_with_back_pressure():
    src = pools(2, 64, 4, 8, torch.float32, seed=4)
    engine = CopyEngine(num_threads=2, max_queued=2)
    block = PagePoolView.of(src).block_bytes
    stagings = [torch.empty(block, dtype=torch.uint8) for _ in range(64)]
    handles = [engine.gather(src, [p], stagings[p]) for p in range(64)]
    assert all(h.result() == [0] for h in handles)
    for p in range(64):
        assert torch.equal(stagings[p][: block // 2].view(torch.float32).view(4, 8), src[0][p])
