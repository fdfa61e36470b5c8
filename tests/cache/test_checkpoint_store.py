"""The state checkpoint store on its own (kvtier/cache/checkpoints/store.py): each tier keeps its own
budget, drops sparse-grid checkpoints before turn ends and least recently used first, never drops a
protected one, checks what it reads back from disk, and says which copies it gained and lost."""

from __future__ import annotations

import pytest
import torch

from kvtier.cache.checkpoints.store import CheckpointKind, CheckpointStore, open_store
from kvtier.cache.disk_tier import DiskTier
from kvtier.cache.host_tier import HostTier
from kvtier.cache.prefix_index import Tier

N = 5000  # bytes per checkpoint (a host slot rounds it to 8192)
GRID, TURN = CheckpointKind.GRID, CheckpointKind.TURN


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def payload(i: int) -> torch.Tensor:
    return torch.full((N,), i % 251, dtype=torch.uint8)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def store(**budgets) -> CheckpointStore:
    return open_store(N, clock=Clock(), **budgets)


def test_a_full_tier_drops_grid_points_first_then_the_least_recently_used():
    s = store(device_bytes=3 * N)
    s.save(key(1), payload(1), TURN)
    s.save(key(2), payload(2), GRID)
    s.save(key(3), payload(3), GRID)
    s.read(key(2), Tier.DEVICE)  # 2 used after 3
    s.save(key(4), payload(4), TURN)  # full: the least recently used grid point (3) goes
    assert s.where(key(3)) == [] and s.where(key(2)) == [Tier.DEVICE]
    s.save(key(5), payload(5), TURN)  # then the other grid point, though the turn end 1 is older
    assert s.where(key(2)) == [] and s.where(key(1)) == [Tier.DEVICE]
    s.save(key(6), payload(6), TURN)  # only turn ends left: the oldest goes
    assert s.where(key(1)) == [] and s.stats.evictions["device"] == 3
    assert s.count(Tier.DEVICE) == 3


def test_protected_checkpoints_stay_and_a_tier_with_nothing_to_drop_refuses():
    s = store(device_bytes=2 * N)
    s.save(key(1), payload(1), GRID)
    s.save(key(2), payload(2), GRID)
    s.protect([key(1), key(2)])
    s.save(key(3), payload(3), TURN)
    assert s.where(key(3)) == [] and s.stats.refused["device"] == 1
    assert s.where(key(1)) == s.where(key(2)) == [Tier.DEVICE]
    s.unprotect([key(1)])
    s.save(key(3), payload(3), TURN)
    assert s.where(key(1)) == [] and s.where(key(3)) == [Tier.DEVICE]


def test_a_saved_key_is_kept_once_and_raised_to_the_higher_kind():
    s = store(device_bytes=2 * N)
    assert s.save(key(1), payload(1), GRID) and not s.save(key(1), payload(9), TURN)
    s.save(key(2), payload(2), GRID)
    s.save(key(3), payload(3), GRID)  # 1 became a turn end: 2 goes
    assert s.where(key(1)) == [Tier.DEVICE] and s.where(key(2)) == []
    read = s.read(key(1), Tier.DEVICE)
    assert s.ended(read) and torch.equal(read.payload, payload(1))  # the first save's bytes
    assert s.stats.saved == {"grid": 3, "turn": 0}


