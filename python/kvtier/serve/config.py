"""Engine configuration (validated)."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.cache.policy import PoolConfig

SCHEDULE_POLICIES = ("cache-aware", "fcfs")


@dataclass(frozen=True)
class EngineConfig:
    """Sizes, limits and cache policies of one engine.

    Attributes:
        page_size: tokens per KV page; a power of two.
        num_device_pages: pages per layer in the device page pool.
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
        max_num_seqs: sequences running or loading at once.
        enable_prefix_caching: reuse cached blocks by hash.
        host_cache_bytes: host-memory tier budget in bytes (0 = none).
        disk_cache_dir: directory of the disk tier (None = none).
        disk_cache_bytes: disk tier budget in bytes.
        cache_policy: eviction policy name (``lru``).
        cache_write_policy: ``write-through`` or ``write-back``.
        cache_salt: tenant isolation: engines with different salts never share cached blocks
            (the model's identity is always mixed in by the engine).
        seed: seed of the engine's sampling generator.
        schedule_policy: ``cache-aware`` (waiting requests ordered by their estimated cost to
            serve, cached ones first, with aging; see :mod:`kvtier.serve.scheduler`) or
            ``fcfs`` (arrival order; a request that cannot be placed holds the ones behind it).
        schedule_max_passes: under ``cache-aware``, a request that later arrivals passed over in
            this many steps is served ahead of every request that was not, in arrival order.

    Raises:
        ValueError: a field out of range, naming it.
    """

    page_size: int = 16
    num_device_pages: int = 1024
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    host_cache_bytes: int = 0
    disk_cache_dir: str | None = None
    disk_cache_bytes: int = 0
    cache_policy: str = "lru"
    cache_write_policy: str = "write-through"
    cache_salt: str = ""
    seed: int = 0
    schedule_policy: str = "cache-aware"
    schedule_max_passes: int = 16

    def __post_init__(self) -> None:
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {', '.join(SCHEDULE_POLICIES)}, "
                             f"got {self.schedule_policy!r}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "schedule_max_passes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.pool_config()  # validates the cache fields

    def pool_config(self, model_id: bytes = b"") -> PoolConfig:
        """The pool's config; block hashes are salted with ``model_id`` and ``cache_salt``."""
        return PoolConfig(salt=model_id + self.cache_salt.encode(), page_size=self.page_size, num_device_pages=self.num_device_pages,
                          host_cache_bytes=self.host_cache_bytes, disk_cache_dir=self.disk_cache_dir,
                          disk_cache_bytes=self.disk_cache_bytes, cache_policy=self.cache_policy,
                          write_policy=self.cache_write_policy, enable_prefix_caching=self.enable_prefix_caching)
