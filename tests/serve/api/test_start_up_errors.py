"""``make_app`` refuses a bad ``model`` before anything is built, naming what it expected: a
mistyped preset or a missing path is reported as such, not as a missing tokenizer."""

from __future__ import annotations

import pytest

from kvtier.serve.api.server import make_app


@pytest.mark.parametrize("model", ["tinyy", "/nonexistent/model"])
def test_an_unknown_model_is_named_before_the_tokenizer(model):
    with pytest.raises(ValueError, match=r"model must be a weights directory or a preset in \[.*'tiny'.*\], got") as e:
        make_app(model, tokenizer=None)
    assert repr(model) in str(e.value)


def test_a_preset_without_a_tokenizer_asks_for_one():
    with pytest.raises(ValueError, match=r"--tokenizer DIR is required for the preset 'tiny'"):
        make_app("tiny", tokenizer=None)


@pytest.mark.parametrize("dtype, name, gib", [("auto", "float32", "10,353"), ("bfloat16", "bfloat16", "5,177")])
def test_a_preset_too_large_to_run_names_the_dtype_it_was_sized_in(dtype, name, gib):
    """kimi-k3's random weights in the dtype they would run in (auto = float32 on a CPU): the size
    is that dtype's, not the 1.56 TB of the MXFP4 release, so the message names it."""
    from kvtier.serve.builder import load_for_serving

    with pytest.raises(ValueError, match=rf"preset 'kimi-k3' has {gib} GiB of weights in {name} .*"
                                         r"kvtier plan --model kimi-k3"):
        load_for_serving("kimi-k3", dtype=dtype)
