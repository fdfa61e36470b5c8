"""The disk budget is this pool's own and counts every block once: writes that finished but were
not collected, writes still running, foreign files in a shared directory, a full filesystem."""

import warnings

import pytest
import torch

from kvtier import LLM, SamplingParams
from kvtier.sim.copies import SimDisk
from kvtier.cache import PrefixIndex, block_hashes
from kvtier.cache.tiers.disk_budget import DiskBudget, namespace_dir
from kvtier.cache.disk_tier import BlockMeta, DiskStatus, DiskTier
from kvtier.cache.config import PoolConfig
from kvtier.cache.kv_state import KVState, TokenList
from kvtier.cache.pool import KVPool
from kvtier.cache.pool_stats import PoolStats
from kvtier.cache.prefix_index import Tier
from kvtier.transfer import CopyEngine
from tests.helpers.serving import always_load, prompt

PS, BLOCK = 16, 15360  # tiny preset, fp32: one block = 15360 bytes
FILE = DiskTier.file_bytes(BLOCK)
PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
META = BlockMeta(2, 4, 8, 1, 64)  # a small layout for pool-level tests


# ---------------------------------------------------------------- room counts each write once

def _budget(capacity_files: int) -> tuple[DiskBudget, SimDisk]:
    disk = SimDisk(capacity_files * DiskTier.file_bytes(META.payload_bytes))
    return DiskBudget(disk, PrefixIndex(), META, PoolStats(), private=False), disk


@pytest.mark.parametrize("stored_pending", [0, 1, 3, 5])
def test_room_counts_a_finished_uncollected_write_once(stored_pending):
    budget, disk = _budget(6)
    pending = [bytes([i]) * 16 for i in range(5)]
    for h in pending[:stored_pending]:  # these writes ended in the tier; the pool has not collected them
        assert disk.write(h, META) == DiskStatus.OK
    # 5 pending writes + 1 new block = 6 files, whichever of them the tier holds already
    assert budget.room(pending)
    assert budget.stats.evictions["disk"] == 0


def test_room_evicts_only_for_files_that_do_not_fit():
    budget, disk = _budget(3)
    for i in range(3):
        h = bytes([i]) * 16
        disk.write(h, META)
        budget.add(h)
    assert budget.room([]) and budget.stats.evictions["disk"] == 1  # one out for one in
    pending = [b"p" * 16, b"q" * 16]
    assert budget.room(pending) and budget.stats.evictions["disk"] == 3
    assert not budget.room(pending + [b"r" * 16])  # only pending writes left: nothing to evict


class _Held:
    """A disk write whose end the pool does not notice until ``release`` (it may have finished)."""

    released = False

    def __init__(self, handle):
        self.handle = handle

    def done(self):
        return _Held.released and self.handle.done()

    def wait(self, timeout_s=None):
        return self.handle.wait(timeout_s)

    def result(self):
        return self.handle.result()

    @property
    def run_s(self):
        return self.handle.run_s


class _Late:
    """A disk write that happens only when the pool collects it (a slow disk)."""

    def __init__(self, start):
        self.start, self.handle = start, None

    def done(self):
        return True

    def wait(self, timeout_s=None):
        return True

    def result(self):
        if self.handle is None:
            self.handle = self.start()
        return self.handle.result()

    @property
    def run_s(self):
        return 0.0 if self.handle is None else self.handle.run_s


def _time_writes(pool, timing):
    disk = pool.tiers.stores[Tier.DISK]
    real = disk.write
    if timing == "finished-uncollected":
        def write(*a):
            h = real(*a)
            h.wait()  # in the tier's used_bytes before the pool collects it
            return _Held(h)
        disk.write = write
    elif timing == "late":
        disk.write = lambda *a: _Late(lambda: real(*a))


@pytest.mark.parametrize("timing", ["as-they-come", "finished-uncollected", "late"])
def test_disk_tier_holds_its_whole_budget(tmp_path, timing):
    budget_files, prompts = 6, 8
    llm = LLM("tiny", page_size=PS, num_device_pages=16, host_cache_bytes=64 * BLOCK,
              disk_cache_dir=str(tmp_path), disk_cache_bytes=budget_files * FILE)
    pool = llm.engine.pool
    _time_writes(pool, timing)
    for i in range(prompts):
        _Held.released = False
        llm.generate(prompt_token_ids=[prompt(3 * PS + 1, 500 + i)], sampling_params=PARAMS)  # 3 blocks each
        assert pool.tiers.disk.used_bytes <= budget_files * FILE
        _Held.released = True
        pool.poll(wait=True)
        assert len(list(pool.tiers.disk.directory.glob("*.kvb"))) == min(budget_files, 3 * (i + 1))
    files = list(pool.tiers.disk.directory.glob("*.kvb"))
    assert len(files) == budget_files == len(pool.tiers.disk.blocks())
    assert pool.stats().bytes_written["disk"] == 3 * prompts * BLOCK
    assert pool.stats().evictions["disk"] == 3 * prompts - budget_files  # one out per block in, no more
    assert pool.stats().copy_errors == 0 and pool.stats().stores_refused["disk"] == 0


