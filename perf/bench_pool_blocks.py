"""The pool's cost per block of a prefix, with 1-token blocks (what ``kvtier bench`` runs at its
1/64 token scale: a 6,000-token prompt is 6,000 blocks to match, load and index).

Method: a CPU pool (``page_size`` 1, two layers of ``--row`` fp32 latents, write-back, a host
tier of ``--host-prompts`` prompts, a disk tier with ``--disk``) takes ``--prompts`` cold
prompts of ``--tokens`` tokens each (computed, indexed; the device holds two prompts, so the
older ones are written back to host and, once host is full, spilled to disk), then each of the
last ``--returning`` prompts returns twice with 20 more tokens (its prefix is reused from
device or loaded from host). Every pool call the scheduler makes for a request is timed:
``estimate_prefix`` (ranking), ``begin_prefix`` (match, page takes with their evictions, load
submission), ``wait_prefix`` (loads end, blocks indexed), ``allocate``, ``register_computed``,
``free``. Reported: microseconds per prompt block of each call, cold and returning. The same
run also prints the hit counts, so two versions can be checked to place the same blocks.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from kvtier.cache.config import PoolConfig
from kvtier.cache.kv_state import KVState, TokenList
from kvtier.cache.pool import KVPool
from kvtier.cache.prefix_reuse import PrefixStart


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=6000, help="tokens (= blocks) per prompt")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--returning", type=int, default=3, help="the last prompts that return")
    parser.add_argument("--host-prompts", type=float, default=4.0, help="host tier size, in prompts")
    parser.add_argument("--row", type=int, default=576, help="latent row per token and layer (fp32)")
    parser.add_argument("--disk", action="store_true", help="add a disk tier (host evictions spill to it)")
    args = parser.parse_args()
    n, row = args.tokens, args.row
    pages = 2 * n + 100
    caches = [torch.zeros(pages, 1, row) for _ in range(2)]
    block_bytes = 2 * row * 4
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as disk_dir:
        config = PoolConfig(page_size=1, num_device_pages=pages, write_policy="write-back",
                            host_cache_bytes=int(args.host_prompts * n * block_bytes) + (1 << 20),
                            disk_cache_dir=disk_dir if args.disk else None,
                            disk_cache_bytes=(10 << 30) if args.disk else 0)
        pool = KVPool(config, caches)
        spent: dict[str, float] = {}

        def timed(name, call):
            t0 = time.perf_counter()
            out = call()
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
            return out

        def turn(ids: list[int]) -> int:
            kv = KVState(TokenList(ids))
            timed("estimate", lambda: pool.estimate_prefix(kv))
            start = timed("begin", lambda: pool.begin_prefix(kv, partial=True))
            placed = timed("wait", lambda: pool.wait_prefix(kv) if start is PrefixStart.LOADING
                           else pool.finish_prefix(kv))
            assert timed("allocate", lambda: pool.allocate(kv, len(ids)))
            kv.num_computed_tokens = len(ids)
            timed("register", lambda: pool.register_computed(kv))
            timed("free", lambda: pool.free(kv))
            return placed

        prompts = [[p * 1_000_000 + i for i in range(n)] for p in range(args.prompts)]
        for ids in prompts:
            turn(ids)
        report = [("cold", dict(spent), args.prompts * n)]
        spent.clear()
        placed = []
        for _ in range(2):
            for ids in prompts[-args.returning:]:
                ids += [7] * 20
                placed.append(turn(ids))
        report.append(("returning", dict(spent), sum(len(p) for p in prompts[-args.returning:]) * 2))
        print(f"{args.tokens}-block prompts; placed prefix tokens per return: {placed}; hits by tier: "
              f"{pool.stats().hit_tokens}; evictions: {pool.stats().evictions}")
        pool.close()
        for name, phase, blocks in report:
            calls = " ".join(f"{k} {v / blocks * 1e6:.2f}" for k, v in phase.items())
            print(f"{name:9s} us/block: {calls} | total {sum(phase.values()) / blocks * 1e6:.2f}")


if __name__ == "__main__":
    main()
