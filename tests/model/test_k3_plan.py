"""The hybrid memory plan (``kvtier plan --model kimi-k3``, :func:`kvtier.model.hybrid_plan.hybrid_memory_plan`):
K3's byte counts from its config, a hand-computed session count, and docs/k3.md's output block and
table recomputed from the function."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.model import preset
from kvtier.model.hybrid_plan import SESSION_LENGTHS, hybrid_memory_plan, hybrid_parameter_bytes
from kvtier.model.plan import GB
from kvtier.model.plan_report import plan_report

K3 = preset("kimi-k3")
DOC = Path(__file__).resolve().parents[2] / "docs" / "k3.md"


def test_k3_bytes_from_the_config():
    """MLA KV per token: (512 + 64) x 24 MLA layers x 2 B = 27,648. KDA state per sequence, 69 layers:
    recurrent 96 x 128 x 128 x 4 B = 6,291,456 per layer (fp32) -> 434,110,464 (414.0 MiB), in bf16
    217,055,232 (207.0 MiB); conv window 36,864 channels x 3 x 2 B = 221,184 per layer -> 15,261,696."""
    p = hybrid_memory_plan(K3, "mxfp4", 8, 288)
    assert p.kv_bytes_per_token == 27_648 == 576 * 24 * 2
    assert p.recurrent_bytes_per_sequence == 69 * 96 * 128 * 128 * 4 == 434_110_464
    assert p.conv_bytes_per_sequence == 69 * 36_864 * 3 * 2 == 15_261_696
    assert hybrid_memory_plan(K3, "mxfp4", 8, 288, state_dtype="bf16").recurrent_bytes_per_sequence == 217_055_232
    assert hybrid_memory_plan(K3, kv_dtype_bytes=1).kv_bytes_per_token == 13_824


def test_k3_routed_experts_in_mxfp4():
    """92 MoE layers x 896 experts x (2 x 3072 x 3584 + 3584 x 3072) weights = 2,722,746,335,232;
    MXFP4 holds each at 1/2 + 1/32 byte -> 1,446,458,990,592 bytes; bf16 at 2."""
    n = 92 * 896 * 3 * 3072 * 3584
    mx, bf = hybrid_parameter_bytes(K3, "mxfp4"), hybrid_parameter_bytes(K3, "bf16")
    assert mx["routed_experts"] == (n, n // 2 + n // 32) and bf["routed_experts"] == (n, 2 * n)
    assert {k: v for k, v in mx.items() if k != "routed_experts"} == {k: v for k, v in bf.items()
                                                                      if k != "routed_experts"}
    total = sum(b for _, b in mx.values())
    assert 1.55e12 < total < 1.57e12  # the release's 1.561 TB checkpoint


def test_tp_sessions_hand_computation():
    """tp: per device the weights split 8 ways; a session of n tokens takes n x 27,648 B of KV on every
    device and 1/8 of its state. Without device checkpoints: sessions = floor(free / (n x 27,648 +
    state / 8)); with serve's default checkpoint budget (as many bytes as the KV) the KV counts
    twice; with an explicit budget B per device: floor((free - B) / (n x 27,648 + state / 8))."""
    p = hybrid_memory_plan(K3, "mxfp4", 8, 288, parallel="tp", state_device_bytes=0)
    total = sum(b for _, b in p.parts.values())
    free = 288e9 * 0.9 - 8e9 - total / 8
    assert p.free_bytes_per_device == pytest.approx(free, rel=1e-12)
    for n in SESSION_LENGTHS:
        assert p.sessions[n] == int(free // (n * 27_648 + 449_372_160 / 8))
    assert p.sessions[1_048_576] >= 1 and p.sessions[131_072] > p.sessions[409_600]
    serve = hybrid_memory_plan(K3, "mxfp4", 8, 288, parallel="tp")  # kvtier serve's default budget
    assert serve.state_device_bytes is None and serve.free_bytes_per_device == p.free_bytes_per_device
    for n in SESSION_LENGTHS:
        assert serve.sessions[n] == int(free // (2 * n * 27_648 + 449_372_160 / 8)) <= p.sessions[n]
    assert (serve.sessions[131_072], serve.sessions[1_048_576]) == (7, 0)
    # the checkpoint budget (7 sessions' KV) holds 451 checkpoints of 1/8 of a state each
    assert serve.device_checkpoints(131_072) == int(7 * 131_072 * 27_648 // (449_372_160 / 8)) == 451
    given = hybrid_memory_plan(K3, "mxfp4", 8, 288, parallel="tp", state_device_bytes=20e9)
    for n in SESSION_LENGTHS:
        assert given.sessions[n] == int((free - 20e9) // (n * 27_648 + 449_372_160 / 8))
    assert given.device_checkpoints() == int(20e9 // (449_372_160 / 8)) == 356
    with pytest.raises(ValueError, match="state_device_bytes"):
        hybrid_memory_plan(K3, state_device_bytes=-1)


def test_dp_ep_replicates_attention_and_bad_arguments_are_named():
    p = hybrid_memory_plan(K3, "mxfp4", 8, 288, parallel="dp-ep")
    attn = p.parts["kda_attention"][1] + p.parts["mla_attention"][1]
    assert p.weight_bytes_per_device > attn and not p.fits and set(p.sessions.values()) == {0}
    with pytest.raises(ValueError, match="state_dtype"):
        hybrid_memory_plan(K3, state_dtype="fp8")
    with pytest.raises(ValueError, match="format"):
        hybrid_memory_plan(K3, "int4")
    with pytest.raises(ValueError, match="devices"):
        hybrid_memory_plan(K3, devices=0)


def _block(marker: str) -> str:
    text = DOC.read_text()
    return text[text.index(f"<!-- {marker}"):].split("\n", 1)[1]


def test_doc_output_block_is_what_the_command_prints(capsys):
    block = _block("k3-plan-output").split("```\n", 2)[1].rstrip("\n")
    assert main(["plan", "--model", "kimi-k3", "--devices", "8", "--hbm-gb", "288", "--format", "mxfp4"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == block
    assert block == plan_report("kimi-k3", ("mxfp4",), 8, 288)


def test_doc_table_is_recomputed_from_the_function():
    rows = [line for line in _block("k3-plan-table").splitlines() if line.startswith("| ") and "---" not in line]
    header, body = rows[0], rows[1:]
    assert "sessions 1M" in header and len(body) >= 6
    for line in body:
        cells = [c.strip() for c in line.strip("|").split("|")]
        layout, kv, state, checkpoints = cells[:4]
        p = hybrid_memory_plan(K3, "mxfp4", 8, 288, parallel=layout, kv_dtype_bytes={"bf16": 2, "fp8": 1}[kv],
                               state_dtype=state, state_device_bytes={"as the KV": None, "none": 0}[checkpoints])
        free = f"{p.free_bytes_per_device / GB:,.1f}" if p.fits else "does not fit"
        want = [layout, kv, state, checkpoints, f"{p.kv_bytes_per_token:,}", f"{p.state_bytes_per_sequence:,}",
                f"{p.weight_bytes_per_device / GB:,.1f}", free] + [f"{p.sessions[n]:,}" for n in SESSION_LENGTHS]
        assert cells == want, line
    assert re.search(r"\| tp \| bf16 \| fp32 \| as the KV \| 27,648 \|", "\n".join(body))


def test_session_lengths_past_the_context_are_refused_naming_the_option(capsys):
    """K3's context is 1,048,576 tokens (max_position_embeddings); tiny-k3's 131,072, tiny's 8,192."""
    assert main(["plan", "--model", "kimi-k3", "--session-tokens", "1048577"]) == 2
    err = capsys.readouterr().err
    assert "--session-tokens 1,048,577 is past the context of kimi-k3 (1,048,576 tokens" in err
    assert "max_position_embeddings" in err
    assert main(["plan", "--model", "tiny", "--session-tokens", "8193"]) == 2
    assert "--session-tokens 8,193 is past the context of tiny (8,192 tokens" in capsys.readouterr().err
    assert "sessions 1M" in plan_report("kimi-k3", session_tokens=1_048_576)
    small = plan_report("tiny-k3")  # the defaults past its context are left out: 128K only
    assert "sessions 128K" in small and "sessions 400K" not in small
    assert "sessions of 8,192 tokens" in plan_report("tiny")