# ---------------------------------------------------------------- foreign files in a shared directory

FOREIGN = {  # another engine that leaves block files in the same directory
    "other-dtype": dict(dtype="bfloat16"),
    "other-page-size": dict(page_size=2 * PS),
    "other-model": dict(seed=1),
    "other-salt": dict(salt=b"tenant-x"),
}


@pytest.mark.parametrize("other", sorted(FOREIGN))
def test_foreign_files_neither_count_nor_block_the_disk_tier(tmp_path, other):
    args = dict(page_size=PS, num_device_pages=16, host_cache_bytes=64 * BLOCK, disk_cache_dir=str(tmp_path))
    first = LLM("tiny", **{**args, "disk_cache_bytes": 64 * FILE, **FOREIGN[other]})
    first.generate(prompt_token_ids=[prompt(6 * PS * 2 + 1, 40)], sampling_params=PARAMS)
    first.engine.pool.poll(wait=True)
    foreign = sorted(first.engine.pool.tiers.disk.directory.glob("*.kvb"))
    assert len(foreign) >= 6
    foreign_bytes = sum(f.stat().st_size for f in foreign)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a usable tier is not reported as dead
        ours = LLM("tiny", **{**args, "disk_cache_bytes": foreign_bytes + FILE})  # "just above" the foreign files
    pool = ours.engine.pool
    assert pool.tiers.disk.directory != first.engine.pool.tiers.disk.directory
    assert pool.stats().disk_capacity_blocks == (foreign_bytes + FILE) // FILE
    ours.generate(prompt_token_ids=[prompt(4 * PS + 1, 41)], sampling_params=PARAMS)
    pool.poll(wait=True)
    assert pool.stats().bytes_written["disk"] == 4 * BLOCK and pool.stats().stores_refused["disk"] == 0
    assert all(f.exists() for f in foreign)  # the other engine's blocks are left alone


class _Done:
    def __init__(self, statuses):
        self.statuses, self.run_s = statuses, 0.0

    def done(self):
        return True

    def wait(self, timeout_s=None):
        return True

    def result(self):
        return self.statuses


class _SyncCopies:
    """Real device/host copies; I/O jobs run at once (on any disk object, here a ``SimDisk``)."""

    def __init__(self):
        self.engine = CopyEngine(1)

    def gather(self, *a):
        return self.engine.gather(*a)

    def scatter(self, *a):
        return self.engine.scatter(*a)

    def run_io(self, job):
        return _Done(job.run())


def _pool_over(disk, host_blocks=8, pages=8):
    kv = [torch.zeros(pages, 4, 2) for _ in range(2)]  # payload 2 layers x 4 tokens x 8 bytes = 64 bytes
    config = PoolConfig(page_size=4, num_device_pages=pages, host_cache_bytes=host_blocks * 64)
    return KVPool(config, kv, copy_engine=_SyncCopies(), disk=disk)


def _store_blocks(pool, n, seed):
    seq = KVState(TokenList(prompt(4 * n + 1, seed)))
    assert pool.allocate(seq, 4 * n)
    seq.num_computed_tokens = 4 * n
    pool.register_computed(seq)
    pool.poll(wait=True)
    pool.poll(wait=True)
    pool.free(seq)


def test_a_given_tier_full_of_foreign_blocks_is_reported_and_refusals_counted(tmp_path):
    disk = SimDisk(3 * DiskTier.file_bytes(64))
    other = BlockMeta(2, 4, 8, 2, 64)  # the same sizes in another dtype: never ours
    for i in range(3):
        disk.write(bytes([i]) * 16, other)
    with pytest.warns(RuntimeWarning, match="can store no block"):
        pool = _pool_over(disk)
    assert pool.stats().disk_capacity_blocks == 0
    _store_blocks(pool, 2, 7)
    assert pool.stats().stores_refused["disk"] == 2 and pool.stats().bytes_written["disk"] == 0
    assert pool.stats().bytes_written["host"] == 2 * 64  # the host tier still stores them


def test_a_full_filesystem_keeps_the_blocks_it_has(tmp_path):
    disk = SimDisk(8 * DiskTier.file_bytes(64))
    pool = _pool_over(disk, host_blocks=16, pages=16)
    _store_blocks(pool, 3, 1)
    assert len(disk.blocks()) == 3
    real_store = disk.write
    # the filesystem (not the budget: it has room for 8) takes no fourth file
    disk.write = lambda *a, **k: DiskStatus.FULL if len(disk.blocks()) >= 3 else real_store(*a, **k)
    _store_blocks(pool, 1, 2)
    _store_blocks(pool, 1, 3)
    # The first refused write lowers the limit to what is stored; the next replaces the oldest
    # block instead of failing, and no write evicts two valid blocks.
    assert pool.stats().stores_refused["disk"] == 1 and pool.stats().copy_errors == 1
    assert pool.stats().evictions["disk"] == 1 and len(disk.blocks()) == 3


# ---------------------------------------------------------------- namespaces

