"""The recurrent-state checkpoint options of ``kvtier serve`` (hybrid KDA + MLA models):
``--state-checkpoint-tokens`` and the checkpoint budgets per tier, each refused with a clean
error (exit status 2, no traceback) that names the option and says what was expected."""

from __future__ import annotations

import pytest

from kvtier.cli import build_parser, main
from tests.conftest import TOKENIZER_DIR


@pytest.mark.parametrize(("argv", "expected"), [
    (["--state-checkpoint-tokens", "24"], "--state-checkpoint-tokens must be a positive multiple of --page-size 16, "
                                          "got 24"),
    (["--state-checkpoint-tokens", "0"], "--state-checkpoint-tokens must be a positive multiple of --page-size 16, "
                                         "got 0"),
    (["--page-size", "32", "--state-checkpoint-tokens", "48"], "positive multiple of --page-size 32, got 48"),
    (["--state-device-bytes", "-1"], "--state-device-bytes must be >= 0 bytes"),
    (["--state-host-bytes", "-5"], "--state-host-bytes must be >= 0 bytes"),
    (["--state-disk-bytes", "-1"], "--state-disk-bytes must be >= 0 bytes"),
])
def test_serve_refuses_bad_state_options_before_the_model_loads(capsys, argv, expected):
    assert main(["serve", "tiny-k3", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier serve: error: ") and expected in err and "Traceback" not in err, err


def test_state_options_reach_the_engine_arguments():
    args = build_parser().parse_args(["serve", "tiny-k3", "--state-checkpoint-tokens", "64", "--state-device-bytes",
                                      "0", "--state-host-bytes", "1048576"])
    assert (args.state_checkpoint_tokens, args.state_device_bytes, args.state_host_bytes, args.state_disk_bytes) == (
        64, 0, 1 << 20, None)
    defaults = build_parser().parse_args(["serve", "tiny-k3"])
    assert (defaults.state_checkpoint_tokens, defaults.state_device_bytes, defaults.state_host_bytes,
            defaults.state_disk_bytes) == (None, None, None, None)


@pytest.mark.parametrize(("argv", "name"), [
    (["--host-cache-bytes", str(8 << 20), "--state-host-bytes", "1000"], "state_host_bytes (--state-host-bytes)=1000"),
    (["--state-device-bytes", "1000"], "state_device_bytes (--state-device-bytes)=1000"),
])
def test_serve_refuses_a_budget_below_one_checkpoint_cleanly(capsys, argv, name):
    # the pool knows the checkpoint's size once the model is built (~1 s for tiny-k3); the
    # server must not start, and the CLI prints the pool's message, not a traceback
    if not (TOKENIZER_DIR / "tiktoken.model").is_file():
        pytest.skip(f"real Kimi tokenizer files not present at {TOKENIZER_DIR}")
    assert main(["serve", "tiny-k3", "--tokenizer", str(TOKENIZER_DIR), "--port", "0", "--num-device-pages", "64",
                 *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier serve: error: ") and "Traceback" not in err, err
    assert name in err and "is smaller than one state checkpoint" in err and "-byte checkpoint" in err, err
