"""The connector's settings, read from vLLM's ``kv_connector_extra_config`` (no vLLM import here).

Keys (all optional; the tiers' meaning is :class:`kvtier.cache.config.PoolConfig`'s):

=====================  ======  ====================================================================
key                    type    meaning
=====================  ======  ====================================================================
host_cache_bytes       int     host tier budget in bytes (default 1 GiB; > 0: every block reaches
                               the lower tiers through host memory)
disk_cache_dir         str     directory of the disk tier (created; must be writable); none: no disk
disk_cache_bytes       int     disk tier budget in bytes (> 0 with ``disk_cache_dir``)
remote_cache_url       str     ``redis://HOST:PORT[/DB]`` or ``mooncake://HOST:PORT[?...]``; must
                               accept a TCP connection at start-up (within
                               ``min(remote_timeout_s, 2)`` seconds)
remote_timeout_s       number  seconds a remote call may take before it counts as a miss
cache_policy           str     ``lru`` or ``tool-aware`` (host tier eviction; session hints)
write_policy           str     ``write-through`` (host blocks go down to disk/remote at once) or
                               ``write-back`` (when the host tier evicts them)
salt                   str     tenant salt of the block hashes (blocks of other salts are never served)
prefill_tok_s          number  a fixed prefill rate (tokens/s) for the load-vs-recompute choice;
                               unset (the default): probed at start, then learned from vLLM's steps
load_mode              str     ``layer`` (default: loads run layer by layer inside the step that
                               needs them) or ``async`` (vLLM's asynchronous loads: the request
                               waits one scheduler step or more for its load)
stats_path             str     a JSON file the worker writes its counters to (blocks loaded per
                               tier, load failures, saves), after each step that changed them
=====================  ======  ====================================================================

Every error names the key: ``kv_connector_extra_config['disk_cache_bytes'] must be an int >= 0,
got '1G' (str)``.
"""

from __future__ import annotations

import os
import socket
import tempfile
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvtier.cache.config import PoolConfig
from kvtier.cache.disk_tier import BlockMeta
from kvtier.cache.remote import RemoteTier, open_remote
from kvtier.options import check_real, check_str

PREFIX = "kv_connector_extra_config"

_POOL_KEYS = ("host_cache_bytes", "disk_cache_dir", "disk_cache_bytes", "remote_cache_url", "remote_timeout_s",
              "cache_policy", "write_policy")
KEYS = (*_POOL_KEYS, "salt", "prefill_tok_s", "load_mode", "stats_path")
LOAD_MODES = ("layer", "async")
DEFAULT_HOST_CACHE_BYTES = 1 << 30
REACH_TIMEOUT_S = 2.0  # the most the start-up probe of remote_cache_url waits for a TCP connection


