"""Copy-engine gather/scatter throughput as a fraction of plain memcpy, measured in one run.

Method: K2-shaped blocks (61 layers x 16-token pages x 576 bf16 values = 1,124,352 B per
block, i.e. 70,272 B per token as docs/kimi.md states) in per-layer page pools of 2x the pages
moved; a batch of ``--blocks`` shuffled pages is gathered into a page-first staging buffer
and scattered back through the native copy engine (one job, one worker thread), against a
single ``memcpy`` of the same number of bytes (``torch.Tensor.copy_`` between two
contiguous uint8 buffers, single-threaded). Each is run once to warm up, then ``--repeats``
times; medians are compared. Source and destination are fresh buffers larger than the L2
cache, so the ratio is memory-bound. Goal (tiered-pool issue): >= 0.7 of memcpy.
"""

from __future__ import annotations

import argparse

import torch

from timing import median_s

from kvtier.transfer import CopyEngine, PagePoolView



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--row", type=int, default=576)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    num_pages = 2 * args.blocks
    pools = [torch.randn(num_pages, args.page_size, args.row).to(torch.bfloat16) for _ in range(args.layers)]
    view = PagePoolView.of(pools)
    pages = torch.randperm(num_pages)[: args.blocks].tolist()
    nbytes = args.blocks * view.block_bytes
    staging = torch.empty(nbytes, dtype=torch.uint8)
    src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    engine = CopyEngine(num_threads=1, max_queued=4)
    memcpy_s = median_s(lambda: dst.copy_(src), args.repeats)
    gather_s = median_s(lambda: engine.gather(pools, pages, staging).result(), args.repeats)
    scatter_s = median_s(lambda: engine.scatter(staging, pools, pages).result(), args.repeats)
    gb = nbytes / 1e9
    print(f"{args.blocks} blocks x {view.block_bytes} B = {nbytes / 2**20:.0f} MiB")
    print(f"memcpy  {gb / memcpy_s:6.2f} GB/s")
    print(f"gather  {gb / gather_s:6.2f} GB/s = {memcpy_s / gather_s:.2f} of memcpy")
    print(f"scatter {gb / scatter_s:6.2f} GB/s = {memcpy_s / scatter_s:.2f} of memcpy")


if __name__ == "__main__":
    main()
