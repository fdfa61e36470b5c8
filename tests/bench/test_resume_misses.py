"""Resume-target misses counted from a replay's records (kvtier.bench.resume), in the simulator."""

import pytest

from kvtier.bench.resume import resume_misses
from kvtier.sim.run import SimOptions, run_scenario


def _run(**kw):
    return run_scenario(SimOptions(scenario="tiny", configs="tiered", resume_ttft_s=0.05, **kw))


def test_sim_counts_every_resume_once_and_each_miss_has_one_reason():
    _, workload, sizing, runs, _ = _run()
    records = runs[0].run.records
    got = resume_misses(workload, records, 0.05, sizing.page_size)
    after_tool = sum(1 for s in workload.sessions for k in range(1, len(s.turns)) if s.turns[k - 1].stop == "tool_use")
    ok = {(r.session_id, r.turn) for r in records if r.error is None}
    expected = sum(1 for s in workload.sessions for k in range(1, len(s.turns))
                   if s.turns[k - 1].stop == "tool_use" and (s.session_id, k) in ok)
    assert after_tool > 0 and got["resumes"] == expected == len(got["ttft_s"]) == len(got["found"])
    over = sum(1 for t in got["ttft_s"] if t > 0.05)
    assert sum(got["misses"].values()) == over
    # a looser target never misses more
    loose = resume_misses(workload, records, 10.0, sizing.page_size)
    assert sum(loose["misses"].values()) <= sum(got["misses"].values())


def test_an_own_prefill_over_the_target_is_its_own_reason_and_moves_no_resume():
    _, workload, sizing, runs, _ = _run()
    records = runs[0].run.records
    plain = resume_misses(workload, records, 0.002, sizing.page_size)
    assert plain["misses"]["prefill"] == 0  # no estimate: never the reason
    asked = []

    def prefill_s(new_tokens, cached_tokens):  # a long own prefill for every other resume that missed
        asked.append((new_tokens, cached_tokens))
        return 1.0 if len(asked) % 2 else 0.0

    got = resume_misses(workload, records, 0.002, sizing.page_size, prefill_s=prefill_s)
    missed = sum(plain["misses"].values())
    assert missed > 1 and len(asked) == missed  # asked once per miss, never for a met resume
    assert got["resumes"] == plain["resumes"] and sum(got["misses"].values()) == missed
    assert got["misses"]["prefill"] == (missed + 1) // 2
    assert all(n >= 0 and c % sizing.page_size == 0 for n, c in asked)


def test_declared_waits_reach_the_pool_as_recorded_waits(monkeypatch):
    seen = []
    from kvtier.cache.pool import KVPool
    orig = KVPool.tool_wait_blocks

    def spy(self, session_id, hashes, expected_wait_s):
        seen.append(expected_wait_s)
        return orig(self, session_id, hashes, expected_wait_s)

    monkeypatch.setattr(KVPool, "tool_wait_blocks", spy)
    _, workload, _, _, _ = run_scenario(SimOptions(scenario="kimi-mi355x-128", configs="tiered-tool-aware",
                                                   sessions=8, concurrency=4, duration_s=600.0, resume_ttft_s=0.5,
                                                   declared_waits=True))
    recorded = {t.think_time_s for s in workload.sessions for k, t in enumerate(s.turns)
                if k and s.turns[k - 1].stop == "tool_use"}
    assert seen and set(seen) <= recorded


def test_bad_arguments_are_named():
    _, workload, sizing, runs, _ = _run()
    with pytest.raises(ValueError, match="target_s"):
        resume_misses(workload, runs[0].run.records, 0.0)
    with pytest.raises(ValueError, match="page_size"):
        resume_misses(workload, runs[0].run.records, 1.0, 0)
    with pytest.raises(ValueError, match="resume-ttft-s"):
        SimOptions(scenario="tiny", resume_ttft_s=-1.0).resolve()