def test_namespace_depends_on_salt_and_every_layout_field(tmp_path):
    base = namespace_dir(tmp_path, b"s", META)
    others = [namespace_dir(tmp_path, b"t", META)] + [
        namespace_dir(tmp_path, b"s", BlockMeta(*[v + (i == j) for j, v in enumerate(
            (META.num_layers, META.page_size, META.row_bytes, META.dtype, META.payload_bytes))]))
        for i in range(4)]
    assert len({base, *others}) == 6 and base.parent == tmp_path


def test_files_of_another_layout_in_the_own_namespace_are_dropped_at_start_up(tmp_path):
    config = PoolConfig(page_size=4, num_device_pages=8, host_cache_bytes=8 * 64, disk_cache_dir=str(tmp_path),
                        disk_cache_bytes=4 * DiskTier.file_bytes(64))
    kv = [torch.zeros(8, 4, 2) for _ in range(2)]
    meta = BlockMeta.of_pools(kv)
    tier = DiskTier(namespace_dir(tmp_path, config.salt, meta), 1 << 20)
    stray = block_hashes(list(range(4)), 4)[0]
    assert tier.write(stray, BlockMeta(2, 4, 8, 2, 64), torch.zeros(64, dtype=torch.uint8)) == DiskStatus.OK
    del tier
    pool = KVPool(config, kv)
    assert not pool.tiers.disk.contains(stray) and pool.tiers.disk.used_bytes == 0
    assert pool.stats().disk_capacity_blocks == 4


def test_a_full_filesystem_at_start_up_is_reported(tmp_path):
    import gc
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("tmpfs mount not permitted here")
    try:
        (mnt / "filler").write_bytes(b"\0" * (64 * 1024 - 4096))  # less than one block file left
        with pytest.warns(RuntimeWarning, match="filesystem has"):
            llm = LLM("tiny", page_size=PS, num_device_pages=16, host_cache_bytes=8 * BLOCK,
                      disk_cache_dir=str(mnt), disk_cache_bytes=64 << 20)
        pool = llm.engine.pool
        assert pool.stats().disk_capacity_blocks == 0
        llm.generate(prompt_token_ids=[prompt(2 * PS + 1, 9)], sampling_params=PARAMS)
        pool.poll(wait=True)
        assert pool.stats().stores_refused["disk"] == 2 and pool.stats().bytes_written["disk"] == 0
        assert pool.stats().evictions["disk"] == 0
        del llm, pool
        gc.collect()
    finally:
        if subprocess.run(["umount", str(mnt)]).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)])


def test_bench_table_and_json_show_refused_stores():
    from rich.console import Console

    from kvtier.bench.records import ConfigRun, RequestRecord
    from kvtier.bench.report import render_table, summarize

    rec = RequestRecord("s0", 0, input_tokens=64, output_tokens=2, arrival_s=0.0, first_token_s=0.1, finish_s=0.2,
                        cached_tokens=0, cached_tokens_by_tier={"device": 0, "host": 0, "disk": 0})
    run = ConfigRun("tiered", [rec], wall_s=1.0, stores_refused={"host": 3, "disk": 17})
    assert summarize(run)["stores_refused"] == {"host": 3, "disk": 17}
    console = Console(record=True, width=200)
    render_table([run], console=console)
    line = next(x for x in console.export_text().splitlines() if "stores refused" in x)
    assert "3 / 17" in line


def test_another_model_on_the_same_disk_dir_is_never_served_its_blocks(tmp_path):
    p = prompt(6 * PS + 1, 7)
    args = dict(page_size=PS, num_device_pages=16, host_cache_bytes=16 * BLOCK, disk_cache_dir=str(tmp_path),
                disk_cache_bytes=1 << 24)
    first = LLM("tiny", seed=0, **args)
    first.generate(prompt_token_ids=[p], sampling_params=PARAMS)
    first.engine.pool.poll(wait=True)
    other = always_load(LLM("tiny", seed=1, **args))  # same shapes, other weights
    assert other.generate(prompt_token_ids=[p], sampling_params=PARAMS)[0].num_cached_tokens == 0
    same = always_load(LLM("tiny", seed=0, **args))
    assert same.generate(prompt_token_ids=[p], sampling_params=PARAMS)[0].cached_tokens_by_tier["disk"] > 0


def test_disk_writes_in_flight_count_against_the_budget(tmp_path):
    from kvtier.cache.disk_tier import DiskTier
    llm = LLM("tiny", page_size=PS, num_device_pages=16, host_cache_bytes=64 * BLOCK, disk_cache_dir=str(tmp_path),
              disk_cache_bytes=2 * DiskTier.file_bytes(BLOCK))
    llm.generate(prompt_token_ids=[prompt(6 * PS + 1, 1)], sampling_params=PARAMS)
    llm.engine.pool.poll(wait=True)
    assert llm.engine.pool.stats().copy_errors == 0 and llm.engine.pool.tiers.disk.used_bytes <= 2 * DiskTier.file_bytes(BLOCK)


def test_disk_tier_needs_a_host_block(tmp_path):
    with pytest.raises(ValueError, match="disk_cache_dir needs host_cache_bytes >= one block"):
        LLM("tiny", page_size=PS, num_device_pages=8, disk_cache_dir=str(tmp_path), disk_cache_bytes=1 << 20)

