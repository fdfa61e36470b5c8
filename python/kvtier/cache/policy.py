"""Pool configuration and the names of its policies."""

from __future__ import annotations

from dataclasses import dataclass

WRITE_POLICIES = ("write-through", "write-back")
CACHE_POLICIES = ("lru",)


@dataclass(frozen=True)
class PoolConfig:
    """Sizes and policies of a :class:`kvtier.cache.pool.KVPool`.

    Attributes:
        page_size: tokens per page/block (power of two).
        num_device_pages: pages in each layer's device pool.
        host_cache_bytes: host tier budget in bytes (0 = no host tier).
        disk_cache_dir: directory of the disk tier (None = no disk tier).
        disk_cache_bytes: disk tier budget in bytes.
        cache_policy: eviction order (``lru``).
        write_policy: ``write-through`` (copy each full block down at once) or ``write-back``
            (copy down only when evicted).
        enable_prefix_caching: reuse blocks by hash at all.
        salt: tenant salt of the block hashes.
        copy_threads: copy-engine worker threads.

    Raises:
        ValueError: a field out of range, naming it.
    """

    page_size: int = 16
    num_device_pages: int = 1024
    host_cache_bytes: int = 0
    disk_cache_dir: str | None = None
    disk_cache_bytes: int = 0
    cache_policy: str = "lru"
    write_policy: str = "write-through"
    enable_prefix_caching: bool = True
    salt: bytes = b""
    copy_threads: int = 2

    def __post_init__(self) -> None:
        ps = self.page_size
        if not isinstance(ps, int) or isinstance(ps, bool) or ps <= 0 or ps & (ps - 1):
            raise ValueError(f"page_size must be a power of two, got {ps!r}")
        if not isinstance(self.num_device_pages, int) or self.num_device_pages <= 0:
            raise ValueError(f"num_device_pages must be a positive int, got {self.num_device_pages!r}")
        for name in ("host_cache_bytes", "disk_cache_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.cache_policy not in CACHE_POLICIES:
            raise ValueError(f"cache_policy must be one of {CACHE_POLICIES}, got {self.cache_policy!r}")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {self.write_policy!r}")
        if self.copy_threads < 1:
            raise ValueError(f"copy_threads must be >= 1, got {self.copy_threads}")
