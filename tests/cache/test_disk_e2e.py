"""Disk tier through the engine: hits served from disk, faults that end in recomputation,
restart recovery, a full filesystem."""

import gc
import os
import subprocess

import pytest

from kvtier import LLM
from kvtier.cache.disk_tier import DiskTier
from kvtier.cache.prefix_index import Tier
from tests.helpers.serving import PS, always_load, prompt
from tests.helpers.tiers import HOST_BYTES, PARAMS, assert_matches, reference_logprobs, warm


@pytest.fixture(scope="module")
def shared():
    first = prompt(200, 11)
    second = first[:170] + prompt(30, 12)
    return first, second, reference_logprobs(second)


def disk_llm(path, **kw):
    args = dict(page_size=PS, num_device_pages=17, host_cache_bytes=HOST_BYTES, disk_cache_dir=str(path),
                disk_cache_bytes=64 << 20)
    args.update(kw)
    return always_load(LLM("tiny", **args))


def test_prefix_comes_back_from_disk(shared, tmp_path):
    first, second, want = shared
    llm = disk_llm(tmp_path)
    warm(llm, first)
    out = llm.generate(prompt_token_ids=[second], sampling_params=PARAMS)[0]
    assert_matches(out, want, min_hit=170 // PS * PS)
    assert out.cached_tokens_by_tier["disk"] > 0
    assert sum(out.cached_tokens_by_tier.values()) == out.num_cached_tokens
    assert llm.engine.pool.stats().copy_errors == 0


def test_write_back_spills_an_eviction_to_disk_in_one_job_per_eviction(shared, tmp_path):
    """Under write-back, device pages taken at once evict their blocks to a full host tier, whose
    evicted copies go to disk: all the copies one eviction spills are written in one disk job
    (with 1-token blocks an eviction spills hundreds; a job each filled the disk queue and made
    the serving loop wait on it). Every spilled block is then on disk, and outputs are
    unchanged."""
    first, second, want = shared
    block = 15360 // PS  # bytes of a 1-token block of the tiny preset
    llm = disk_llm(tmp_path, write_policy="write-back", page_size=1, num_device_pages=17 * PS,
                   host_cache_bytes=64 * block)
    pool = llm.engine.pool
    engine = pool.tiers.copy_engine
    jobs = []
    real = engine.run_io

    def recorded(job):
        if job.write:
            jobs.append(list(job.hashes))
        return real(job)

    engine.run_io = recorded
    warm(llm, first)
    assert len(jobs) == 1 and len(jobs[0]) == 64, [len(j) for j in jobs]  # the full host tier, spilled at once
    assert all(pool.tiers.in_tier(h, Tier.DISK) for h in jobs[0])
    assert pool.stats().bytes_written["disk"] == 64 * block and pool.stats().copy_errors == 0
    out = llm.generate(prompt_token_ids=[second], sampling_params=PARAMS)[0]
    assert_matches(out, want, min_hit=1)


def test_a_spill_that_cannot_start_leaves_the_disk_budget_as_it_was(shared, tmp_path):
    """When the disk job of an eviction's spills cannot be started (here: its staging buffer
    cannot be had), the error reaches the caller and the spilled blocks stop counting as disk
    writes in flight, so the disk budget does not shrink for good."""
    first, _, _ = shared
    block = 15360 // PS
    llm = disk_llm(tmp_path, write_policy="write-back", page_size=1, num_device_pages=17 * PS,
                   host_cache_bytes=64 * block)
    writes = llm.engine.pool.writes
    host = llm.engine.pool.tiers.host

    def no_memory(slots):
        raise MemoryError("no staging buffer")

    host.read = no_memory
    with pytest.raises(MemoryError):
        warm(llm, first)
    assert "disk" not in writes.pending_below()


def block_files(llm, prompt_tokens, blocks):
    pool = llm.engine.pool
    from kvtier.cache import block_hashes
    hs = block_hashes(prompt_tokens[: blocks * PS], PS, salt=pool.config.salt)
    return [pool.tiers.disk.path(h) for h in hs]


@pytest.mark.parametrize("fault", ["flip-byte", "truncate", "delete"])
def test_damaged_disk_block_is_recomputed(shared, tmp_path, fault):
    first, second, want = shared
    llm = disk_llm(tmp_path)
    warm(llm, first)
    victim = block_files(llm, first, 10)[4]  # the fifth block of the shared prefix
    assert victim.exists()
    if fault == "flip-byte":
        data = bytearray(victim.read_bytes())
        data[5000] ^= 0x40
        victim.write_bytes(bytes(data))
    elif fault == "truncate":
        os.truncate(victim, victim.stat().st_size // 2)
    else:
        victim.unlink()
    damaged = victim.read_bytes() if victim.exists() else None
    out = llm.generate(prompt_token_ids=[second], sampling_params=PARAMS)[0]
    assert_matches(out, want, min_hit=0)
    assert out.num_cached_tokens <= 4 * PS  # never past the damaged block
    assert llm.engine.pool.stats().copy_errors >= 1
    llm.engine.pool.poll(wait=True)
    # The damaged file was dropped; the recomputed block was written through again, intact.
    assert victim.exists() and victim.read_bytes() != damaged


def test_restart_recovers_intact_blocks(shared, tmp_path):
    first, second, want = shared
    warm(disk_llm(tmp_path), first)
    files = block_files(disk_llm(tmp_path, disk_cache_bytes=64 << 20), first, 10)
    data = bytearray(files[7].read_bytes())
    data[100] ^= 1
    files[7].write_bytes(bytes(data))
    stray = files[0].with_name(files[0].stem + ".7.tmp")  # what a crash mid-write leaves
    stray.write_bytes(b"half a block")
    fresh = disk_llm(tmp_path)  # a new engine and pool on the same directory
    assert not stray.exists() and not files[7].exists()  # cleaned up at start-up
    out = fresh.generate(prompt_token_ids=[second], sampling_params=PARAMS)[0]
    assert out.cached_tokens_by_tier["disk"] == 7 * PS  # blocks 0..6 intact, 7 corrupt
    assert_matches(out, want, min_hit=7 * PS)


def test_failing_disk_copy_is_recomputed(shared, tmp_path, monkeypatch):
    first, second, want = shared
    llm = disk_llm(tmp_path)
    warm(llm, first)
    pool = llm.engine.pool
    disk = pool.tiers.stores[Tier.DISK]
    real = disk.read_into
    calls = []

    def broken_second(hashes, out):
        calls.append(hashes)
        if len(calls) == 2:
            return real([b"\0" * 16], out)  # a block that is not there: the read fails
        return real(hashes, out)

    monkeypatch.setattr(disk, "read_into", broken_second)
    out = llm.generate(prompt_token_ids=[second], sampling_params=PARAMS)[0]
    assert_matches(out, want, min_hit=0)
    assert pool.stats().copy_errors >= 1


def test_full_filesystem_keeps_serving(shared, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("tmpfs mount not permitted here")
    try:
        first, second, want = shared
        llm = disk_llm(mnt, disk_cache_bytes=64 << 20)  # the budget is larger than the filesystem
        warm(llm, first)
        pool = llm.engine.pool
        assert pool.tiers.disk.used_bytes <= 64 * 1024
        assert pool.stats().copy_errors >= 1  # writes beyond the filesystem failed and were counted
        assert pool.stats().evictions["disk"] >= 1  # ...and made room for later writes
        out = llm.generate(prompt_token_ids=[second], sampling_params=PARAMS)[0]
        assert_matches(out, want, min_hit=0)
        assert not [p for p in mnt.iterdir() if p.suffix == ".tmp"]
        del llm, pool  # the disk tier holds the directory open
        gc.collect()
    finally:
        if subprocess.run(["umount", str(mnt)]).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)])