@dataclass(frozen=True)
class ConnectorConfig:
    """Checked connector settings.

    Attributes:
        pool: the tiers' settings as a :class:`PoolConfig` (``page_size`` is vLLM's block size;
            ``salt`` the UTF-8 bytes of the ``salt`` key).
        prefill_tok_s: a fixed prefill rate for the cost model (tokens per second), or None: probe
            it at start and learn it from vLLM's steps (:mod:`kvtier.integrations.vllm.rate`).
        load_mode: ``layer`` or ``async`` (see the module docstring).
    """

    pool: PoolConfig
    prefill_tok_s: float | None
    load_mode: str = "layer"

    @staticmethod
    def from_extra_config(extra: dict | None, block_size: int) -> ConnectorConfig:
        """Check ``extra`` (vLLM's ``kv_connector_extra_config``) for a ``block_size``-token block.

        Raises:
            ValueError: an unknown key, a value of the wrong type or range (the checks of
                :class:`PoolConfig`), a disk directory that cannot be created or written, a
                remote store that does not accept a connection (:func:`check_reachable`), each
                naming ``kv_connector_extra_config['KEY']``.
        """
        extra = {} if extra is None else extra
        if not isinstance(extra, dict):
            raise ValueError(f"{PREFIX} must be a JSON object, got {extra!r} ({type(extra).__name__})")
        unknown = sorted(set(extra) - set(KEYS))
        if unknown:
            raise ValueError(f"{PREFIX}[{unknown[0]!r}] is not a kvtier connector setting; expected keys: "
                             f"{', '.join(KEYS)}")
        try:
            salt = check_str("salt", extra.get("salt", "")).encode()
            prefill_tok_s = extra.get("prefill_tok_s")
            if prefill_tok_s is not None:
                prefill_tok_s = float(check_real("prefill_tok_s", prefill_tok_s, min_value=0.0, min_open=True))
            load_mode = check_str("load_mode", extra.get("load_mode", "layer"))
            if load_mode not in LOAD_MODES:
                raise ValueError(f"load_mode must be one of {LOAD_MODES}, got {load_mode!r}")
            if "stats_path" in extra:
                check_str("stats_path", extra["stats_path"])
            fields = {k: extra[k] for k in _POOL_KEYS if k in extra}
            fields.setdefault("host_cache_bytes", DEFAULT_HOST_CACHE_BYTES)
            pool = PoolConfig(page_size=block_size, salt=salt, **fields)
        except ValueError as e:
            raise ValueError(_name_key(str(e))) from None
        if pool.host_cache_bytes == 0:
            raise ValueError(f"{PREFIX}['host_cache_bytes'] must be > 0: blocks reach every tier through host "
                             "memory; got 0")
        if pool.disk_cache_dir is not None:
            check_writable_dir(pool.disk_cache_dir)
        if pool.remote_cache_url is not None:
            check_reachable(pool.remote_cache_url, min(pool.remote_timeout_s, REACH_TIMEOUT_S))
        return ConnectorConfig(pool, prefill_tok_s, load_mode)


def check_writable_dir(path: str) -> None:
    """Create ``path`` if needed and write a file in it.

    Raises:
        ValueError: it cannot be created or written, naming ``disk_cache_dir`` and the OS error.
    """
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".kvtier-probe-"):
            pass
    except OSError as e:
        raise ValueError(f"{PREFIX}['disk_cache_dir']={path!r} is not a writable directory: {e}") from None


def check_reachable(url: str, timeout_s: float) -> None:
    """Open (and close) a TCP connection to the host and port of ``url`` (a checked
    ``remote_cache_url``: a Redis server or a Mooncake master), waiting at most ``timeout_s``
    seconds; the store's own handshake is left to :func:`open_remote_checked`.

    Raises:
        ValueError: no connection in time, naming ``remote_cache_url`` and the OS error.
    """
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s):
            pass
    except OSError as e:
        raise ValueError(f"{PREFIX}['remote_cache_url']={url!r} cannot be reached (no TCP connection to "
                         f"{parts.hostname}:{parts.port} within {timeout_s:g} s: {e})") from None


def open_remote_checked(url: str, meta: BlockMeta, timeout_s: float) -> RemoteTier:
    """The remote tier of blocks ``meta`` at ``url`` (:func:`kvtier.cache.remote.open_remote`).

    Raises:
        ValueError: the store does not answer its handshake, or its client package is missing
            from vLLM's interpreter, naming ``remote_cache_url``.
    """
    try:
        return open_remote(url, meta, timeout_s)
    except ImportError as e:
        raise ValueError(f"{PREFIX}['remote_cache_url']={url!r} needs a client package in vLLM's Python "
                         f"(pip install 'kvtier[remote]'): {e}") from None
    except (ConnectionError, RuntimeError, OSError) as e:
        raise ValueError(f"{PREFIX}['remote_cache_url']={url!r} cannot be reached: {e}") from None


def _name_key(message: str) -> str:
    """``PoolConfig``'s message with its leading field name written as ``kv_connector_extra_config['field']``."""
    for key in sorted(KEYS, key=len, reverse=True):
        if message.startswith(key):
            return f"{PREFIX}[{key!r}]{message[len(key):]}"
    return f"{PREFIX}: {message}"
