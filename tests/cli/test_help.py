"""``kvtier --help`` of every subcommand: the options with a fixed set of values
(``--cache-policy``, ``--cache-write-policy``, ``--role``, ``--dtype``) list their choices (the
library's own constants) and their defaults; a value outside the choices is refused by the parser;
a mistyped preset names the nearest one, wherever a preset is taken."""

from __future__ import annotations

import argparse

import pytest

from kvtier.cache.config import CACHE_POLICIES, WRITE_POLICIES
from kvtier.cli import SUBCOMMANDS, build_parser, main
from kvtier.cluster.disagg.routes import ROLES
from kvtier.model import preset
from kvtier.model.checkpoint import WEIGHT_DTYPES
from kvtier.serve.builder import COMPUTE_DTYPES, check_model

CHOICES = {("serve", "--cache-policy"): CACHE_POLICIES, ("serve", "--cache-write-policy"): WRITE_POLICIES,
           ("serve", "--role"): ROLES, ("serve", "--dtype"): COMPUTE_DTYPES,
           ("create-checkpoint", "--dtype"): tuple(WEIGHT_DTYPES)}


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_subcommand_with_these_options_lists_choices_and_default():
    subs = _subparsers()
    assert len(subs) == len(SUBCOMMANDS)
    found = set()
    for name, p in subs.items():
        text = p.format_help()
        for action in p._actions:
            opt = next((o for o in action.option_strings if o in
                        ("--cache-policy", "--cache-write-policy", "--role", "--dtype")), None)
            if opt is None:
                continue
            found.add((name, opt))
            assert tuple(action.choices or ()) == CHOICES[name, opt], (name, opt)
            assert f"{opt} {{{','.join(action.choices)}}}" in text, (name, opt)
            assert action.default in action.choices
            assert f"(default: {action.default})" in " ".join(text.split()), (name, opt)
    assert found == set(CHOICES)


@pytest.mark.parametrize("argv, option", [(["serve", "tiny", "--cache-policy", "lfu"], "--cache-policy"),
                                          (["serve", "tiny", "--cache-write-policy", "writeback"],
                                           "--cache-write-policy"),
                                          (["serve", "tiny", "--role", "prefil"], "--role"),
                                          (["serve", "tiny", "--dtype", "fp16"], "--dtype"),
                                          (["create-checkpoint", "x", "--dtype", "int8"], "--dtype")])
def test_a_value_outside_the_choices_is_refused_by_the_parser(argv, option, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    assert f"argument {option}" in capsys.readouterr().err


def test_create_checkpoint_names_the_nearest_preset(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["create-checkpoint", str(tmp_path / "x"), "--preset", "tiny-k2"])
    assert e.value.code == 2
    assert "unknown preset 'tiny-k2'; did you mean 'tiny-k3'?" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("argv, wrong, right", [(["plan", "--model", "kimi-k3x"], "kimi-k3x", "kimi-k3"),
                                                (["serve", "tny"], "tny", "tiny"),
                                                (["generate", "--model", "kimik2"], "kimik2", "kimi-k2")])
def test_commands_name_the_nearest_preset(argv, wrong, right, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"got {wrong!r}; did you mean {right!r}?" in err, err


def test_the_library_names_the_nearest_preset_and_no_preset_for_a_path():
    with pytest.raises(ValueError, match=r"unknown model preset 'Tiny'; .*did you mean 'tiny'\?"):
        preset("Tiny")
    with pytest.raises(ValueError, match=r"got 'kimi_linear_48b'; did you mean 'kimi-linear-48b'\?"):
        check_model("kimi_linear_48b")
    with pytest.raises(ValueError) as e:
        check_model("/nonexistent/model")
    assert "did you mean" not in str(e.value)
