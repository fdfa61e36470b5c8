"""Engine configuration (validated)."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.cache.block_hash import compose_salt
from kvtier.cache.config import WRITE_POLICIES, PoolConfig
from kvtier.options import check_choice, check_int, check_str

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
        cuda_graph: replay decode-only steps from CUDA/HIP graphs captured per batch size (1, 2,
            4, .. up to max_num_seqs, at most 64), as vLLM and SGLang do; needs a GPU model (the
            runner raises ValueError otherwise). Off by default until measured.
        schedule_policy: ``cache-aware`` (waiting requests ordered by their estimated cost to
            serve, cached ones first, with aging; see :mod:`kvtier.serve.scheduler`) or
            ``fcfs`` (arrival order; a request that cannot be placed holds the ones behind it).
        schedule_max_passes: under ``cache-aware``, a request that later arrivals passed over in
            this many steps is served ahead of every request that was not, in arrival order.
        remote_cache_url: shared remote tier (``redis://HOST:PORT`` or
            ``mooncake://HOST:PORT[?metadata=URL]``; None = none); needs ``host_cache_bytes``.
            Engines with the same model, dtype, page size and ``cache_salt`` share its blocks.
        remote_timeout_s: seconds a remote read, write or lookup may take before it counts as
            a miss.

    Every field is checked for its type (a bool is not an int, a str is not a size, an int is
    not a directory) and range; sizes that give a host or disk tier of zero blocks are errors
    when the engine builds its pool (the block size depends on the model).

    Raises:
        ValueError: a field of the wrong type or out of range, naming it, the value and what
            was expected.
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
    cuda_graph: bool = False
    schedule_policy: str = "cache-aware"
    schedule_max_passes: int = 16
    remote_cache_url: str | None = None
    remote_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.cuda_graph, bool):
            raise ValueError(f"cuda_graph must be a bool, got {self.cuda_graph!r}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "schedule_max_passes"):
            check_int(name, getattr(self, name), min_value=1)
        check_str("cache_salt", self.cache_salt)
        check_choice("cache_write_policy", self.cache_write_policy, WRITE_POLICIES)
        check_choice("schedule_policy", self.schedule_policy, SCHEDULE_POLICIES)
        check_int("seed", self.seed, min_value=0, max_value=2**63 - 1)
        self.pool_config()  # validates the cache fields

    def pool_config(self, model_id: bytes = b"") -> PoolConfig:
        """The pool's config; block hashes are salted with ``model_id`` and ``cache_salt``
        (length-prefixed, so no two different pairs give the same salt)."""
        return PoolConfig(salt=compose_salt(model_id, self.cache_salt.encode()), page_size=self.page_size,
                          num_device_pages=self.num_device_pages,
                          host_cache_bytes=self.host_cache_bytes, disk_cache_dir=self.disk_cache_dir,
                          disk_cache_bytes=self.disk_cache_bytes, cache_policy=self.cache_policy,
                          write_policy=self.cache_write_policy, enable_prefix_caching=self.enable_prefix_caching,
                          remote_cache_url=self.remote_cache_url, remote_timeout_s=self.remote_timeout_s)
