"""KV cache: block identity (hash chain) and the tiered pool's prefix index."""

from kvtier.cache.block_hash import BLOCK_HASH_BYTES, block_hashes, block_hashes_py
from kvtier.cache.prefix_index import Event, PrefixIndex, RemoveResult, Tier

__all__ = ["BLOCK_HASH_BYTES", "Event", "PrefixIndex", "RemoveResult", "Tier", "block_hashes", "block_hashes_py"]
