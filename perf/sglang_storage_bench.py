"""kvtier's HiCache storage backend beside SGLang's ``file`` backend (and ``mori``, where it
builds), on the same page-path workload: pages/s and bytes/s for set, exists and get.

Run in SGLang's venv (scripts/setup_sglang.sh) with this checkout on the path:

    PYTHONPATH=python:. .sglang-venv/bin/python perf/sglang_storage_bench.py --json perf/results/sglang_storage_bench.json

Method: one SGLang ``MLATokenToKVPoolHost`` (page_first, bf16, Kimi K2's 576-wide row,
``--layers`` layers, ``--page-size`` tokens per page) filled with random values; ``--pages``
pages are moved through SGLang's cache controller's own page paths in batches of
``STORAGE_BATCH_SIZE`` (128) pages, as its backup and prefetch threads move them: ``set`` =
``_generic_page_set`` or ``_page_set_zero_copy``, ``exists`` = ``batch_exists`` over the keys,
``get`` = ``_generic_page_get`` or ``_page_get_zero_copy``. Each backend gets a fresh directory
under ``--dir`` (the same filesystem for all) and fresh keys per repeat; the pages read back are
checked byte for byte against the pool's before timing counts. ``--repeats`` rounds, backends
interleaved within a round (so drift of a shared disk spreads over all); the median of the rounds
is reported. Page cache: SGLang's ``file`` backend reads and writes through the page cache;
kvtier's disk tier uses O_DIRECT where the filesystem accepts it (its reads come from the disk,
not from memory), so on the disk rows kvtier pays the device's speed and ``file`` may not. The
``host`` rows add kvtier's host slots in front of the disk (their reads are memory copies).
Warm-up: one round of 16 pages per backend, not reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT)]

import torch  # noqa: E402
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE, HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage import backend_factory  # noqa: E402

from tests.helpers.sglang_pools import fill, mla_pool, page_bytes  # noqa: E402

OPERATION = SimpleNamespace(request_id="bench", is_terminated=lambda: False)


def _config(extra: dict) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name="moonshotai/Kimi-K2", extra_config=extra)


def _kvtier(extra: dict) -> dict:
    return {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang", "class_name": "KvtierStorage",
            "interface_v1": 1, **extra}


def backends(root: Path, page: int, pages: int) -> dict:
    """name -> (factory name, extra config, path: 'generic' or 'zero_copy')."""
    disk = {"disk_cache_bytes": 4 * pages * (page + 8192)}
    return {
        "sglang file": ("file", lambda d: {"file_storage_path": str(d)}, "generic"),
        "kvtier disk, generic": ("dynamic", lambda d: _kvtier({"disk_cache_dir": str(d), **disk}), "generic"),
        "kvtier disk, zero copy": ("dynamic", lambda d: _kvtier({"disk_cache_dir": str(d), **disk}), "zero_copy"),
        "kvtier host+disk, zero copy": ("dynamic", lambda d: _kvtier({
            "host_cache_bytes": 2 * pages * (page + 4096), "disk_cache_dir": str(d), **disk}), "zero_copy"),
    }


def mori_error() -> str:
    """What building SGLang's ``mori`` backend (UMBPStore) says here."""
    try:
        backend_factory.StorageBackendFactory.create_backend("mori", _config({}), None)
    except BaseException as e:  # noqa: BLE001 - the exact error is the result
        return f"{type(e).__name__}: {e}"
    return ""


