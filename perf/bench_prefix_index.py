"""Prefix-index throughput at 1M blocks: insert, longest-prefix match, touch.

Method: 1,048,576 distinct block hashes (chains of 1024 blocks from random tokens, seed 0)
are inserted into the host tier one call per block (the Python binding's per-call cost is
included: this is what a Python scheduler pays); then every chain is matched whole
(``match`` of 1024 hashes per call) and touched. Each phase runs once after the index is
built; times are wall-clock medians of ``--repeats`` runs of the match and touch phases.
Goal (the tiered-pool issue): >= 1M matched blocks per second.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvtier.cache import PrefixIndex, Tier, block_hashes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=1 << 20)
    parser.add_argument("--chain", type=int, default=1024, help="blocks per matched chain")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    chains = []
    for _ in range(args.blocks // args.chain):
        tokens = rng.integers(0, 163840, size=args.chain * 16, dtype=np.int64)
        chains.append(block_hashes(tokens, 16))
    idx = PrefixIndex(max_events=1024)
    t0 = time.perf_counter()
    slot = 0
    for ch in chains:
        for h in ch:
            idx.insert(h, Tier.HOST, slot)
            slot += 1
    insert_s = time.perf_counter() - t0
    assert idx.num_blocks() == slot

    def match_all():
        total = 0
        for ch in chains:
            total += idx.match(ch).shape[0]
        assert total == slot

    def touch_all():
        for ch in chains:
            idx.touch(ch)

    def median(fn):
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    match_s, touch_s = median(match_all), median(touch_all)
    print(f"blocks {slot}: insert {slot / insert_s / 1e6:.2f} M/s (one call per block), "
          f"match {slot / match_s / 1e6:.2f} M blocks/s, touch {slot / touch_s / 1e6:.2f} M blocks/s "
          f"({args.chain} blocks per call)")


if __name__ == "__main__":
    main()
