"""The cache configurations ``kvtier bench`` compares, and how they are sized.

- ``device-only``: prefix caching in device pages only, LRU: what engines do by default.
- ``tiered``: device pages, then host memory, then disk, with the probed cost model deciding
  what to load and what to recompute; LRU; write-back (a block is copied down a tier when it is
  evicted from the one above).
- ``tiered-write-through``: ``tiered`` with write-through (every full block is copied down at
  once, so an eviction never waits for a copy).
- ``tiered-tool-aware``: ``tiered`` with the tool-aware policy, told about tool waits.
- ``no-cache``: no prefix caching at all (every prompt is prefilled in full).
- ``ideal``: the bound: ``device-only`` with device pages for the whole working set (every page
  the replay ever caches, :func:`kvtier.bench.closed_loop.whole_working_set_pages`), so nothing is
  evicted and no request is preempted for lack of pages; the same engine, scheduler and sampler.
  What no cache can beat on this workload: each configuration's distance to it
  (:func:`kvtier.bench.report.bench_json`'s ``bound``) is what a cache could still gain.

A hybrid KDA + MLA model (``--model tiny-k3``) runs every configuration: its pool keeps
recurrent-state checkpoints beside the MLA blocks (:mod:`kvtier.cache.checkpoints.reuse`), and a prefix
is reused only up to a boundary where both are reachable. ``device-only`` then keeps the MLA
blocks in device pages and the checkpoints in device checkpoint slots (what an engine does by
default); ``tiered`` adds the host and disk tiers for both. Each tier's checkpoint budget is
its KV budget unless ``--state-device-bytes`` / ``--state-host-bytes`` / ``--state-disk-bytes``
say otherwise; a configuration without a host or disk tier has no checkpoints there either.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvtier.serve.config import EngineConfig


@dataclass(frozen=True)
class BenchConfig:
    """One cache configuration.

    Attributes:
        name: as given to ``--configs``.
        enable_prefix_caching: reuse cached blocks at all.
        host: use a host-memory tier (sized by the bench's ``host_cache_bytes``).
        disk: use a disk tier (in a fresh directory per run).
        cache_policy: ``lru`` or ``tool-aware``.
        cache_write_policy: ``write-through`` or ``write-back``.
        tool_aware: the replay tells the pool about tool waits.
        whole_working_set: device pages for the whole working set (the ``ideal`` bound) instead
            of the bench's device tier.
    """

    name: str
    enable_prefix_caching: bool = True
    host: bool = False
    disk: bool = False
    cache_policy: str = "lru"
    cache_write_policy: str = "write-back"
    tool_aware: bool = False
    whole_working_set: bool = False

    def engine_config(self, base: EngineConfig, host_cache_bytes: int, disk_dir: str | None,
                      disk_cache_bytes: int, whole_working_set_pages: int | None = None) -> EngineConfig:
        """``base`` with this configuration's pool fields.

        ``base.pool`` carries a hybrid model's checkpoint options (grid spacing and budgets); the
        host and disk budgets apply only when this configuration has that tier (else 0: no
        checkpoints there). ``whole_working_set_pages``: the device
        pages of a ``whole_working_set`` configuration (ignored by the others).

        Raises:
            ValueError: a ``whole_working_set`` configuration without ``whole_working_set_pages``.
        """
        if self.whole_working_set and not whole_working_set_pages:
            raise ValueError(f"configuration {self.name!r} needs whole_working_set_pages (device pages for the whole "
                             f"working set, > 0), got {whole_working_set_pages!r}")
        pool = dataclasses.replace(
            base.pool, enable_prefix_caching=self.enable_prefix_caching,
            host_cache_bytes=host_cache_bytes if self.host else 0,
            disk_cache_dir=disk_dir if self.disk else None,
            disk_cache_bytes=disk_cache_bytes if self.disk else 0,
            cache_policy=self.cache_policy, write_policy=self.cache_write_policy,
            state_host_bytes=base.pool.state_host_bytes if self.host else 0,
            state_disk_bytes=base.pool.state_disk_bytes if self.disk else 0)
        if self.whole_working_set:
            # a hybrid model's device checkpoints get that whole KV budget too (None: the tier's KV bytes)
            pool = dataclasses.replace(pool, num_device_pages=whole_working_set_pages, state_device_bytes=None)
        return dataclasses.replace(base, pool=pool)


CONFIGS = {c.name: c for c in (
    BenchConfig("device-only"),
    BenchConfig("tiered", host=True, disk=True),
    BenchConfig("tiered-write-through", host=True, disk=True, cache_write_policy="write-through"),
    BenchConfig("tiered-tool-aware", host=True, disk=True, cache_policy="tool-aware", tool_aware=True),
    BenchConfig("no-cache", enable_prefix_caching=False),
    BenchConfig("ideal", whole_working_set=True),
)}
IDEAL = "ideal"
"""The bound's configuration: reports give every other configuration's distance to it."""


def parse_configs(text: str, by_name: dict = CONFIGS, where: str = "") -> list:
    """``"device-only,tiered"`` -> the values of ``by_name`` (:data:`CONFIGS`) so named, in order.

    Raises:
        ValueError: an unknown or repeated name, or an empty list; names the valid ones (and
            ``where`` they were looked up, e.g. ``" for scenario 'tiny'"``).
    """
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError(f"--configs is empty; expected a comma-separated subset of {list(by_name)}")
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"--configs: unknown configuration(s) {unknown}{where}; expected some of {list(by_name)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--configs names a configuration twice: {names}")
    return [by_name[n] for n in names]
