"""The simulator on a hybrid model: ``kimi-k3-mi355x-128`` at a small scale (K3's real sizes,
a few 400K-token sessions), the pool's checkpoint store on its virtual-time tiers and the grid-only policy."""

import pytest
import torch
from kvtier.cache.checkpoints.store import CheckpointKind
from kvtier.cache.prefix_index import Tier
from kvtier.model.config import preset
from kvtier.model.hybrid_plan import hybrid_memory_plan
from kvtier.serve.hybrid_state import CheckpointPlan
from kvtier.cache.checkpoints.options import default_checkpoint_tokens
from kvtier.sim.copies import SimCopyEngine, TierLinks, VirtualClock
from kvtier.sim.hardware import Link
from kvtier.sim.run import SimOptions, run_scenario
from kvtier.sim.scenarios import SCENARIOS, Replay
from kvtier.sim.states import CheckpointSizes, sim_checkpoints


@pytest.fixture(scope="module")
def small_run():
    # 6 sessions, 3 at a time, 4 turns each: seconds on 2 cores; cold start (every turn reported)
    opts = SimOptions(scenario="kimi-k3-mi355x-128", sessions=6, concurrency=3, max_turns=4, ramp_s=10.0,
                      warmup_turns=0)
    return run_scenario(opts)


def test_scenario_has_k3_sizes(small_run):
    scn, workload, sizing, runs, prov = small_run
    plan = hybrid_memory_plan(preset("kimi-k3"), "mxfp4", 8, 288, parallel="tp")
    assert scn.model == "kimi-k3" and [v.name for v in scn.variants] == ["device-only", "tiered", "tiered-grid-only",
                                                                   "ideal"]
    assert sizing.block_bytes == 256 * plan.kv_bytes_per_token == 256 * 27_648
    states = sizing.states
    assert states.state_bytes == plan.state_bytes_per_sequence == preset("kimi-k3").state_bytes_per_sequence()
    assert states.link_bytes == states.state_bytes / 8
    assert states.checkpoint_tokens == default_checkpoint_tokens(states.state_bytes, 27_648, 256) == 16_384
    # the state slots and device checkpoints come out of the KV pages
    held = (states.state_slots + states.device_checkpoints) * states.state_bytes / 8
    assert sizing.device_pages == int((plan.free_bytes_per_device - held) // sizing.block_bytes)
    assert all(t.input_tokens == 409_600 + 4096 * k for s in workload.sessions for k, t in enumerate(s.turns))
    assert prov["per_variant"]["tiered"]["sections"]["state"]["saved"]["turn"] > 0


def test_checkpoints_saved_and_restored(small_run):
    _, _, _, runs, prov = small_run
    state = {name: v["sections"]["state"] for name, v in prov["per_variant"].items()}
    for name in ("device-only", "tiered", "tiered-grid-only"):
        assert sum(state[name]["hits"].values()) > 0, name
        assert state[name]["failures"] == dict.fromkeys(state[name]["failures"], 0)
    assert state["tiered"]["saved"]["turn"] > 0 and state["tiered"]["saved"]["grid"] > 0
    assert state["tiered"]["bytes_written"]["host"] > 0 and state["device-only"]["bytes_written"]["host"] == 0
    # grid only: no prompt or turn ends, so more matched tokens are recomputed past the last grid point
    assert state["tiered-grid-only"]["saved"]["turn"] == 0
    assert state["tiered-grid-only"]["tokens_lost"] > state["tiered"]["tokens_lost"]
    recomputed = {sr.run.name: sr.run.recomputed_tokens for sr in runs}
    assert recomputed["tiered-grid-only"] > recomputed["tiered"]


def test_warmup_turns_run_before_the_window_and_are_not_reported():
    assert SCENARIOS["kimi-k3-mi355x-128"].replay.warmup_turns == 1
    # the same sessions, no time cut: every turn of every started session runs
    opts = SimOptions(scenario="kimi-k3-mi355x-128", sessions=6, concurrency=3, max_turns=4, ramp_s=10.0,
                      duration_s=1e9)
    scn, workload, _, runs, prov = run_scenario(opts)
    turns = {s.session_id: len(s.turns) for s in workload.sessions}
    for sr in runs:
        name, records, warm = sr.run.name, sr.run.records, sr.warmup_records
        # warm-up turns: each started session's first, all of them run and none reported
        assert [r.turn for r in warm] == [0] * len(warm), name
        started = {r.session_id for r in warm}
        assert len(started) == len(warm) >= 3, name
        assert all(r.turn >= 1 for r in records), name
        # the window opened when the 3 active sessions had run their first turn; every first turn
        # (a session with only one ends then and the next starts) finished by then; after it no
        # session starts, so the measured sessions are those 3, each with all its later turns
        assert sr.window_s > 0 and sr.window_sessions == 3, name
        assert all(r.finish_s <= sr.window_s for r in warm), name
        assert all(r.arrival_s >= sr.window_s for r in records), name
        measured = {r.session_id for r in records}
        assert measured <= started and len(measured) == sr.window_sessions, name
        assert len(records) == sum(turns[s] - 1 for s in measured), name
        assert sorted((r.session_id, r.turn) for r in records) == sorted(
            (s, k) for s in measured for k in range(1, turns[s])), name
        assert prov["per_variant"][name]["warmup_requests"] == len(warm)
        assert prov["per_variant"][name]["window_s"] == sr.window_s
        # the run's counters are the window's: none negative
        assert sr.run.recomputed_tokens >= 0 and sr.run.preemptions >= 0
        for k, v in prov["per_variant"][name]["sections"]["state"].items():
            assert all(n >= 0 for n in v.values()) if isinstance(v, dict) else v >= 0, (name, k)
    with pytest.raises(ValueError, match="warmup_turns"):
        Replay(sessions=1, concurrency=1, warmup_turns=-1)


def _store(device_slots=0, host_slots=0, disk_slots=0):
    clock = VirtualClock()
    engine = SimCopyEngine(clock, TierLinks(1e6, Link(1e9, 1e-5), Link(1e8, 1e-4)))
    sizes = CheckpointSizes(8_000_000, 1_000_000, 256, device_slots, host_slots, disk_slots, 1)
    return clock, sim_checkpoints(sizes, engine, 1e-4, host=True, disk=True)  # 100-byte placeholders


P = torch.zeros(100, dtype=torch.uint8)


def test_store_reads_end_in_virtual_time():
    clock, store = _store(device_slots=1, host_slots=2, disk_slots=2)
    key = bytes(range(16))
    assert store.save(key, P, CheckpointKind.TURN) and not store.save(key, P, CheckpointKind.GRID)
    assert store.where(key) == [Tier.DEVICE, Tier.HOST]  # the disk copy is indexed once its write ended
    store.poll(wait=True)
    assert store.where(key) == [Tier.DEVICE, Tier.HOST, Tier.DISK]
    assert store.read(key, Tier.DEVICE).done()
    read = store.read(key, Tier.DISK)
    assert not read.done() and read.payload.numel() == 100
    start = clock.now
    assert store.ended(read) and clock.now > start  # waiting stalls the clock to the read's end
    assert clock.now >= 8_000_000 / 1e8  # the whole state over the 100 MB/s storage link
    assert store.stats.bytes_loaded["disk"] == 8_000_000 * 1e-4  # the whole state, in placeholder units
    missing = store.read(bytes(16), Tier.HOST)
    assert missing.done() and not store.ended(missing) and store.stats.failures["missing"] == 1


def test_store_drops_grid_before_turn_ends():
    _, store = _store(device_slots=2)
    turn, grid, new = b"t" * 16, b"g" * 16, b"n" * 16
    store.save(turn, P, CheckpointKind.TURN)
    store.save(grid, P, CheckpointKind.GRID)
    store.save(new, P, CheckpointKind.GRID)
    assert store.locate(grid) is None and store.locate(turn) == Tier.DEVICE and store.locate(new) == Tier.DEVICE
    store.protect([turn, new])
    store.save(b"x" * 16, P, CheckpointKind.TURN)
    assert store.stats.refused["device"] == 1 and store.stats.evictions["device"] == 1


def test_bad_options():
    with pytest.raises(ValueError, match="key"):
        _store(device_slots=1)[1].save(b"short", P, CheckpointKind.TURN)
    with pytest.raises(ValueError, match="policy"):
        CheckpointPlan(256, 16_384, "never")
    with pytest.raises(ValueError, match="checkpoint_tokens"):
        CheckpointPlan(256, 1000)
    assert SCENARIOS["kimi-k3-mi355x-128"].state_checkpoint_tokens == 0
