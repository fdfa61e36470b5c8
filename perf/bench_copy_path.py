"""Copy bandwidth of the device copy path vs the pinned host<->device bandwidth, measured in one run;
with ``--bench-json``, the serving summary of the GPU check (p99 TTFT, throughput, hit rates per tier).

Method: (1) pinned bandwidth, the physical limit: one ``--mib`` MiB copy between a pinned host
buffer and device memory each way, wall time of the copy and a device synchronise, median of
``--repeats`` after one warm-up; (2) the copy path: ``--blocks`` page-first blocks of the model
preset's layout (a page of ``--page-size`` tokens of every layer) moved between device page pools
and a pinned host arena by :class:`kvtier.cache.device_copy.DeviceCopyEngine`, all jobs in
flight, then waited for: gather (device -> host, write-through) and scatter (host -> device, a
load), once with one block per job (as the pool submits them today) and once with every block
in one job (what batching the pool's jobs would reach); wall time from the first submit to the
last completion, median of ``--repeats`` after one warm-up. Pages are shuffled (a pool's pages
are never in order). Seeds: torch 0.

``--dry-run``: the CPU, the tiny preset, small sizes; every line still runs.

Writes CSV rows (``path, direction, blocks_per_job, block_bytes, blocks, median_s, gbps, pinned_gbps, fraction,
device, torch, commit, timestamp``) and, with ``--summary``, a markdown summary.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import time
from datetime import datetime, timezone

import torch
from timing import append_csv, median_s

from kvtier.cache.device_copy import DeviceCopyEngine
from kvtier.cache.host_tier import HostTier
from kvtier.model.config import preset


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pinned_gbps(device: torch.device, nbytes: int, repeats: int) -> dict[str, float]:
    """GB/s of one ``nbytes`` copy host->device and device->host from pinned memory."""
    pin = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for name, dst, src in (("host->device", dev, host), ("device->host", host, dev)):
        def once(dst=dst, src=src):
            dst.copy_(src, non_blocking=True)
            _sync(device)
        out[name] = nbytes / median_s(once, repeats) / 1e9
    return out


def copy_path_s(engine: DeviceCopyEngine, pools, host: HostTier, pages: list[int], gather: bool,
                per_job: int) -> float:
    """Seconds to move one block per page through ``engine`` in jobs of ``per_job`` blocks (all
    in flight, then waited for); a job of several blocks uses consecutive host slots."""
    _sync(engine.device)
    t0 = time.perf_counter()
    handles = []
    for i in range(0, len(pages), per_job):
        chunk, slots = pages[i:i + per_job], host.storage[i:i + per_job]
        buf = slots.reshape(-1) if slots.is_contiguous() else slots.contiguous().reshape(-1)
        handles.append(engine.gather(pools, chunk, buf) if gather else engine.scatter(buf, pools, chunk))
    for h in handles:
        h.result()
    _sync(engine.device)
    return time.perf_counter() - t0


def measure(args) -> list[dict]:
    device = torch.device(args.device)
    config = preset(args.model)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    pools = [torch.zeros(args.blocks * 2, args.page_size, config.kv_cache_dim, dtype=dtype, device=device)
             for _ in range(config.num_hidden_layers)]
    block_bytes = config.num_hidden_layers * args.page_size * config.kv_cache_dim * dtype.itemsize
    host = HostTier(args.blocks * HostTier.row_bytes(block_bytes), block_bytes, pin=device.type == "cuda")
    engine = DeviceCopyEngine(device)
    pages = torch.randperm(args.blocks * 2, generator=torch.Generator().manual_seed(0))[:args.blocks].tolist()
    pinned = pinned_gbps(device, args.mib << 20, args.repeats)
    rows = []
    for (direction, gather), per_job in itertools.product((("device->host", True), ("host->device", False)),
                                                          (1, args.blocks)):
        times = [copy_path_s(engine, pools, host, pages, gather, per_job) for _ in range(args.repeats + 1)][1:]
        med = statistics.median(times)
        gbps = args.blocks * block_bytes / med / 1e9
        rows.append(dict(path="device_copy", direction=direction, blocks_per_job=per_job, block_bytes=block_bytes,
                         blocks=args.blocks,
                         median_s=f"{med:.6f}", gbps=f"{gbps:.2f}", pinned_gbps=f"{pinned[direction]:.2f}",
                         fraction=f"{gbps / pinned[direction]:.3f}", **_provenance(device)))
    return rows


def _provenance(device: torch.device) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return dict(device=name, torch=torch.__version__, commit=commit,
                timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"))


def serving_lines(bench_json: str) -> list[str]:
    """Markdown table of ``kvtier bench --json``: p99 TTFT, throughput, hit rate per tier."""
    data = json.load(open(bench_json))
    lines = ["| config | p99 TTFT s | throughput tok/s | hit device | hit host | hit disk | copy errors |",
             "|---|---|---|---|---|---|---|"]
    fmt = lambda v: "n/a" if v is None else f"{v:.3g}"  # noqa: E731
    for name, c in data["configs"].items():
        hr = c["hit_rate"]
        lines.append(f"| {name} | {fmt(c['ttft_s']['p99'])} | {fmt(c['throughput_tok_s'])} | {fmt(hr['device'])} "
                     f"| {fmt(hr['host'])} | {fmt(hr['disk'])} | {c['copy_errors']} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="k2-gpu", help="preset whose block layout is copied")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--blocks", type=int, default=512)
    p.add_argument("--mib", type=int, default=256, help="MiB of the pinned bandwidth copy")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--csv", default=None)
    p.add_argument("--bench-json", default=None, help="kvtier bench --json output to summarise")
    p.add_argument("--summary", default=None, help="write the markdown summary here")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny preset, small sizes")
    args = p.parse_args(argv)
    if args.dry_run:
        args.device, args.model, args.blocks, args.mib, args.repeats = "cpu", "tiny", 16, 4, 2
    rows = measure(args)
    if args.csv:
        append_csv(args.csv, rows)
    lines = ["Copy path vs pinned host<->device bandwidth (same run; goal: fraction >= 0.8):", "",
             "| direction | block bytes | blocks | blocks per job | copy path GB/s | pinned GB/s | fraction |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['direction']} | {r['block_bytes']} | {r['blocks']} | {r['blocks_per_job']} | {r['gbps']} "
              f"| {r['pinned_gbps']} "
              f"| {r['fraction']} |" for r in rows]
    if args.bench_json:
        lines += ["", f"Serving, built-in workload ({args.bench_json}):", ""] + serving_lines(args.bench_json)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.summary:
        with open(args.summary, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
