"""The backend's settings, read from SGLang's ``--hicache-storage-backend-extra-config`` JSON.

SGLang hands a dynamic backend the whole extra config (``HiCacheStorageConfig.extra_config``):
the keys SGLang reads itself (:data:`SGLANG_KEYS`: which class to load, the zero-copy switch,
prefetch tuning) and the backend's own (:class:`StorageConfig`'s fields). Any other key, or a
value of the wrong type, is refused at start-up with an error naming it: a typo such as
``disk_cache_byte`` would otherwise run without a disk tier and say nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvtier.cache.remote import check_remote_url

SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name",  # the dynamic loader's
    "interface_v1",  # 1: the cache controller calls batch_get_v1 / batch_set_v1 (zero copy)
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys",  # the controller's prefetch settings
})
"""Keys of the extra config that SGLang reads (they pass through unchecked here)."""


@dataclass(frozen=True)
class StorageConfig:
    """kvtier's tiers under SGLang's host pools (HiCache L3), per registered pool.

    Every budget is per SGLang host pool (the KV pool and each side pool get their own).

    Attributes:
        host_cache_bytes: bytes of kvtier host-memory slots in front of the disk and remote
            tiers (0: none). Least recently used pages are evicted when full.
        disk_cache_dir: directory of the disk tier's block files (None: no disk tier). Each
            pool's pages go to a subdirectory named by its layout and the model's storage keys.
        disk_cache_bytes: disk tier budget in bytes (file sizes, 4096-byte header included);
            a write past it is refused and counted (``get_stats``), never an error to SGLang.
        remote_cache_url: ``redis://HOST:PORT[/DB]`` or ``mooncake://HOST:PORT[?...]`` (None:
            no remote tier).
        remote_timeout_s: longest wait for one remote call, seconds (> 0).
        namespace: extra text mixed into every key (keeps two deployments on one store apart).

    Raises:
        ValueError: a field of the wrong type or out of range, naming it.
    """

    host_cache_bytes: int = 0
    disk_cache_dir: str | None = None
    disk_cache_bytes: int = 0
    remote_cache_url: str | None = None
    remote_timeout_s: float = 1.0
    namespace: str = ""

    def __post_init__(self) -> None:
        for name in ("host_cache_bytes", "disk_cache_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0 (bytes), got {value!r}")
        if self.disk_cache_dir is not None and (not isinstance(self.disk_cache_dir, str) or not self.disk_cache_dir):
            raise ValueError(f"disk_cache_dir must be a non-empty str (a directory) or null, "
                             f"got {self.disk_cache_dir!r}")
        if self.disk_cache_dir is not None and self.disk_cache_bytes == 0:
            raise ValueError("disk_cache_bytes must be > 0 when disk_cache_dir is set, got 0")
        check_remote_url("remote_cache_url", self.remote_cache_url)
        t = self.remote_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(f"remote_timeout_s must be a number > 0 (seconds), got {t!r}")
        if not isinstance(self.namespace, str):
            raise ValueError(f"namespace must be a str, got {self.namespace!r}")
        if not (self.host_cache_bytes or self.disk_cache_dir or self.remote_cache_url):
            raise ValueError("no tier configured: set host_cache_bytes > 0, disk_cache_dir (with disk_cache_bytes) "
                             "or remote_cache_url in the extra config")

    @staticmethod
    def from_extra_config(extra: dict[str, Any] | None) -> StorageConfig:
        """The settings in SGLang's extra config ``extra`` (a dict; None: none given).

        Raises:
            ValueError: ``extra`` not a dict, a key that is neither SGLang's (:data:`SGLANG_KEYS`)
                nor a field of :class:`StorageConfig` (naming it and the known keys), or a
                field's wrong type or range.
        """
        if extra is None:
            extra = {}
        if not isinstance(extra, dict):
            raise ValueError(f"extra_config must be a JSON object (dict), got {type(extra).__name__}")
        own = {f.name for f in fields(StorageConfig)}
        unknown = sorted(k for k in extra if k not in own and k not in SGLANG_KEYS)
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} in the HiCache extra config; kvtier's keys are "
                             f"{sorted(own)}, SGLang's {sorted(SGLANG_KEYS)}")
        return StorageConfig(**{k: v for k, v in extra.items() if k in own})
