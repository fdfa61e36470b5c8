"""The checkpoint options as one record (:class:`kvtier.cache.checkpoints.options.CheckpointOptions`):
its checks name the command-line option, it gives a server the same options back, and the pool
config takes its fields."""

from __future__ import annotations

import pytest

from kvtier.cache.checkpoints.options import CheckpointOptions, bytes_per_copy
from kvtier.cache.config import PoolConfig


@pytest.mark.parametrize("kwargs, match", [
    (dict(state_checkpoint_tokens=0), "--state-checkpoint-tokens must be a positive multiple of the page size, got 0"),
    (dict(state_checkpoint_tokens=24, page_size=16), "positive multiple of the page size \\(16 tokens\\), got 24"),
    (dict(state_checkpoint_tokens=48, page_size=32, page_size_name="--page-size 32"), "of --page-size 32, got 48"),
    (dict(state_host_bytes=-1), "--state-host-bytes must be >= 0 bytes"),
    (dict(state_disk_bytes=1.5), "--state-disk-bytes must be >= 0 bytes"),
    (dict(state_device_bytes=True), "--state-device-bytes must be >= 0 bytes"),
])
def test_bad_options_name_the_command_line_option(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CheckpointOptions(**kwargs)


def test_the_record_round_trips_through_the_serve_command_line():
    from kvtier.cli import build_parser
    from kvtier.cli.serve import state_options

    opts = CheckpointOptions(state_checkpoint_tokens=64, state_device_bytes=0, state_host_bytes=1 << 20)
    assert opts.given() == ["--state-checkpoint-tokens", "--state-device-bytes", "--state-host-bytes"]
    args = build_parser().parse_args(["serve", "tiny-k3", *opts.args()])
    assert state_options(args, "--page-size 16") == opts
    assert state_options(build_parser().parse_args(["serve", "tiny-k3"])) == CheckpointOptions()


def test_the_pool_config_takes_its_fields():
    pool = PoolConfig(page_size=16, **CheckpointOptions(state_host_bytes=8192).pool_fields())
    assert (pool.state_checkpoint_tokens, pool.state_host_bytes, pool.state_device_bytes) == (0, 8192, None)
    kept = pool.keeping_checkpoints(5000, 100)  # 50 tokens of KV per checkpoint: 4 pages
    assert (kept.state_checkpoint_bytes, kept.state_checkpoint_tokens) == (5000, 64)
    grid = PoolConfig(page_size=16, **CheckpointOptions(state_checkpoint_tokens=32).pool_fields())
    assert grid.keeping_checkpoints(5000, 100).state_checkpoint_tokens == 32


def test_model_checks():
    CheckpointOptions().check_model(0, "tiny")  # nothing given: nothing to refuse
    with pytest.raises(ValueError, match="--state-host-bytes apply to hybrid KDA \\+ MLA models only"):
        CheckpointOptions(state_host_bytes=1 << 20).check_model(0, "tiny")
    floors = bytes_per_copy(5000)
    assert floors == {"device": 5000, "host": 8192, "disk": 4096 + 8192}
    CheckpointOptions(state_host_bytes=0, state_disk_bytes=floors["disk"]).check_model(5000, "tiny-k3")
    with pytest.raises(ValueError, match="--state-host-bytes=6000 is smaller than one state checkpoint of model "
                                         "'tiny-k3' \\(8192 bytes for a 5000-byte checkpoint\\)"):
        CheckpointOptions(state_host_bytes=6000).check_model(5000, "tiny-k3")
