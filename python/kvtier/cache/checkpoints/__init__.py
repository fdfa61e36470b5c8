"""Recurrent-state checkpoints: the pool's second kind of cached object (a hybrid model's).

One room, four parts, bottom to top:

- ``options``: what a user sets (:class:`CheckpointOptions`: grid spacing and per-tier budgets, as
  one record with its checks; the default grid);

- ``index``: the records and rules every checkpoint store shares (:class:`Checkpoint`, the data
  that crosses the serving loop; :class:`CheckpointKind`; the index with its eviction order);
- ``store``: the checkpoints' bytes in the device, host, disk and remote tiers
  (:class:`CheckpointStore`, :func:`open_checkpoints`);
- ``reuse``: where a cached prefix may resume (:class:`EveryBlock` for an attention-only pool,
  :class:`CheckpointReuse` for a hybrid one; :func:`resume_rule` picks it).

The pool (:mod:`kvtier.cache.pool`) holds the rule; prefix reuse asks it and nothing else does.
"""

from kvtier.cache.checkpoints.index import Checkpoint, CheckpointKind
from kvtier.cache.checkpoints.options import CheckpointOptions
from kvtier.cache.checkpoints.reuse import CheckpointReuse, EveryBlock, resume_rule
from kvtier.cache.checkpoints.store import CheckpointStore, open_checkpoints

__all__ = ["Checkpoint", "CheckpointKind", "CheckpointOptions", "CheckpointReuse", "CheckpointStore", "EveryBlock",
           "open_checkpoints", "resume_rule"]
