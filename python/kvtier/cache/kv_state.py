"""What the pool reads and writes of a request: the KV-state seam (DESIGN.md, Seams).

The serving loop's request type satisfies :class:`KVState`; another engine
passes any object with these attributes. This package never imports the serving layer.
"""

from __future__ import annotations

from typing import Protocol


class KVState(Protocol):
    """One request's KV state as :class:`kvtier.cache.pool.KVPool` uses it.

    Attributes:
        seq_id: the request's id (keys the pool's in-flight loads).
        page_ids: device page ids holding the request's tokens, in order (``page_size``
            tokens each); the pool appends and releases them.
        block_hashes: chained hashes of the request's full blocks (16 bytes each), extended by
            the pool as blocks fill.
        num_computed_tokens: tokens whose KV is in ``page_ids`` (set by the pool when it places a
            cached prefix).
        num_registered_blocks: leading full blocks already indexed by the pool.
        prefix_tokens_by_tier: reused prompt tokens of the last prefix placement per tier
            (``{"device", "host", "disk", ...}``), written by the pool.
        hit_tiers: block hash -> tier name each reused block came from, written by the pool.
        salt: the request's own cache salt (bytes), mixed into its block hashes after the
            pool's salt; ``b""`` for none.
        num_tokens: prompt plus generated tokens so far.
    """

    seq_id: int
    page_ids: list[int]
    block_hashes: list[bytes]
    num_computed_tokens: int
    num_registered_blocks: int
    prefix_tokens_by_tier: dict[str, int]
    hit_tiers: dict[bytes, str]
    salt: bytes

    @property
    def num_tokens(self) -> int: ...

    def token_ids(self, start: int = 0, end: int | None = None) -> list[int]:
        """Token ids ``[start, end)`` of prompt plus output. The pool reads them only to hash blocks
        past ``block_hashes``: a state that carries the hash of every block it will fill may
        have no token ids (and raise here)."""
        ...
