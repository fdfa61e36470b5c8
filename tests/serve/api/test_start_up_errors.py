"""``make_app`` refuses a bad ``model`` before anything is built, naming what it expected: a
mistyped preset or a missing path is reported as such, not as a missing tokenizer."""

from __future__ import annotations

import pytest

from kvtier.serve.api.server import make_app


@pytest.mark.parametrize("model", ["tinyy", "/nonexistent/model"])
def test_an_unknown_model_is_named_before_the_tokenizer(model):
    with pytest.raises(ValueError, match=r"model must be a checkpoint directory or a preset in \[.*'tiny'.*\], got") as e:
        make_app(model, tokenizer=None)
    assert repr(model) in str(e.value)


def test_a_preset_without_a_tokenizer_asks_for_one():
    with pytest.raises(ValueError, match=r"--tokenizer DIR is required for the preset 'tiny'"):
        make_app("tiny", tokenizer=None)
