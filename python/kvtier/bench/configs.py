"""The cache configurations ``kvtier bench`` compares, and how they are sized.

- ``device-only``: prefix caching in device pages only, LRU: what engines do by default.
- ``tiered``: device pages, then host memory, then disk, with the probed cost model deciding
  what to load and what to recompute; LRU; write-back (a block is copied down a tier when it is
  evicted from the one above).
- ``tiered-write-through``: ``tiered`` with write-through (every full block is copied down at
  once, so an eviction never waits for a copy).
- ``tiered-tool-aware``: ``tiered`` with the tool-aware policy, told about tool waits.
- ``no-cache``: no prefix caching at all (every prompt is prefilled in full).

A hybrid KDA + MLA model (``--model tiny-k3``) runs without prefix reuse across requests (its
engine keeps no KDA state with the cached pages yet, :mod:`kvtier.serve.hybrid_state`): only the
configurations without a host or disk tier run (:func:`for_hybrid`), and ``device-only`` then
computes every prompt in full as ``no-cache`` does.
"""

from __future__ import annotations

import dataclasses
import logging
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
    """

    name: str
    enable_prefix_caching: bool = True
    host: bool = False
    disk: bool = False
    cache_policy: str = "lru"
    cache_write_policy: str = "write-back"
    tool_aware: bool = False

    def engine_config(self, base: EngineConfig, host_cache_bytes: int, disk_dir: str | None,
                      disk_cache_bytes: int) -> EngineConfig:
        """``base`` with this configuration's pool fields."""
        pool = dataclasses.replace(
            base.pool, enable_prefix_caching=self.enable_prefix_caching,
            host_cache_bytes=host_cache_bytes if self.host else 0,
            disk_cache_dir=disk_dir if self.disk else None,
            disk_cache_bytes=disk_cache_bytes if self.disk else 0,
            cache_policy=self.cache_policy, write_policy=self.cache_write_policy)
        return dataclasses.replace(base, pool=pool)


CONFIGS = {c.name: c for c in (
    BenchConfig("device-only"),
    BenchConfig("tiered", host=True, disk=True),
    BenchConfig("tiered-write-through", host=True, disk=True, cache_write_policy="write-through"),
    BenchConfig("tiered-tool-aware", host=True, disk=True, cache_policy="tool-aware", tool_aware=True),
    BenchConfig("no-cache", enable_prefix_caching=False),
)}


def for_hybrid(configs: list[BenchConfig], model: str) -> list[BenchConfig]:
    """The configurations of ``configs`` a hybrid model ``model`` runs: those without a host or disk
    tier. The others are skipped with a logged note.

    Raises:
        ValueError: none is left (naming ``--configs`` and the ones that run).
    """
    kept = [c for c in configs if not (c.host or c.disk)]
    skipped = [c.name for c in configs if c.host or c.disk]
    runnable = [c.name for c in CONFIGS.values() if not (c.host or c.disk)]
    if not kept:
        raise ValueError(f"--configs {','.join(skipped)}: model {model!r} is a hybrid KDA + MLA model, which runs "
                         f"device-only for now (no prefix reuse across requests); expected some of {runnable}")
    if skipped:
        logging.getLogger(__name__).warning(
            "note: model %r is a hybrid KDA + MLA model: it runs device-only without prefix reuse across requests "
            "(the hybrid cache is not built yet), so --configs %s run and %s are skipped", model,
            ",".join(c.name for c in kept), ",".join(skipped))
    return kept


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
