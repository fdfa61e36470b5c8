"""Which prefix lengths of a hybrid model's pages can be restored from storage.

SGLang's v2 storage interface asks, for a run of KV page keys, how long a prefix it can load
(``batch_exists_v2``); side pools (a recurrent state, a sliding window, an indexer) say what each
prefix needs of them by a hit policy. The rule is kvtier's pool's exact-hit rule
(docs/architecture.md, "Hybrid models"): a prefix is reused only up to a boundary whose KV pages
and side pages are all present, so no KV is loaded without its state. With
``TRAILING_PAGES`` a state exists only at some page boundaries (where a checkpoint was taken),
so the restorable lengths are a sparse set: length 5 may be restorable while 4 and 3 are not.

This module knows no SGLang class: policies are their string values (``"all_pages"``,
``"trailing_pages"``), so the rule is tested without SGLang installed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ALL_PAGES = "all_pages"
TRAILING_PAGES = "trailing_pages"
POLICIES = (ALL_PAGES, TRAILING_PAGES)


@dataclass(frozen=True)
class SidePool:
    """One side pool's part in a lookup.

    Attributes:
        name: the pool's name (SGLang's ``PoolName`` value, e.g. ``"mamba"``).
        policy: :data:`ALL_PAGES` (every page of the prefix needs this pool's page) or
            :data:`TRAILING_PAGES` (only the last ``window`` pages of the prefix do).
        window: pages at the end of a prefix that need this pool's page (``TRAILING_PAGES``;
            >= 1).
        present: whether this pool holds the page of each KV key (same length as the keys).
    """

    name: str
    policy: str
    window: int
    present: Sequence[bool]

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"hit_policy of pool {self.name!r} must be one of {list(POLICIES)}, got {self.policy!r}")
        if self.window < 1:
            raise ValueError(f"window of pool {self.name!r} must be >= 1 page, got {self.window}")


@dataclass(frozen=True)
class PrefixHit:
    """The answer to one lookup.

    Attributes:
        pages: the longest restorable prefix, in pages (the KV pages SGLang loads).
        per_pool: the longest prefix each pool would allow on its own (``"kv"``: the leading run
            of KV pages), for pools that allow any.
        restorable: every restorable prefix length, ascending (``restorable_prefix_pages``; a
            caller across ranks intersects these sets).
    """

    pages: int
    per_pool: dict[str, int]
    restorable: list[int]


def kv_prefix(present: Sequence[bool]) -> int:
    """The leading run of True in ``present`` (pages held from the first on)."""
    for i, on in enumerate(present):
        if not on:
            return i
    return len(present)


def restorable_prefixes(kv_present: Sequence[bool], side: Sequence[SidePool], kv_name: str = "kv") -> PrefixHit:
    """The prefixes of ``len(kv_present)`` pages that can be restored.

    A length ``p`` (1 <= p <= the KV prefix) is restorable when every side pool allows it:
    ``ALL_PAGES`` when the pool holds pages ``0 .. p-1``; ``TRAILING_PAGES`` when it holds pages
    ``p - window .. p - 1`` (clipped at 0).

    Args:
        kv_present: whether each KV page is held.
        side: the side pools (each ``present`` as long as ``kv_present``).
        kv_name: the KV pool's name in ``per_pool``.

    Raises:
        ValueError: a side pool whose ``present`` has another length (naming the pool).

    Example:
        >>> state = SidePool("mamba", TRAILING_PAGES, 1, [False, True, False, True])
        >>> restorable_prefixes([True] * 4, [state])
        PrefixHit(pages=4, per_pool={'kv': 4, 'mamba': 4}, restorable=[2, 4])
    """
    kv = kv_prefix(kv_present)
    per_pool = {kv_name: kv} if kv else {}
    restorable = set(range(1, kv + 1))
    for pool in side:
        if len(pool.present) != len(kv_present):
            raise ValueError(f"pool {pool.name!r}: {len(pool.present)} presence flags for {len(kv_present)} KV pages")
        if not restorable:
            break
        if pool.policy == ALL_PAGES:
            allowed = set(range(1, kv_prefix(pool.present[:kv]) + 1))
        else:
            allowed = {p for p in range(1, kv + 1) if all(pool.present[max(0, p - pool.window):p])}
        if allowed:
            per_pool[pool.name] = max(allowed)
        restorable &= allowed
    ordered = sorted(restorable)
    return PrefixHit(ordered[-1] if ordered else 0, per_pool, ordered)
