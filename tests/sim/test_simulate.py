"""The simulator: virtual-time copies and disk, the event loop over the real scheduler and pool,
the step timers, scenarios and the ``kvtier simulate`` command."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from kvtier.sim.calibrate import FEATURES, LinearTimer, fit_linear_timer
from kvtier.bench.configs import CONFIGS
from kvtier.bench.report import summarize
from kvtier.bench.resume import resume_misses
from kvtier.sim.copies import SimCopyEngine, SimDisk, TierLinks, VirtualClock
from kvtier.sim.engine import SimWorker
from kvtier.sim import hardware
from kvtier.sim.hardware import GB, Efficiency, Link
from kvtier.sim.loop import simulate
from kvtier.sim.run import (
    SimOptions,
    build_engines,
    make_timer,
    run_scenario,
    size_tiers,
)
from kvtier.sim.scenarios import SCENARIOS, Replay, Scenario, Variant, load_scenarios
from kvtier.sim.timing import (
    BatchShape,
    KernelRates,
    RooflineTimer,
    own_prefill_s,
    prefill_tok_s,
)
from kvtier.bench.workload import Session, Turn, Workload
from kvtier.cache.block_hash import block_hashes
from kvtier.cache.disk_tier import BlockMeta, DiskStatus
from kvtier.cache.pool import KVPool
from kvtier.cache.prefix_index import Tier
from kvtier.cache.tiers import DiskFiles
from kvtier.cli import main
from kvtier.model.config import preset
from kvtier.model.plan import memory_plan
from kvtier.serve.config import EngineConfig
from kvtier.serve.engine import Engine
from kvtier.serve.params import SamplingParams
from kvtier.serve.scheduler import Scheduler

PAGE = 4
STEP_S = 0.01
FAST = Link(bandwidth_Bps=1e12, latency_s=1e-6)


def _session(
    name: str, first_id: int, lengths: list[int], think_s: float = 0.0, out: int = 3
) -> Session:
    """Turns whose prompts extend each other block by block (ids first_id, first_id+1, ...)."""
    turns = [
        Turn(
            n,
            out,
            tuple(range(first_id, first_id + -(-n // PAGE))),
            think_s if k else 0.0,
            "tool_use" if k % 2 == 0 else "end_turn",
        )
        for k, n in enumerate(lengths)
    ]
    return Session(name, tuple(turns))


def _workload(sessions) -> Workload:
    return Workload(
        "test", "test", "builtin", PAGE, 1.0, 1.0, math.inf, tuple(sessions)
    )


def _engine(
    device_pages=64,
    host_blocks=0,
    disk=None,
    policy="lru",
    write="write-back",
    timer=None,
    links=None,
    max_context=8192,
) -> SimWorker:
    cfg = EngineConfig.of(
        page_size=PAGE,
        num_device_pages=device_pages,
        max_num_batched_tokens=64,
        host_cache_bytes=host_blocks * PAGE,
        cache_policy=policy,
        write_policy=write,
        disk_cache_bytes=disk.capacity_bytes if disk is not None else 0,
    )
    timer = timer or LinearTimer({"step": STEP_S})
    links = links or TierLinks(block_bytes=1e6, host=FAST, disk=FAST)
    return SimWorker(cfg, timer, links, preset("tiny"), max_context, disk=disk)


# ---------------------------------------------------------------- virtual-time copies and disk


def test_copies_queue_on_a_link_and_latency_overlaps():
    clock = VirtualClock()
    link = Link(bandwidth_Bps=1e9, latency_s=0.5)
    eng = SimCopyEngine(clock, TierLinks(block_bytes=1e9, host=link, disk=link))
    a = eng.scatter(None, None, [0])  # 1 s of bytes + 0.5 s latency
    b = eng.scatter(None, None, [1, 2])  # queues behind a's bytes: starts at 1 s
    c = eng.gather(None, [3], None)  # the other direction does not queue
    assert (a.start_s, a.end_s) == (0.0, 1.5)
    assert (b.start_s, b.end_s) == (1.0, 3.5)
    assert (c.start_s, c.end_s) == (0.0, 1.5)
    assert not a.done() and eng.next_end_s(after=0.0) == 1.5
    clock.advance_to(1.5)
    assert a.done() and not b.done() and a.result() == [0] and a.run_s == 1.5
    assert (
        b.result() == [0, 0] and clock.now == 3.5
    )  # waiting on a running copy stalls the clock
    assert b.run_s == 2.5  # service time, not the queueing before it
    assert eng.next_end_s(after=clock.now) is None
    assert eng.bytes_moved == {"device->host": 1e9, "host->device": 3e9, "disk": 0.0}


def test_sim_disk_capacity_missing_corrupt_and_sharing():
    meta = BlockMeta(1, PAGE, 1, 4, PAGE)
    disk = SimDisk(2 * 8192)  # two block files of DiskTier.file_bytes(4) = 8192 bytes
    heard = []
    disk.on_store.append(heard.append)
    assert disk.write(b"a" * 16, meta) == DiskStatus.OK
    assert disk.write(b"b" * 16, meta) == DiskStatus.OK
    assert disk.write(b"c" * 16, meta) == DiskStatus.FULL and disk.used_bytes == 16384
    assert heard == [b"a" * 16, b"b" * 16]  # a block that did not fit is not heard of
    assert disk.read(b"c" * 16, meta) == DiskStatus.MISSING
    assert (
        disk.read(b"a" * 16, dataclasses.replace(meta, dtype=2)) == DiskStatus.CORRUPT
    )
    assert not disk.contains(b"a" * 16) and disk.used_bytes == 8192
    with pytest.raises(ValueError, match="capacity_bytes"):
        SimDisk(-1)


def test_disk_jobs_take_effect_when_collected():
    clock = VirtualClock()
    disk = SimDisk(1 << 20)
    meta = BlockMeta(1, PAGE, 1, 4, PAGE)
    eng = SimCopyEngine(clock, TierLinks(1e6, host=FAST, disk=Link(1e6, 0.0)))
    files = DiskFiles(disk, meta, lambda: eng)  # the pool's disk tier, its jobs on the engine
    w = files.write([b"x" * 16], torch.zeros(PAGE, dtype=torch.uint8))
    assert not disk.contains(b"x" * 16)  # written when the job ends and is collected
    r = files.read_into([b"x" * 16, b"y" * 16], torch.zeros(2 * PAGE, dtype=torch.uint8))
    assert w.result() == [0] and disk.contains(b"x" * 16)
    assert r.result() == [0, DiskStatus.MISSING] and clock.now == 3.0


# ---------------------------------------------------------------- the event loop


def test_event_times_follow_steps_and_think_times():
    wl = _workload([_session("a", 0, [9, 15], think_s=0.5)])
    sr = simulate(
        [_engine()], wl, "device-only", concurrency=1
    )
    first, second = sorted(sr.run.records, key=lambda r: r.turn)
    # turn 0: one prefill step gives the first token, two decodes the other two
    assert (first.arrival_s, first.first_token_s, first.finish_s) == pytest.approx(
        (0.0, STEP_S, 3 * STEP_S)
    )
    # turn 1 is due think_time after turn 0 finished; its 8 full-block tokens come from the device
    assert second.arrival_s == pytest.approx(3 * STEP_S + 0.5)
    assert second.first_token_s == pytest.approx(second.arrival_s + STEP_S)
    assert second.cached_tokens == 8 and second.cached_tokens_by_tier["device"] == 8
    assert sr.run.wall_s == pytest.approx(
        second.finish_s
    ) and sr.end_s == pytest.approx(second.finish_s)
    assert [r.output_tokens for r in (first, second)] == [3, 3] and sr.busy_s == [
        pytest.approx(6 * STEP_S)
    ]


def test_concurrency_ramp_and_window():
    wl = _workload([_session(f"s{i}", 100 * i, [6, 10], think_s=0.2) for i in range(4)])
    sr = simulate(
        [_engine()], wl, "x", concurrency=2, ramp_s=1.0
    )
    starts = sorted(
        min(r.arrival_s for r in sr.run.records if r.session_id == s)
        for s in ("s0", "s1", "s2", "s3")
    )
    assert starts[:2] == pytest.approx(
        [0.0, 0.5]
    )  # session i of the ramp at i * ramp_s / concurrency
    spans = {
        s: (
            min(r.arrival_s for r in sr.run.records if r.session_id == s),
            max(r.finish_s for r in sr.run.records if r.session_id == s),
        )
        for s in ("s0", "s1", "s2", "s3")
    }
    for t, _ in spans.values():  # never more than two sessions active at once
        assert sum(1 for a, b in spans.values() if a <= t < b) <= 2
    windowed = simulate(
        [_engine()],
        wl,
        "x",
        concurrency=2,
        ramp_s=1.0,
        warmup_s=0.3,
        duration_s=0.6,
    )
    assert all(0.3 <= r.arrival_s < 0.6 for r in windowed.run.records)
    assert all(r.arrival_s < 0.3 for r in windowed.warmup_records)
    assert len(windowed.run.records) + len(windowed.warmup_records) < len(
        sr.run.records
    )
    assert 0 < windowed.run.wall_s <= 0.3 + 1e-9
    with pytest.raises(ValueError, match="warmup_s"):
        simulate(
            [_engine()],
            wl,
            "x",
            concurrency=1,
                warmup_s=1.0,
            duration_s=1.0,
        )


def test_refused_turn_is_an_error_record_and_the_session_goes_on():
    wl = _workload([_session("a", 0, [9, 400, 13])])
    sr = simulate(
        [_engine(device_pages=16)], wl, "x", concurrency=1
    )
    by_turn = {r.turn: r for r in sr.run.records}
    assert "num_device_pages" in by_turn[1].error and by_turn[1].first_token_s is None
    assert by_turn[0].error is None and by_turn[2].error is None
    sr = simulate([_engine(max_context=100)], wl, "x", concurrency=1)
    assert "max_position_embeddings=100" in {r.turn: r for r in sr.run.records}[1].error


def test_drives_the_real_scheduler_and_pool_through_every_tier():
    # Six long sessions interleaved over a device tier that holds about one: returning turns
    # find their blocks in host memory and on disk.
    wl = _workload(
        [
            _session(f"s{i}", 1000 * i, [41, 49, 57, 65], out=4, think_s=0.05)
            for i in range(6)
        ]
    )
    disk = SimDisk(64 * 8192)
    engine = _engine(device_pages=40, host_blocks=30, disk=disk)
    assert isinstance(engine.engine, Engine) and isinstance(engine.pool, KVPool)
    assert isinstance(engine.scheduler, Scheduler) and engine.engine.runner is engine.runner
    sr = simulate([engine], wl, "tiered", concurrency=6)
    stats = engine.pool.stats()
    assert (
        stats.hit_tokens["host"] > 0
        and stats.hit_tokens["disk"] > 0
        and stats.evictions["device"] > 0
    )
    s = summarize(sr.run)
    assert s["hit_tokens"]["host"] > 0 and s["errors"] == 0 and s["copy_errors"] == 0
    assert (
        sr.run.bytes_moved["host->device"]
        == stats.bytes_loaded["host"] * engine.bytes_scale
        > 0
    )
    assert disk.used_bytes > 0 and engine.copy_engine.bytes_moved["disk"] > 0
    engine.pool.tiers.index.check_invariants()
    plain = simulate(
        [_engine(device_pages=40)],
        wl,
        "device-only",
        concurrency=6,
    )
    assert sr.run.recomputed_tokens < plain.run.recomputed_tokens


def test_loads_collected_after_a_stall_that_cannot_be_placed_are_retried():
    # At 0.54 s two prompts start loading from host memory; taking pages for the second one's
    # loads stalls on write-back copies past the end of every load, so the step collects both at
    # once. The one placed first cannot get the pages it still needs: every waiting sequence
    # gives its pages back, nothing runs or loads, and the step must retry (as Engine.step does)
    # instead of reporting a pool too small for the waiting requests.
    engine = _engine(device_pages=32, host_blocks=32, write="write-back")
    clock = engine.clock
    # (arrival s, prefix, prompt tokens, output tokens): prompts with one prefix share it.
    turns = [(0.05, 2, 73, 17), (0.105, 0, 111, 12), (0.11, 3, 55, 18), (0.115, 2, 72, 16), (0.12, 0, 81, 11)]
    outs, added = [], 0
    while turns or engine.engine.has_unfinished():
        while turns and turns[0][0] <= clock.now:
            _, prefix, n, out = turns.pop(0)
            added += 1
            fresh = 10**6 * added
            ids = [*range(1000 * prefix, 1000 * prefix + n), *range(fresh, fresh + out)]
            params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
            engine.engine.add_hashed_request(n, block_hashes(ids, PAGE, None, b""), params, arrival_time=clock.now)
        if not engine.engine.has_unfinished():
            clock.advance_to(turns[0][0])
            continue
        t, step = engine.begin()  # the real Engine.begin_step, then the timed runner
        clock.advance_to(t)
        if step is not None:
            outs += engine.engine.end_step(step)
    assert [o.finish_reason for o in outs] == ["length"] * 5
    assert engine.pool.stats().hit_tokens["host"] > 0


def test_beginning_a_step_on_an_idle_worker_says_it_has_no_request():
    """An idle engine's ``begin_step`` returns None, as it does while loads are in flight; the
    worker must not read that as a load that will never end."""
    engine = _engine()
    with pytest.raises(RuntimeError, match="no request"):
        engine.begin()


def test_tool_waits_reach_the_pool_policy():
    wl = _workload([_session("a", 0, [9, 15, 22], think_s=0.5)])
    engine = _engine(host_blocks=16, policy="tool-aware")
    seen = []
    orig = engine.pool.tool_wait_blocks
    engine.pool.tool_wait_blocks = lambda sid, hashes, w: (
        seen.append((sid, len(hashes), w)),
        orig(sid, hashes, w),
    )
    simulate(
        [engine],
        wl,
        "tiered-tool-aware",
        concurrency=1,
        tool_aware=True,
    )
    assert seen == [
        ("a", 2, pytest.approx(9.0))
    ]  # turn 0 stopped on tool_use: its 2 full blocks, 9 s estimate
    assert engine.pool.tiers.policy.sessions == {}  # the session returned, then ended


def test_same_seed_same_result():
    opts = SimOptions("tiny")
    a = run_scenario(opts)[3]
    b = run_scenario(opts)[3]
    for x, y in zip(a, b, strict=True):
        assert x.run.records == y.run.records and x.run.bytes_moved == y.run.bytes_moved
    other = run_scenario(dataclasses.replace(opts, seed=5))[3]
    assert other[0].run.records != a[0].run.records


def test_prompts_carry_no_tokens():
    # A simulated prompt is the engine's own request type, given by its length and block hashes.
    engine = _engine()
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    hashes = block_hashes(list(range(12)), PAGE, None, b"")
    rid = engine.engine.add_hashed_request(9, hashes, params, arrival_time=0.0)
    seq = engine.engine.sequence(rid)
    assert seq.prompt_token_ids is None and seq.num_prompt_tokens == 9 and seq.num_tokens == 9
    with pytest.raises(ValueError, match="block hashes, not token ids"):
        seq.token_ids(0, 2)
    with pytest.raises(ValueError, match="block_hashes has 1 hashes"):
        engine.engine.add_hashed_request(9, hashes[:1], params)
    t, step = engine.begin()
    out = engine.engine.end_step(step)
    assert out == [] and seq.num_computed_tokens == 9 and seq.output_token_ids == [0] and t == STEP_S


def _two_workers(shared: bool) -> tuple[list[SimWorker], Workload]:
    scn = dataclasses.replace(
        SCENARIOS["tiny"], workers=2, store="network", page_size=PAGE
    )
    variant = Variant(
        "v", CONFIGS["tiered-write-through"], router="least-loaded", shared_store=shared
    )
    node = hardware.node("h200")
    wl = _workload(
        [_session(f"s{i}", 1000 * i, [41, 49, 57, 65], out=4) for i in range(4)]
    )
    sizing = dataclasses.replace(
        size_tiers(scn, preset("tiny"), node, wl), device_pages=80
    )
    return build_engines(
        scn, variant, sizing, make_timer(scn, preset("tiny"), node), node
    ), wl


def test_shared_store_is_indexed_by_every_worker():
    engines, wl = _two_workers(shared=True)
    assert engines[0].pool.shares_disk_with(engines[1].pool)
    sr = simulate(
        engines,
        wl,
        "migrate-reachable",
        concurrency=4,
        router="least-loaded",
    )
    stored = {h for h, _ in engines[0].pool.tiers.disk.blocks()}
    for e in engines:  # each worker indexes the blocks either wrote
        assert stored and all(
            len(e.pool.tiers.index.match([h], [Tier.DISK])) == 1 for h in stored
        )
    assert sr.migrations >= 0 and summarize(sr.run)["errors"] == 0
    private, _ = _two_workers(shared=False)
    assert not private[0].pool.shares_disk_with(private[1].pool)
    sticky = simulate(
        private, wl, "sticky", concurrency=4, router="sticky"
    )
    assert sticky.migrations == 0
    with pytest.raises(ValueError, match="disk tier"):
        _engine().pool.index_disk_block(b"x" * 16)


# ---------------------------------------------------------------- step timers


def test_roofline_terms_scale_as_documented():
    k2, node = preset("kimi-k2"), hardware.node("mi355x")
    eff = Efficiency(matrix=0.5, memory=0.8, layer_overhead_s=0.0, step_overhead_s=0.0)
    t = RooflineTimer(k2, node, eff)
    # decode attention is memory-bound under TP8 (8 heads per device, the whole latent cache
    # read by each): doubling every context adds the cache bytes read once more
    d1 = t.step_s(BatchShape((), 64, 64 * 100_000, 64))
    d2 = t.step_s(BatchShape((), 64, 64 * 200_000, 64))
    cache_bytes = 64 * 100_000 * k2.kv_cache_dim * 1.0 * k2.num_hidden_layers
    assert d2 - d1 == pytest.approx(
        cache_bytes / (node.accelerator.hbm_Bps * 0.8), rel=1e-3
    )
    # a long prefill on one device (no all-reduce) is compute-bound: twice the matrix
    # efficiency, about half the time
    node = hardware.node("mi355x", num_devices=1)
    t = RooflineTimer(k2, node, eff)
    fast = RooflineTimer(k2, node, dataclasses.replace(eff, matrix=1.0))
    chunk = BatchShape(((16384, 100_000),), 0, 0, 1)
    assert fast.step_s(chunk) / t.step_s(chunk) == pytest.approx(0.5, rel=0.05)
    assert t.step_s(BatchShape()) == 0.0
    weight_bytes = memory_plan(k2, "fp8").total_weight_bytes  # as the simulator sizes its tiers
    assert 50 * GB < weight_bytes / 16 < 70 * GB  # ~1.03 TB of FP8 weights
    assert (
        3e6
        < hardware.node("mi355x").kv_bytes_per_device(weight_bytes) / (k2.kv_cache_dim * 61)
        < 4e6
    )
    with pytest.raises(ValueError, match="no HBM"):
        hardware.node("h200", num_devices=2).kv_bytes_per_device(weight_bytes)


def test_linear_timer_fit_recovers_coefficients():
    truth = {
        "step": 2e-3,
        "prefill_tokens": 1e-4,
        "decodes": 5e-4,
        "decode_context": 1e-7,
        "sampled": 3e-4,
    }
    chunks = [(), ((16, 0),), ((64, 512),), ((256, 0), (16, 900))]
    shapes = [
        BatchShape(ext, d, d * c, d + s)
        for ext in chunks
        for d in (0, 2, 5)
        for c in (100, 900)
        for s in (0, 1)
        if ext or d
    ]  # an empty step takes no time
    seconds = [LinearTimer(truth).step_s(s) for s in shapes]
    fit = fit_linear_timer(shapes, seconds)
    for f in FEATURES:
        assert fit.coefficients.get(f, 0.0) == pytest.approx(
            truth.get(f, 0.0), abs=1e-9
        )
    assert prefill_tok_s(fit, 64) == pytest.approx(
        64 / LinearTimer(truth).step_s(BatchShape(((64, 0),), 0, 0, 1))
    )
    with pytest.raises(ValueError, match="unknown feature"):
        LinearTimer({"bogus": 1.0})
    with pytest.raises(ValueError, match="samples"):
        fit_linear_timer(shapes[:2], seconds[:2])


def test_kernel_rates_from_perf_csv(tmp_path):
    csv_path = tmp_path / "k.csv"
    csv_path.write_text(
        "op,shape,device,tflop_s,gb_s\n"
        "fused_moe,T1,AMD Instinct MI355X,10,900\nfused_moe,T4096,AMD Instinct MI355X,1800,\n"
        "mla_decode,b64,AMD Instinct MI355X,40,5200\nmla_extend,b1,AMD Instinct MI355X,700,100\n"
        "fused_moe,T4096,NVIDIA H200,900,0\n"
    )
    rates = KernelRates.from_csv([csv_path], "MI355X")
    assert (rates.gemm_flops, rates.attention_flops, rates.attention_Bps) == (
        1.8e15,
        7e14,
        5.2e12,
    )
    timer = RooflineTimer(preset("kimi-k2"), hardware.node("mi355x"), rates=rates)
    assert timer.step_s(BatchShape(((4096, 0),), 0, 0, 1)) > 0
    with pytest.raises(ValueError, match="no row"):
        KernelRates.from_csv([csv_path], "B200")
    bad = tmp_path / "bad.csv"
    bad.write_text("op,device\nx,y\n")
    with pytest.raises(ValueError, match="lacks column"):
        KernelRates.from_csv([bad], "MI355X")


# ---------------------------------------------------------------- scenarios and the command


def test_scenarios_are_consistent_and_size_from_hardware():
    for scn in SCENARIOS.values():
        assert scn.baseline in {v.name for v in scn.variants}
    scn = SCENARIOS["kimi-mi355x-128"]
    wl = Workload(
        "t",
        "t",
        "builtin",
        64,
        1.0,
        1.0,
        math.inf,
        (Session("a", (Turn(64_000, 10, tuple(range(1000)), 0.0, ""),)),),
    )
    sizing = size_tiers(scn, preset("kimi-k2"), hardware.node("mi355x"), wl)
    assert sizing.block_bytes == 256 * 61 * 576 * 2  # bf16 KV of one 256-token page
    assert (
        6_500 < sizing.device_pages < 7_250
    )  # ~1.74M tokens of HBM left after FP8 weights
    assert sizing.host_slots == int(2**40 // sizing.block_bytes)
    with pytest.raises(ValueError, match="unknown configuration"):
        scn.select("bogus")
    with pytest.raises(ValueError, match="router"):
        Variant("x", CONFIGS["tiered"], router="random")
    with pytest.raises(ValueError, match="baseline"):
        dataclasses.replace(scn, baseline="nope")
    with pytest.raises(ValueError, match="warmup_s"):
        Replay(sessions=1, concurrency=1, warmup_s=5.0, duration_s=5.0)
    assert isinstance(scn, Scenario)


def test_scenario_and_hardware_files_are_checked_field_by_field(tmp_path):
    kimi = SCENARIOS["kimi-mi355x-128"]
    # the think-time cap is kv-cache-tester's --max-delay (600 s) before the fitted scale
    assert kimi.replay.max_think_s == pytest.approx(600 * kimi.replay.time_scale)
    migration = SCENARIOS["migration"]  # `like` the published scenario, with its own replay size
    assert migration.efficiency == kimi.efficiency and migration.replay.ramp_s == kimi.replay.ramp_s
    assert (migration.replay.sessions, migration.workers) == (512, 2)
    base = 'model = "tiny"\nnode = "h200"\nworkers = 1\nstore = "disk"\npage_size = 1\n'
    base += 'max_num_batched_tokens = 64\nvariants = ["tiered"]\nbaseline = "tiered"\n'
    for extra, match in (
        ('description = "x"\nwhat = 1\nreplay = { sessions = 1, concurrency = 1 }', r"\[s\]: unknown field\(s\) \['what'\]"),
        ('description = "x"\nreplay = { concurrency = 1 }', r"\[s\] replay: .*'sessions'"),
        ('description = "x"\nreplay = { sessions = 0, concurrency = 1 }', r"\[s\] replay: sessions must be an int >= 1"),
        ('description = "x"\nlike = "s"\nreplay = { sessions = 1, concurrency = 1 }', "like must name another"),
        ('description = "x"\nreplay = { sessions = 1, concurrency = 1 }\nefficiency = { matrix = 1.5 }',
         r"efficiency: Efficiency.matrix must be a finite number > 0 and <= 1"),
    ):
        path = tmp_path / "s.toml"
        path.write_text("[s]\n" + base + extra + "\n")
        with pytest.raises(ValueError, match=match):
            load_scenarios(path)
    path.write_text('[s]\nreplay = { sessions = 1, concurrency = 1 }\n' + base.replace('["tiered"]', '[{ name = "a", cache = "nope" }]'))
    with pytest.raises(ValueError, match=r"variants\[0\]: cache must be one of"):
        load_scenarios(path)
    hw = tmp_path / "hw.toml"
    hw.write_text('[accelerator.x]\nname = "X"\nhbm_bytes = 1\nhbm_Bps = 1\nbf16_flops = 1\nfp8_flops = 0\n'
                  "interconnect = { bandwidth_Bps = 1 }\n")
    with pytest.raises(ValueError, match=r"hw.toml \[accelerator.x\]: Accelerator.fp8_flops must be a finite number > 0"):
        hardware._load(hw)
    hw.write_text("[node]\nhost_link = { bandwidth_Bps = 1, latency = 2 }\n")
    with pytest.raises(ValueError, match=r"\[node\] host_link: unknown field\(s\) \['latency'\]"):
        hardware._load(hw)


def test_cli_simulate_tiny(tmp_path, capsys):
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    rc = main(
        ["simulate", "--scenario", "tiny", "--json", str(out), "--plot", str(png)]
    )
    assert rc == 0 and png.stat().st_size > 0
    data = json.loads(out.read_text())
    assert set(data) == {"provenance", "configs", "comparison", "bound"}
    assert (
        set(data["configs"]) == {"device-only", "tiered", "ideal"}
        and "tiered" in data["comparison"]
        and set(data["bound"]) == {"device-only", "tiered"}
    )
    prov = data["provenance"]
    assert (
        prov["kind"] == "simulation"
        and prov["scenario"] == "tiny"
        and prov["replay"]["duration_s"] is None
    )
    assert (
        data["configs"]["tiered"]["requests"] == 18
        and data["configs"]["tiered"]["ttft_s"]["p99"] > 0
    )
    assert "kvtier simulate tiny" in capsys.readouterr().out


def test_cli_simulate_errors(capsys):
    assert main(["simulate", "--scenario", "nope", "--plot", ""]) == 2
    assert "unknown scenario 'nope'" in capsys.readouterr().err
    assert (
        main(
            [
                "simulate",
                "--scenario",
                "tiny",
                "--configs",
                "tiered,bogus",
                "--plot",
                "",
            ]
        )
        == 2
    )
    assert "unknown configuration(s) ['bogus']" in capsys.readouterr().err
    assert main(["simulate", "--scenario", "tiny", "--configs", " , ", "--plot", ""]) == 2
    assert "--configs is empty" in capsys.readouterr().err
    assert main(["simulate", "--scenario", "tiny", "--node", "tpu", "--plot", ""]) == 2
    assert "--node" in capsys.readouterr().err
    assert (
        main(["simulate", "--list"]) == 0
        and "kimi-mi355x-128" in capsys.readouterr().out
    )


def test_replay_tool_options_override_the_scenario(capsys):
    base = SimOptions("kimi-mi355x-128").resolve()
    assert base.replay.truncate_input_tokens == 128_000 and base.replay.warm_prefix_fraction == 0.5
    assert base.kv_dtype_bytes == 2.0
    scn = SimOptions(
        "kimi-mi355x-128", truncate_input_tokens=0, warm_prefix_fraction=0.0, kv_dtype_bytes=1.0
    ).resolve()
    assert scn.replay.truncate_input_tokens is None and scn.replay.warm_prefix_fraction == 0.0
    assert scn.kv_dtype_bytes == 1.0
    assert SimOptions("tiny", truncate_input_tokens=500).resolve().replay.truncate_input_tokens == 500
    for bad, match in (
        ({"truncate_input_tokens": -1}, "truncate_input_tokens"),
        ({"warm_prefix_fraction": 1.5}, "warm_prefix_fraction"),
        ({"kv_dtype_bytes": 0.0}, "kv_dtype_bytes"),
    ):
        with pytest.raises(ValueError, match=match):
            SimOptions("kimi-mi355x-128", **bad).resolve()
    assert main(["simulate", "--scenario", "tiny", "--warm-prefix-fraction", "2", "--plot", ""]) == 2
    assert "warm_prefix_fraction must be a number in [0, 1], got 2.0" in capsys.readouterr().err
    # The built-in workload stops its sessions at the limit.
    _, full, _, _, _ = run_scenario(SimOptions("tiny", configs="device-only"))
    _, cut, _, _, _ = run_scenario(SimOptions("tiny", configs="device-only", truncate_input_tokens=300))
    longest = max(t.input_tokens for s in full.sessions for t in s.turns)
    assert longest > 300 >= max(t.input_tokens for s in cut.sessions for t in s.turns)
    assert len(cut.sessions) == len(full.sessions) and cut.num_requests() < full.num_requests()


def test_ramp_override_spreads_the_first_sessions_starts(capsys):
    assert SimOptions("kimi-mi355x-128").resolve().replay.ramp_s == 300.0
    for bad in (-1.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="ramp_s must be a finite number >= 0"):
            SimOptions("tiny", ramp_s=bad).resolve()
    starts = {}
    for ramp in (0.0, 20.0):
        scn, _, _, runs, _ = run_scenario(SimOptions("tiny", configs="device-only", ramp_s=ramp))
        first = sorted(r.arrival_s for r in runs[0].run.records if r.turn == 0)
        starts[ramp] = first[: scn.replay.concurrency]
    assert starts[0.0] == [0.0] * len(starts[0.0]) and len(starts[0.0]) > 1
    assert 0.0 == starts[20.0][0] < starts[20.0][-1] < 20.0
    assert main(["simulate", "--scenario", "tiny", "--ramp-s", "-2", "--plot", ""]) == 2
    assert "ramp_s must be a finite number >= 0, got -2.0 (float)" in capsys.readouterr().err


def test_schedule_policy_reaches_the_simulated_engines():
    scn = SimOptions("tiny", schedule_policy="cache-aware").resolve()
    assert scn.schedule_policy == "cache-aware" and SimOptions("tiny").resolve().schedule_policy == "fcfs"
    with pytest.raises(ValueError, match="schedule_policy must be one of"):
        SimOptions("tiny", schedule_policy="lifo").resolve()


@pytest.mark.parametrize("policy", ["least-loaded", "kv-aware", "sticky"])
def test_the_simulator_routes_with_the_real_router_policy(monkeypatch, policy):
    import kvtier.sim.loop as loop
    from kvtier.cluster.router.routing import Router

    made: list[Router] = []

    class Spy(Router):
        def __post_init__(self) -> None:
            super().__post_init__()
            self.chosen: list[str] = []
            made.append(self)

        def choose(self, session_id, prompt_tokens):
            url = super().choose(session_id, prompt_tokens)
            self.chosen.append(url)
            return url

    monkeypatch.setattr(loop, "Router", Spy)
    engines, wl = _two_workers(shared=True)
    sr = simulate(engines, wl, policy, concurrency=4, router=policy)
    (router,) = made
    assert router.policy == policy and router.remote
    assert len(router.chosen) == wl.num_requests()  # every turn was placed by the router
    assert sr.migrations == router.moves  # what it recorded is what the simulator counted
    assert set(router.sessions) == {s.session_id for s in wl.sessions}
    if policy == "sticky":
        assert sr.migrations == 0


def test_cli_simulate_resume_target(tmp_path, capsys):
    """--resume-ttft-s: each configuration's resumes and misses by why, on the console and in the
    JSON, as kvtier.bench.resume counts them from the same run's records."""
    out = tmp_path / "sim.json"
    assert main(["simulate", "--scenario", "tiny", "--resume-ttft-s", "0.002", "--json", str(out), "--plot", ""]) == 0
    shown = capsys.readouterr().out
    assert "resumes after a tool wait against the 0.002 s target" in shown
    per_variant = json.loads(out.read_text())["provenance"]["per_variant"]
    opts = SimOptions("tiny", resume_ttft_s=0.002)
    scn, workload, sizing, runs, _ = run_scenario(opts)
    timer = make_timer(scn, preset(scn.model), hardware.node(scn.node))
    for sr in runs:
        got = resume_misses(workload, sr.run.records, 0.002, sizing.page_size,
                            prefill_s=lambda n, c: own_prefill_s(timer, n, c))
        written = per_variant[sr.run.name]["resume"]
        assert written == {"target_s": 0.002, "resumes": got["resumes"], "misses": got["misses"]}
        assert written["resumes"] > 0 and sum(written["misses"].values()) > 0  # 2 ms: below a step
    assert "resume" not in run_scenario(SimOptions("tiny"))[4]["per_variant"]["tiered"]  # no target: not counted
    assert main(["simulate", "--scenario", "tiny", "--resume-ttft-s", "0", "--plot", ""]) == 2
    assert "--resume-ttft-s must be a finite number > 0" in capsys.readouterr().err
