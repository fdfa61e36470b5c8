"""Disk-tier host<->disk throughput as a fraction of plain sequential disk bandwidth.

Method: ``--blocks`` K2 blocks (61 layers x 64-token pages x 576 bf16 = 4,497,408 B each) of
random bytes. Baseline: one file written sequentially with O_DIRECT in block-sized chunks
from a page-aligned buffer, then fdatasync, then read back the same way (O_DIRECT, so the page
cache serves neither side). Measured: the same bytes as one disk-tier file per block, the disk
tier's jobs on the copy engine's I/O workers (``--threads`` workers, one job per block: the
tier's own O_DIRECT path, CRC-32C checksums, temp file + rename, no fsync; see the
crash-safety note in hip/runtime/disk_tier.h), then read back, checksums verified. The engine's
source and destination buffers are page-aligned (``aligned_empty``), as the pool's host slots
and disk staging buffers are, so O_DIRECT moves them without a bounce copy. Both run in the same
directory (``--dir``, default a temp dir under /tmp) in the same process, after one warm-up
block, ``--rounds`` times alternating (baseline, engine, baseline, ...) because a shared or
virtual disk drifts by tens of percent from second to second; each round's ratio uses that
round's own baseline and the median ratio is reported. Goal (tiered-pool issue): >= 0.8 of the
sequential bandwidth.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvtier.cache import block_hashes
from kvtier.cache.disk_tier import BlockMeta, DiskStatus, DiskTier, aligned_empty
from kvtier.cache.tiers import DiskFiles
from kvtier.transfer import CopyEngine


def sequential(path: Path, block: mmap.mmap, blocks: int) -> tuple[float, float]:
    flags = os.O_CREAT | os.O_WRONLY | os.O_TRUNC | getattr(os, "O_DIRECT", 0)
    t0 = time.perf_counter()
    fd = os.open(path, flags, 0o644)
    for _ in range(blocks):
        os.write(fd, block)
    os.fdatasync(fd)
    os.close(fd)
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    for _ in range(blocks):
        os.readv(fd, [block])
    os.close(fd)
    read_s = time.perf_counter() - t0
    path.unlink()
    return write_s, read_s


def through_engine(directory: Path, payload: torch.Tensor, blocks: int, threads: int) -> tuple[float, float, bool]:
    meta = BlockMeta(61, 64, 576 * 2, 2, payload.numel())
    disk = DiskTier(directory / "tier", capacity_bytes=(blocks + 2) * DiskTier.file_bytes(payload.numel()))
    engine = CopyEngine(num_threads=threads, max_queued=2 * threads)
    files = DiskFiles(disk, meta, lambda: engine)
    hashes = block_hashes(list(range((blocks + 1) * 16)), 16)
    files.write([hashes[-1]], payload).result()  # warm-up
    t0 = time.perf_counter()
    handles = [files.write([h], payload) for h in hashes[:blocks]]
    ok = all(h.result() == [DiskStatus.OK] for h in handles)
    write_s = time.perf_counter() - t0
    outs = [aligned_empty(payload.numel()) for _ in range(threads * 2)]
    t0 = time.perf_counter()
    handles = [files.read_into([h], outs[i % len(outs)]) for i, h in enumerate(hashes[:blocks])]
    ok = ok and all(h.result() == [DiskStatus.OK] for h in handles)
    read_s = time.perf_counter() - t0
    ok = ok and torch.equal(outs[0], payload)
    return write_s, read_s, ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    nbytes = 61 * 64 * 576 * 2
    payload = aligned_empty(nbytes)  # page-aligned, as the pool's staging buffers and host slots
    payload.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    aligned = mmap.mmap(-1, -(-nbytes // 4096) * 4096)
    aligned[:nbytes] = payload.numpy().tobytes()
    total = args.blocks * nbytes / 1e9
    print(f"{args.blocks} blocks x {nbytes} B = {total * 1e3:.0f} MB, {args.threads} copy threads")
    ratios_w, ratios_r, all_ok = [], [], True
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        for r in range(args.rounds):
            seq_w, seq_r = sequential(Path(d) / "sequential.bin", aligned, args.blocks)
            eng_w, eng_r, ok = through_engine(Path(d) / f"round{r}", payload, args.blocks, args.threads)
            all_ok = all_ok and ok
            ratios_w.append(seq_w / eng_w)
            ratios_r.append(seq_r / eng_r)
            print(f"round {r}: sequential write {total / seq_w:5.2f} GB/s read {total / seq_r:5.2f} GB/s | "
                  f"engine write {total / eng_w:5.2f} GB/s ({ratios_w[-1]:.2f}) read {total / eng_r:5.2f} GB/s "
                  f"({ratios_r[-1]:.2f}) verified={ok}")
    print(f"median of {args.rounds} rounds: copy engine write {statistics.median(ratios_w):.2f} of sequential, "
          f"read {statistics.median(ratios_r):.2f} of sequential, all verified={all_ok}")

if __name__ == "__main__":
    main()
