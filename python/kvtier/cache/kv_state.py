"""One request's KV state in the pool: its pages, block hashes, progress, hits and loads (docs/architecture.md, Seams).

A serving request owns one :class:`KVState` (the serving layer's ``Sequence.kv``); another
engine creates its own. The pool reads and writes these objects only; it never imports the
serving layer. The request's tokens are read through :class:`TokenSource` (the request itself,
or a :class:`TokenList`), only to hash blocks that have no hash yet.

Ownership: the pool writes ``page_ids``, ``block_hashes``, ``num_registered_blocks``,
``num_prefix_tokens``, ``prefix_tokens_by_tier``, ``hit_tiers`` and ``loads``; the caller (the
scheduler) alone writes ``num_computed_tokens``, from what the pool reports
(:meth:`kvtier.cache.pool.KVPool.finish_prefix`, :meth:`~kvtier.cache.pool.KVPool.truncate`)
and from the tokens the model ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class TokenSource(Protocol):
    """A request's token ids (prompt then output), as far as they are known."""

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens so far."""
        ...

    def token_ids(self, start: int = 0, end: int | None = None) -> list[int]:
        """Token ids ``[start, end)``."""
        ...


class TokenList:
    """A :class:`TokenSource` over a list of token ids (append to ``ids`` as tokens are generated)."""

    def __init__(self, ids: list[int]):
        self.ids = list(ids)

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    def token_ids(self, start: int = 0, end: int | None = None) -> list[int]:
        return self.ids[start:end]


def _by_tier() -> dict[str, int]:
    return {"device": 0, "host": 0, "disk": 0}


@dataclass(eq=False)
class KVState:
    """One request's KV state as :class:`kvtier.cache.pool.KVPool` uses it.

    Attributes:
        tokens: the request's tokens (read only to hash full blocks past ``block_hashes``; a
            request that gives the hash of every block it will fill may have a source whose
            ``token_ids`` raises, as the simulator's requests do).
        salt: the request's own cache salt, mixed into its block hashes after the pool's salt;
            ``b""`` for none.
        page_ids: device page ids holding the request's tokens, in order (``page_size`` tokens
            each), i.e. its row of ``block_table``; the pool appends and releases them.
        block_hashes: chained hashes of the request's full blocks (16 bytes each); may be given
            up front (then its tokens are not read for them, nor hashed again), extended in place
            by the pool as blocks fill. Given hashes must use the pool's salt followed by
            ``salt`` (``PoolConfig.salt + salt``, the salt the pool hashes with); the
            pool trusts them, so whoever gives them checks them (``Engine.add_request`` does).
        num_computed_tokens: tokens whose KV is in ``page_ids`` (computed or reused); written by
            the caller only, read by the pool to index full blocks.
        num_registered_blocks: leading full blocks already indexed by the pool.
        num_prefix_tokens: tokens of the cached prefix the last placement put in ``page_ids``.
        prefix_tokens_by_tier: those tokens per tier they came from (``{"device", "host",
            "disk", ...}``).
        hit_tiers: block hash -> tier name each reused block was first served from, or
            ``"computed"`` for a block the request computed itself; the pool counts each block
            as a hit once per request (a reload after a preemption is not a second hit).
        loads: the block loads in flight into ``page_ids`` (None when none run; an empty list
            while only a hybrid pool's checkpoint read runs).

    A hybrid pool's checkpoint reads and restores are the pool's own
    (:mod:`kvtier.cache.checkpoints.reuse`): a restore leaves it as data
    (:meth:`kvtier.cache.pool.KVPool.take_restore`).
    """

    tokens: TokenSource = field(repr=False)
    salt: bytes = b""
    page_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_registered_blocks: int = 0
    num_prefix_tokens: int = 0
    prefix_tokens_by_tier: dict[str, int] = field(default_factory=_by_tier)
    hit_tiers: dict[bytes, str] = field(default_factory=dict)
    loads: list | None = None

    @property
    def num_tokens(self) -> int:
        """The request's tokens so far."""
        return self.tokens.num_tokens

    @property
    def loading(self) -> bool:
        """Blocks (or a checkpoint) are being loaded into its pages (poll ``KVPool.finish_prefix``)."""
        return self.loads is not None