def test_disk_budget_evicts_least_recently_used(tmp_path):
    blocks_budget = 4 * DiskTier.file_bytes(15360)
    llm = disk_llm(tmp_path, disk_cache_bytes=blocks_budget)
    warm(llm, prompt(200, 13))
    pool = llm.engine.pool
    assert pool.tiers.disk.used_bytes <= blocks_budget
    assert pool.stats().evictions["disk"] > 0
    pool.tiers.index.check_invariants()


def test_disk_tier_stores_again_after_its_directory_is_restored(shared, tmp_path):
    """After LMCache #559: an operator restores ``disk_cache_dir`` (``rm -rf d; mkdir d``); the
    tier's own (namespaced) subdirectory is made again by its next write, so stores go on
    instead of failing for ever (copy errors climbing, bytes written flat)."""
    import shutil

    first, second, want = shared
    cache_dir = tmp_path / "d"
    llm = disk_llm(cache_dir)
    warm(llm, first)
    written = llm.engine.pool.stats().bytes_written["disk"]
    assert written > 0
    shutil.rmtree(cache_dir)
    cache_dir.mkdir()
    warm(llm, prompt(200, 21))  # new blocks written through to disk
    stats = llm.engine.pool.stats()
    assert stats.bytes_written["disk"] > written
    assert any(cache_dir.rglob("*.kvb"))
    # the files that went with the directory were looked up once each (the flush prompts'),
    # counted and dropped; after that no error climbs and every write lands
    lost = stats.copy_errors
    warm(llm, prompt(200, 22))
    again = llm.engine.pool.stats()
    assert again.copy_errors == lost and again.bytes_written["disk"] > stats.bytes_written["disk"]
    out = llm.generate(prompt_token_ids=[second], sampling_params=PARAMS)[0]  # the lost blocks: recomputed
    assert out.token_ids == want.token_ids