def test_disk_copies_are_checked_on_read_and_a_failed_one_is_dropped(tmp_path):
    s = store(host_bytes=HostTier.row_bytes(N), disk_bytes=4 * DiskTier.file_bytes(N), disk_dir=tmp_path / "state")
    for i in (1, 2):  # a host slot a disk write still reads is not dropped: let each write end
        s.save(key(i), payload(i), TURN)
        s.poll(wait=True)
    assert s.where(key(2)) == [Tier.HOST, Tier.DISK] and s.where(key(1)) == [Tier.DISK]  # one host slot
    read = s.read(key(1), Tier.DISK)
    read.wait()
    assert s.ended(read) and torch.equal(read.payload, payload(1))
    path = s.stores[Tier.DISK].disk.path(key(1))
    raw = bytearray(path.read_bytes())
    raw[4096 + 10] ^= 0xFF  # a flipped payload byte (after the 4096-byte header)
    path.write_bytes(bytes(raw))
    read = s.read(key(1), Tier.DISK)
    read.wait()
    assert not s.ended(read) and read.reason == "corrupt" and s.where(key(1)) == []
    assert s.stats.failures["corrupt"] == 1 and s.stats.bytes_loaded["disk"] == N
    assert s.read(key(1), Tier.DISK).result() != 0  # dropped: a later read is a miss, not stale bytes
    s.close()


def test_events_say_which_copies_were_gained_and_lost():
    s = store(device_bytes=N, host_bytes=HostTier.row_bytes(N))
    s.save(key(1), payload(1), TURN)
    assert sorted(s.drain_events()) == [(True, Tier.DEVICE, key(1)), (True, Tier.HOST, key(1))]
    s.save(key(2), payload(2), TURN)
    assert sorted(s.drain_events()) == sorted([(False, Tier.DEVICE, key(1)), (False, Tier.HOST, key(1)),
                                               (True, Tier.DEVICE, key(2)), (True, Tier.HOST, key(2))])
    assert s.drain_events() == []


@pytest.mark.parametrize("name, budgets", [
    ("state_device_bytes", {"device_bytes": N - 1}),
    ("state_host_bytes", {"host_bytes": 6000}),  # a host slot of a 5000-byte checkpoint takes 8192
    ("state_disk_bytes", {"disk_bytes": N + 1}),
])
def test_a_budget_below_one_checkpoint_is_an_error_naming_it(tmp_path, name, budgets):
    with pytest.raises(ValueError, match=f"{name}=.*smaller than one state checkpoint"):
        store(disk_dir=tmp_path, **budgets)


def test_bad_saves_are_named():
    s = store(device_bytes=N)
    with pytest.raises(ValueError, match="key must be a 16-byte block hash"):
        s.save(b"short", payload(1), TURN)
    with pytest.raises(ValueError, match=f"payload must be {N} uint8 bytes"):
        s.save(key(1), torch.zeros(N, dtype=torch.float32), TURN)


def test_a_session_waiting_on_a_tool_keeps_its_last_checkpoint_until_it_returns(tmp_path):
    """Tool-aware retention (kvtier/cache/checkpoints/reuse.py): the pool protects the last checkpoint
    under a waiting session's blocks in every tier, so new saves evict others; after the tool
    returns it is an ordinary checkpoint again."""
    from kvtier.cache.config import PoolConfig
    from kvtier.cache.kv_state import KVState, TokenList
    from kvtier.cache.pool import KVPool

    ps, pages = 4, 16
    pool = KVPool(PoolConfig(page_size=ps, num_device_pages=pages, state_checkpoint_bytes=N,
                             state_device_bytes=2 * N), [torch.zeros(pages, ps, 8)])

    def saved(seed: int) -> list[bytes]:
        kv = KVState(TokenList(list(range(seed * 100, seed * 100 + 8))))
        assert pool.allocate(kv, 8)
        kv.num_computed_tokens = 8
        pool.register_computed(kv)
        pool.save_checkpoint(kv, 8, payload(seed), GRID)
        pool.free(kv)
        return kv.block_hashes

    waiting = saved(1)
    pool.tool_wait_blocks("s", waiting, 30.0)
    for seed in (2, 3, 4):  # two device slots: without the wait, seed 1's checkpoint would go first
        saved(seed)
    store = pool.resume_rule.store
    assert store.where(waiting[-1]) == [Tier.DEVICE] and store.stats.evictions["device"] == 2
    pool.tool_return("s")
    saved(5)
    assert store.where(waiting[-1]) == []
