"""Sizes and policies of a :class:`kvtier.cache.pool.KVPool` (validated)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvtier.cache.remote import check_remote_url
from kvtier.options import check_bool, check_choice, check_int, check_path, check_real

WRITE_POLICIES = ("write-through", "write-back")
CACHE_POLICIES = ("lru", "tool-aware")


@dataclass(frozen=True)
class PoolConfig:
    """Sizes and policies of a :class:`kvtier.cache.pool.KVPool`.

    Attributes:
        page_size: tokens per page/block (power of two).
        num_device_pages: pages in each layer's device pool.
        host_cache_bytes: host tier budget in bytes (0 = no host tier).
        disk_cache_dir: directory of the disk tier (None = no disk tier).
        disk_cache_bytes: disk tier budget in bytes.
        cache_policy: eviction policy: ``lru`` or ``tool-aware`` (:class:`ToolAwarePolicy`).
        write_policy: ``write-through`` (copy each full block down at once) or ``write-back``
            (copy down only when evicted).
        enable_prefix_caching: reuse blocks by hash at all.
        salt: tenant salt of the block hashes.
        copy_threads: copy-engine worker threads.
        remote_cache_url: the shared remote tier's store (:mod:`kvtier.cache.remote`):
            ``redis://HOST:PORT`` or ``mooncake://HOST:PORT[?...]``; None = no remote tier.
            Needs a host tier (blocks are written through to it from host memory).
        remote_timeout_s: seconds a remote read, write or lookup may take before it counts as
            a miss (and the store is left alone for a while).
        state_checkpoint_bytes: bytes of one recurrent-state checkpoint of a hybrid model (the
            KDA states and conv windows of all its linear layers at one token boundary); 0 = the
            model has no recurrent state (no checkpoints). Set by the engine from the model.
        state_checkpoint_tokens: spacing in tokens of the sparse grid of checkpoints a hybrid
            model's prefill saves beside the ones at prompt and turn ends; a positive multiple
            of ``page_size``, or 0 = the default
            (:func:`kvtier.cache.checkpoints.options.default_checkpoint_tokens`).
        state_device_bytes, state_host_bytes, state_disk_bytes: checkpoint budgets of the device,
            host and disk tiers, separate from their KV budgets; None = the tier's KV budget
            (``num_device_pages`` blocks, ``host_cache_bytes``, ``disk_cache_bytes``), 0 = no
            checkpoints in that tier. A remote store has no budget of the pool's.

    Sizes that depend on the model (host or disk budgets smaller than one block) are checked
    by :class:`kvtier.cache.pool.KVPool`, which knows the block size.

    Raises:
        ValueError: a field of the wrong type (a bool is not an int, a str not a size) or out
            of range, naming it; ``disk_cache_dir`` with ``disk_cache_bytes == 0``.
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
    remote_cache_url: str | None = None
    remote_timeout_s: float = 1.0
    state_checkpoint_bytes: int = 0
    state_checkpoint_tokens: int = 0
    state_device_bytes: int | None = None
    state_host_bytes: int | None = None
    state_disk_bytes: int | None = None

    def __post_init__(self) -> None:
        ps = check_int("page_size", self.page_size, min_value=1)
        if ps & (ps - 1):
            raise ValueError(f"page_size must be a power of two, got {ps!r}")
        check_int("num_device_pages", self.num_device_pages, min_value=1)
        check_int("host_cache_bytes", self.host_cache_bytes, min_value=0)
        check_path("disk_cache_dir", self.disk_cache_dir)
        check_int("disk_cache_bytes", self.disk_cache_bytes, min_value=0)
        if self.disk_cache_dir is not None and self.disk_cache_bytes == 0:
            raise ValueError(f"disk_cache_dir={self.disk_cache_dir!r} needs disk_cache_bytes > 0 (a budget of 0 "
                             "holds no block); got disk_cache_bytes=0")
        check_choice("cache_policy", self.cache_policy, CACHE_POLICIES)
        check_choice("write_policy", self.write_policy, WRITE_POLICIES)
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        if not isinstance(self.salt, bytes):
            raise ValueError(f"salt must be bytes, got {self.salt!r} ({type(self.salt).__name__})")
        check_int("copy_threads", self.copy_threads, min_value=1)
        check_remote_url("remote_cache_url", self.remote_cache_url)
        check_real("remote_timeout_s", self.remote_timeout_s, min_value=0.0, min_open=True)
        check_int("state_checkpoint_bytes", self.state_checkpoint_bytes, min_value=0)
        n = check_int("state_checkpoint_tokens", self.state_checkpoint_tokens, min_value=0)
        if n % ps:
            raise ValueError(f"state_checkpoint_tokens must be a positive multiple of page_size={ps} (0 = the "
                             f"default spacing), got {n}")
        for name in ("state_device_bytes", "state_host_bytes", "state_disk_bytes"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), min_value=0)
        if self.remote_cache_url is not None and self.host_cache_bytes == 0:
            raise ValueError(f"remote_cache_url={self.remote_cache_url!r} needs host_cache_bytes > 0: blocks reach "
                             "the remote tier through host memory; got host_cache_bytes=0")

    def keeping_checkpoints(self, checkpoint_bytes: int, kv_bytes_per_token: int) -> PoolConfig:
        """This config keeping recurrent-state checkpoints of ``checkpoint_bytes`` bytes, its grid
        spacing 0 made the default for a model of ``kv_bytes_per_token`` bytes of KV per token
        (:func:`kvtier.cache.checkpoints.options.default_checkpoint_tokens`)."""
        from kvtier.cache.checkpoints.options import default_checkpoint_tokens

        grid = self.state_checkpoint_tokens or default_checkpoint_tokens(checkpoint_bytes, kv_bytes_per_token,
                                                                         self.page_size)
        return dataclasses.replace(self, state_checkpoint_bytes=checkpoint_bytes, state_checkpoint_tokens=grid)