def run_once(kind: str, extra: dict, via: str, pool, pages: int, page: int, check: bool) -> dict:
    store = backend_factory.StorageBackendFactory.create_backend(kind, _config(extra), pool)
    store.register_mem_pool_host(pool)
    ctrl = SimpleNamespace(storage_backend=store, storage_host_pool=pool, page_size=pool.page_size)
    page_set = HiCacheController._page_set_zero_copy if via == "zero_copy" else HiCacheController._generic_page_set
    page_get = HiCacheController._page_get_zero_copy if via == "zero_copy" else HiCacheController._generic_page_get
    ps, slots = pool.page_size, pool.size // pool.page_size - 1
    keys = [uuid.uuid4().hex for _ in range(pages)]
    batches = [(keys[i:i + STORAGE_BATCH_SIZE],
                torch.cat([torch.arange((p % slots) * ps, (p % slots + 1) * ps)
                           for p in range(i, min(i + STORAGE_BATCH_SIZE, pages))]))
               for i in range(0, pages, STORAGE_BATCH_SIZE)]
    expected = [page_bytes(pool, (p % slots) * ps) for p in range(min(pages, slots))] if check else []
    t = {}
    t0 = time.perf_counter()
    for k, idx in batches:
        assert page_set(ctrl, k, idx), f"{kind}: a set failed"
    t["set"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    found = sum(store.batch_exists(k) for k, _ in batches)
    t["exists"] = time.perf_counter() - t0
    assert found == pages, f"{kind}: exists found {found} of {pages}"
    pool.kv_buffer.zero_()
    t0 = time.perf_counter()
    got = sum(page_get(ctrl, OPERATION, k, idx) for k, idx in batches)
    t["get"] = time.perf_counter() - t0
    assert got == pages, f"{kind}: get loaded {got} of {pages}"
    if check:  # the last batch's pages are what the pool holds now
        last = batches[-1][1][::ps].tolist()
        for start in last:
            assert torch.equal(page_bytes(pool, start), expected[start // ps]), f"{kind}: wrong bytes"
    fill(pool, seed=1)
    if hasattr(store, "close"):
        store.close()
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the backends' files go (default: a temp dir under build/)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    pool = mla_pool("page_first", page_size=args.page_size, layers=args.layers, tokens=256 * args.page_size)
    fill(pool, seed=1)
    page = page_bytes(pool, 0).numel()
    base = Path(args.dir or tempfile.mkdtemp(prefix="sglang-bench-", dir=ROOT / "build"))
    table = backends(base, page, args.pages)
    rounds: dict[str, list[dict]] = {name: [] for name in table}
    for r in range(args.repeats + 1):
        for name, (kind, extra, via) in table.items():
            d = base / f"{name.replace(' ', '_').replace(',', '').replace('+', '_')}-{r}"
            n = 16 if r == 0 else args.pages
            t = run_once(kind, extra(d), via, pool, n, page, check=True)
            shutil.rmtree(d, ignore_errors=True)
            if r:
                rounds[name].append(t)
    rows = []
    for name, ts in rounds.items():
        row = {"backend": name, "path": table[name][2]}
        for op in ("set", "exists", "get"):
            s = statistics.median(t[op] for t in ts)
            row[f"{op}_pages_per_s"] = args.pages / s
            row[f"{op}_MB_per_s"] = args.pages * page / s / 1e6 if op != "exists" else None
            row[f"{op}_s_rounds"] = [t[op] for t in ts]
        rows.append(row)
    import sglang
    result = {"pages": args.pages, "page_bytes": page, "layers": args.layers, "page_size": args.page_size,
              "repeats": args.repeats, "dir": str(base), "rows": rows, "mori": mori_error() or "built",
              "sglang": sglang.__version__, "torch": torch.__version__, "host": platform.node(),
              "cpus": os.cpu_count(),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True).stdout.strip(),
              "command": " ".join([Path(sys.executable).name, *sys.argv])}
    print(f"{args.pages} pages of {page:,} B (MLA page_first, {args.layers} layers x {args.page_size} tokens "
          f"x 576 bf16), median of {args.repeats}; sglang {sglang.__version__}")
    print("| backend | set pages/s | set MB/s | exists pages/s | get pages/s | get MB/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['backend']} | {r['set_pages_per_s']:,.0f} | {r['set_MB_per_s']:,.0f} | "
              f"{r['exists_pages_per_s']:,.0f} | {r['get_pages_per_s']:,.0f} | {r['get_MB_per_s']:,.0f} |")
    print(f"mori: {result['mori']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
