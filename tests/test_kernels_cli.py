"""``kvtier kernels --profile DIR`` writes a Chrome trace with one ``kvtier::<op>`` range per op."""

from __future__ import annotations

import json

import pytest

from kvtier import cli

OPS = ["mla_decode", "mla_extend", "moe_route", "fused_moe", "sample", "gather_pages", "scatter_pages"]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kernels_profile_writes_trace(tmp_path, capsys, backend):
    assert cli.main(["kernels", "--profile", str(tmp_path), "--backend", backend, "--device", "cpu"]) == 0
    names = {e.get("name") for e in json.loads((tmp_path / "kvtier_kernels.json").read_text())["traceEvents"]}
    assert {f"kvtier::{op}" for op in OPS} <= names
    out = capsys.readouterr().out
    assert all(f"backend={backend}" in line for line in out.splitlines() if line.split()[0] in OPS)


def test_kernels_without_profile_is_an_error(capsys):
    assert cli.main(["kernels"]) == 2
    assert "--profile" in capsys.readouterr().err
