"""KV cache: block identity (hash chain) and, later, the tiered pool."""

from kvtier.cache.block_hash import BLOCK_HASH_BYTES, block_hashes, block_hashes_py

__all__ = ["BLOCK_HASH_BYTES", "block_hashes", "block_hashes_py"]
