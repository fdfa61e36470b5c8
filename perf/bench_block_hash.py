"""Block-hash throughput: native ``kvtier._C`` vs the pure-Python twin, measured in one run.

Method: one 128K-token sequence of random ids (seed 0), page_size 16 and 64; each
implementation runs once to warm up, then ``--repeats`` times; the median wall time is
reported with the native/Python speed ratio. CPU only; no cache flushing (the input is
512 KiB and the work is hash-bound). Prints a table; ``--csv PATH`` appends rows with
provenance (commit, machine, timestamp).
"""

from __future__ import annotations

import argparse

import numpy as np

from timing import append_csv, median_s

from kvtier.cache import block_hashes, block_hashes_py
from kvtier.provenance import provenance



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128 * 1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--csv", metavar="PATH")
    args = parser.parse_args()
    ids = np.random.default_rng(0).integers(0, 163840, size=args.tokens, dtype=np.int64)
    as_list = ids.tolist()
    prov = provenance()
    rows = []
    for page_size in (16, 64):
        native = median_s(lambda: block_hashes(ids, page_size), args.repeats)
        python = median_s(lambda: block_hashes_py(as_list, page_size), args.repeats)
        rows.append({"op": "block_hashes", "tokens": args.tokens, "page_size": page_size,
                     "native_median_ms": native * 1e3, "python_median_ms": python * 1e3,
                     "native_mtok_s": args.tokens / native / 1e6, "speedup": python / native,
                     "commit": prov["commit"], "timestamp": prov["timestamp"]})
    for r in rows:
        print(f"page_size {r['page_size']:>3}: native {r['native_median_ms']:.2f} ms "
              f"({r['native_mtok_s']:.1f} Mtok/s), python {r['python_median_ms']:.2f} ms, "
              f"native is {r['speedup']:.1f}x faster")
    if args.csv:
        append_csv(args.csv, rows)


if __name__ == "__main__":
    main()
