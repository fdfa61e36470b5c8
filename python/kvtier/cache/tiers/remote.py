"""The remote store as a :class:`~kvtier.cache.tiers.protocol.TierStore`: a shared, lossy store
(:class:`kvtier.cache.remote.RemoteTier`) keyed by block hash; its misses are counted misses,
never errors.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch

from kvtier.cache.disk_tier import aligned_empty
from kvtier.cache.prefix_index import PrefixIndex, Tier
from kvtier.cache.remote import RemoteStatus, RemoteTier
from kvtier.cache.seams import CopyJob
from kvtier.cache.tiers.protocol import Admit, ReadFailure, Stored


class RemoteStore:
    """A shared store (:class:`RemoteTier`): lossy by contract, its misses are counted in
    ``remote.stats``, not as copy errors."""

    tier, name, batch_reads, spills, copies_input, local = Tier.REMOTE, "remote", False, False, True, False

    def __init__(self, remote: RemoteTier, index: Callable[[], PrefixIndex] | None = None,
                 pin: Callable[[], bool] = lambda: False):
        self.remote, self._index, self._pin = remote, index, pin

    def capacity_blocks(self) -> int:
        return -1  # the store's own (shared, evicting) budget: not known here

    def contains(self, hashes: Sequence[bytes]) -> list[bool]:
        return self.remote.exists(list(hashes))

    def read(self, hashes: Sequence[bytes], slots: Sequence[int]) -> tuple[torch.Tensor, CopyJob]:
        buf = aligned_empty(len(hashes) * self.remote.meta.payload_bytes, pin_memory=self._pin())
        return buf, self.remote.get(list(hashes), buf)

    def write(self, hashes: Sequence[bytes], blocks: torch.Tensor) -> CopyJob:
        return self.remote.put(list(hashes), blocks)

    def evict(self, hashes: Sequence[bytes]) -> int:
        return 0  # a shared store evicts on its own; other workers may still read these

    def failed_read(self, status: int) -> ReadFailure:
        # UNAVAILABLE was never asked (the store is left alone for a while): the block may be there
        return ReadFailure(drop=status != RemoteStatus.UNAVAILABLE, error=False)

    def admit(self, pending: Collection[bytes]) -> Admit:
        return Admit.YES if self.remote.available() else Admit.SKIP

    def stored(self, block_hash: bytes, status: list[int]) -> Stored:
        # a failed remote write is counted in remote.stats, not as a copy error
        indexed = status == [0] and self._index is not None and self._index().insert(block_hash, Tier.REMOTE, 0)
        return Stored(indexed=bool(indexed), refused=False, error=False)
