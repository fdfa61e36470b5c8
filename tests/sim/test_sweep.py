"""``kvtier simulate --sweep``: the sessions each configuration holds under a p99 TTFT target, and
a headline only from a load the baseline holds."""

import json

import pytest

from kvtier.cli import main
from kvtier.sim.sweep import held, parse_sweep, sweep_json, sweep_lines


def _point(c: int, p99: dict[str, float], tput: dict[str, float]) -> dict:
    return {"concurrency": c, "sessions": 2 * c, "bound": {},
            "configs": {n: {"ttft_s": {"p99": p99[n]}, "throughput_tok_s": tput[n]} for n in p99}}


POINTS = [_point(8, {"device-only": 12.0, "tiered": 1.0}, {"device-only": 100.0, "tiered": 120.0}),
          _point(16, {"device-only": 25.0, "tiered": 2.0}, {"device-only": 150.0, "tiered": 230.0}),
          _point(32, {"device-only": 900.0, "tiered": 20.0}, {"device-only": 160.0, "tiered": 400.0}),
          _point(64, {"device-only": 20.0, "tiered": 300.0}, {"device-only": 170.0, "tiered": 420.0})]


def test_held_is_the_highest_load_with_every_lower_one_under_the_target():
    assert held(POINTS, "tiered", 30.0) == (32, 400.0)
    assert held(POINTS, "device-only", 30.0) == (16, 150.0)  # 64 is under 30 s again, but 32 missed
    assert held(POINTS, "device-only", 10.0) == (None, None)


def test_headline_is_taken_where_the_baseline_still_holds():
    doc = sweep_json(POINTS, 30.0, "device-only")
    hl = doc["headline"]
    assert hl["at_sessions"] == 16 and hl["sessions_held_ratio"] == pytest.approx(2.0)
    assert hl["ttft_p99_ratio"] == pytest.approx(12.5) and hl["baseline_ttft_p99_s"] <= doc["target_s"]
    assert doc["held"]["tiered"] == {"sessions": 32, "throughput_tok_s": 400.0}
    none = sweep_json(POINTS, 5.0, "device-only")["headline"]  # the baseline holds no load: no ratio
    assert none["sessions_held_ratio"] is None and none["ttft_p99_ratio"] is None
    assert any("headline: none" in line for line in sweep_lines(sweep_json(POINTS, 5.0, "device-only")))
    with pytest.raises(ValueError, match="no configuration 'ideal'"):
        sweep_json(POINTS, 30.0, "device-only", "ideal")
    with pytest.raises(ValueError, match="--ttft-target-s"):
        sweep_json(POINTS, 0.0, "device-only")


@pytest.mark.parametrize("text", ["", "8,x", "0,8", "8,8"])
def test_parse_sweep_rejects_bad_lists(text):
    with pytest.raises(ValueError, match="--sweep"):
        parse_sweep(text)
    assert parse_sweep("32,8,16") == (8, 16, 32)


def test_cli_sweep_on_the_tiny_scenario(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert main(["simulate", "--scenario", "tiny", "--sweep", "2,3", "--ttft-target-s", "5", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())["sweep"]
    assert [p["concurrency"] for p in doc["points"]] == [2, 3]
    assert set(doc["points"][0]["configs"]) == {"device-only", "tiered", "ideal"}
    assert set(doc["points"][0]["bound"]) == {"device-only", "tiered"}
    assert doc["headline"]["at_sessions"] == 3  # tiny is far under a 5 s target at both loads
    assert "headline: sessions held tiered / device-only" in capsys.readouterr().out
    assert main(["simulate", "--scenario", "tiny", "--sweep", "2", "--concurrency", "2"]) == 2
