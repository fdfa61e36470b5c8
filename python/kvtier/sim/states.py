"""A hybrid model's recurrent state in virtual time: the pool's checkpoint store on the simulator's tiers.

Kimi K3's checkpoint (the KDA states and conv windows of its 69 linear layers at one token
boundary) is 449 MB in fp32, so a simulated worker keeps placeholder checkpoints of a few bytes in
the pool's own :class:`kvtier.cache.checkpoints.store.CheckpointStore` (its budgets, counted in
checkpoints; sparse-grid checkpoints dropped before prompt and turn ends, least recently used first
within a kind; tool-wait protection; write-through to every tier), on virtual-time tiers
(:func:`sim_checkpoints`): device slots, host slots whose copies are jobs of the worker's
:class:`~kvtier.sim.copies.SimCopyEngine` on the same modelled links as the KV blocks
(:class:`~kvtier.sim.copies.SimHostStore`: a save's host copy on the device -> host link, a host
read on the host -> device link), and a :class:`~kvtier.sim.copies.SimDisk` of their own whose
reads and writes are the copy engine's I/O jobs (a write on the storage link, indexed when it
ended; a read on the storage link, then the host -> device link). A device read ends at once. The
pool waits for a read as it waits for a block load (the request stays LOADING), so a restored
checkpoint's load time is charged before the request runs.

The timed runner (:class:`kvtier.sim.engine.TimedRunner`) takes the engine's checkpoints
(:class:`kvtier.serve.hybrid_state.CheckpointPlan`: the last page boundary of each prompt chunk that
reaches the sequence's end as ``TURN``, every ``state_checkpoint_tokens`` as ``GRID``, and the last
decode page boundary of a sequence that stops running as ``TURN``) and returns them in its step
result, with placeholder bytes, for the engine to hand the pool. The ``grid`` policy saves only the
grid points.

Bytes: under tensor parallelism each device holds ``1 / tp`` of a sequence's KDA state (its KDA
heads) and copies its share over its own host link, as it loads its replica of the MLA blocks. So
a host copy moves ``state_bytes / tp`` bytes per device (``link_bytes``), a disk copy the whole
``state_bytes`` through the node's storage link. A placeholder checkpoint is ``link_bytes`` in the
pool's placeholder units (see :class:`~kvtier.sim.copies.TierLinks`), what the pool's cost model
prices; the store's byte counters count ``state_bytes`` (all devices) per checkpoint in the same
units, as the KV counters, so reports scale both alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.cache.checkpoints.store import CheckpointStore, checkpoint_meta
from kvtier.cache.disk_tier import DiskTier
from kvtier.cache.host_tier import HostTier
from kvtier.cache.prefix_index import Tier
from kvtier.cache.tiers import open_stores
from kvtier.options import check_int
from kvtier.serve.hybrid_state import CheckpointPlan
from kvtier.sim.copies import SimCopyEngine, SimDisk, SimHostStore

CHECKPOINT_POLICIES = CheckpointPlan.POLICIES
"""``turn``: prompt ends, turn ends and the grid (the engine's); ``grid``: the sparse grid only."""


@dataclass(frozen=True)
class CheckpointSizes:
    """A hybrid model's checkpoint sizes and per-worker budgets (:mod:`kvtier.sim.run` sizes them).

    Attributes:
        state_bytes: one sequence's KDA states and conv windows, all devices, bytes.
        link_bytes: the share one device holds and copies over its host link, bytes.
        checkpoint_tokens: the grid spacing, tokens.
        device_checkpoints, host_checkpoints, disk_checkpoints: checkpoints each tier holds.
        state_slots: state slots on the devices (one per running sequence).
    """

    state_bytes: int
    link_bytes: float
    checkpoint_tokens: int
    device_checkpoints: int
    host_checkpoints: int
    disk_checkpoints: int
    state_slots: int


def sim_checkpoints(states: CheckpointSizes, copy_engine: SimCopyEngine, scale: float, *, host: bool,
                    disk: bool) -> CheckpointStore:
    """The pool's checkpoint store of a simulated worker, on virtual-time tiers (module docstring).

    Args:
        states: the checkpoint sizes and budgets.
        copy_engine: the worker's copy engine (its clock and links).
        scale: the pool's placeholder bytes per modelled byte.
        host, disk: the configuration has a host tier, a disk tier (else no checkpoint there).

    Raises:
        ValueError: a budget that is not a non-negative int.
    """
    n = max(1, round(states.link_bytes * scale))
    meta = checkpoint_meta(n)
    copy_engine.add_layout(meta, states.link_bytes, states.state_bytes)
    host_slots = check_int("host_checkpoints", states.host_checkpoints, min_value=0) if host else 0
    disk_slots = check_int("disk_checkpoints", states.disk_checkpoints, min_value=0) if disk else 0
    host_tier = HostTier(host_slots * HostTier.row_bytes(n), n, pin=False) if host_slots else None
    disk_tier = SimDisk(disk_slots * DiskTier.file_bytes(n)) if disk_slots else None
    stores = open_stores(meta, host_tier, disk_tier, None, lambda: copy_engine)
    if host_tier is not None:
        stores[Tier.HOST] = SimHostStore(host_tier, copy_engine, states.link_bytes)
    return CheckpointStore(n, device_slots=check_int("device_checkpoints", states.device_checkpoints, min_value=0),
                           stores=stores, clock=copy_engine.clock, counted_bytes=states.state_bytes * scale)


__all__ = ["CHECKPOINT_POLICIES", "CheckpointSizes", "sim_checkpoints"]