def test_each_hybrid_model_labels_the_format_it_ships_in():
    """K3 ships MXFP4 routed experts; Kimi-Linear-48B-A3B ships bf16 weights (listed first)."""
    k3 = plan_report("kimi-k3")
    assert "mxfp4: K3 as shipped (routed experts MXFP4" in k3 and "bf16: bf16, nothing quantized (not as K3" in k3
    kl = plan_report("kimi-linear-48b")
    assert "bf16: Kimi-Linear as shipped (bf16, nothing quantized)" in kl
    assert "mxfp4: routed experts MXFP4: E2M1 + E8M0 per 32, rest bf16 (not as Kimi-Linear ships)" in kl
    assert "K3" not in kl
    rows = [line.split()[0] for line in kl.splitlines() if line.startswith(("bf16 ", "mxfp4 "))]
    assert rows[0] == "bf16"  # the release's format first


def test_state_device_bytes_is_for_hybrid_models(capsys):
    assert main(["plan", "--model", "kimi-k2", "--state-device-bytes", "1e9"]) == 2
    assert "--state-device-bytes is for hybrid models" in capsys.readouterr().err
    assert main(["plan", "--model", "kimi-k3", "--parallel", "tp", "--format", "mxfp4",
                 "--state-device-bytes", "20e9"]) == 0
    out = capsys.readouterr().out
    assert "device state checkpoints: 20.0 GB per device (--state-device-bytes 20,000,000,000), 356 " in out
