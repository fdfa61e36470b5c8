"""``kvtier bench --model tiny-k3``: the hybrid preset runs the device-only configuration (the
tiered ones are skipped with a note: no prefix reuse across requests for hybrid models yet)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from kvtier.bench.configs import CONFIGS, for_hybrid
from kvtier.cli import main


def test_bench_tiny_k3_runs_device_only(tmp_path, caplog):
    out = tmp_path / "bench.json"
    threads = torch.get_num_threads()  # the bench sets its own (--threads, default 1)
    try:
        with caplog.at_level(logging.WARNING):
            rc = main(["bench", "--model", "tiny-k3", "--sessions", "2", "--concurrency", "2", "--max-turns", "2",
                       "--configs", "device-only,tiered", "--json", str(out), "--plot", ""])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    data = json.loads(out.read_text())
    assert list(data["configs"]) == ["device-only"]
    run = data["configs"]["device-only"]
    assert run["requests"] >= 2 and run["errors"] == 0
    assert "tiered are skipped" in caplog.text


def test_only_tiered_configs_for_a_hybrid_model_is_an_error_naming_the_option():
    with pytest.raises(ValueError, match=r"--configs tiered,tiered-tool-aware: model 'tiny-k3' is a hybrid"):
        for_hybrid([CONFIGS["tiered"], CONFIGS["tiered-tool-aware"]], "tiny-k3")
    assert [c.name for c in for_hybrid([CONFIGS["no-cache"], CONFIGS["device-only"]], "tiny-k3")] == [
        "no-cache", "device-only"]
