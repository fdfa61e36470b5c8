"""The memory plan (kvtier.model.plan and ``kvtier plan``) against a hand computation."""

from __future__ import annotations

import dataclasses

import pytest

from kvtier.cli import main
from kvtier.model import preset
from kvtier.model.plan import memory_plan, parameter_bytes

K2 = preset("kimi-k2")


def test_k26_int4_on_8_mi355x_matches_the_hand_computation():
    """Kimi K2.6 (K2's text shapes: hidden 7168, 61 layers of which the first is dense, 64 heads,
    q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128, 384 routed experts of
    2048 plus one shared, dense intermediate 18432, vocabulary 163840), routed experts INT4
    group-32 with bf16 scales, everything else bf16 (router fp32), on 8 x MI355X (288 GB), dp-ep.

    Parameters:
      attention per layer: q_a 1536*7168 = 11,010,048; q_a_layernorm 1,536; q_b (64*192)*1536 =
        18,874,368; kv_a 576*7168 = 4,128,768; kv_a_layernorm 512; kv_b (64*256)*512 = 8,388,608;
        o 7168*(64*128) = 58,720,256; sum 101,124,096; x 61 = 6,168,569,856 -> bf16 12,337,139,712 B
      norms: 61*2*7168 + 7168 = 881,664 -> 1,763,328 B
      embed_tokens = lm_head: 163840*7168 = 1,174,405,120 -> 2,348,810,240 B each
      dense MLP (layer 0): 3*18432*7168 = 396,361,728 -> 792,723,456 B
      shared experts: 60 * 3*2048*7168 = 60 * 44,040,192 = 2,642,411,520 -> 5,284,823,040 B
      router: 60 * (384*7168 + 384) = 165,173,760 -> fp32 660,695,040 B
      routed experts: 60*384*44,040,192 = 1,014,686,023,680; INT4 0.5 B + bf16 scale 2 B / 32
        = 0.5625 B each -> 570,760,888,320 B
      total 594,535,653,376 B (~0.59 TB; bf16 would be ~2.05 TB)

    Per device (dp-ep: attention, router, norms replicated; the rest split 8 ways):
      replicated 12,337,139,712 + 660,695,040 + 1,763,328 = 12,999,598,080
      split (2*2,348,810,240 + 792,723,456 + 5,284,823,040 + 570,760,888,320) / 8
            = 581,536,055,296 / 8 = 72,692,006,912
      weights 85,691,604,992 B
      usable 288e9 * 0.9 - 8e9 = 251,200,000,000 B; KV 251.2e9 - 85,691,604,992 = 165,508,395,008 B
    KV per token: (512 + 64) * 61 * 2 = 70,272 B; per device floor(165,508,395,008 / 70,272) =
    2,355,253 tokens; 8 devices: 18,842,024 tokens = 188 sessions of 100,000 tokens.
    """
    plan = memory_plan(K2, "int4", devices=8, hbm_gb=288)
    parts = plan.parts
    assert parts["attention"] == (6_168_569_856, 12_337_139_712)
    assert parts["norms"] == (881_664, 1_763_328)
    assert parts["embed_tokens"] == parts["lm_head"] == (1_174_405_120, 2_348_810_240)
    assert parts["dense_mlp"] == (396_361_728, 792_723_456)
    assert parts["shared_experts"] == (2_642_411_520, 5_284_823_040)
    assert parts["router"] == (165_173_760, 660_695_040)
    assert parts["routed_experts"] == (1_014_686_023_680, 570_760_888_320)
    assert plan.total_weight_bytes == 594_535_653_376
    assert plan.weight_bytes_per_device == 85_691_604_992
    assert plan.usable_bytes_per_device == 251_200_000_000
    assert plan.kv_bytes_per_device == 165_508_395_008
    assert plan.kv_bytes_per_token == 70_272
    assert plan.kv_tokens == 18_842_024 == 8 * 2_355_253
    assert plan.sessions == 188


def test_formats_devices_and_layouts():
    bf16, fp8, int4 = (memory_plan(K2, f, 8, 288) for f in ("bf16", "fp8", "int4"))
    assert not bf16.fits and bf16.kv_tokens == 0  # ~2.05 TB does not fit in 8 x 288 GB
    assert 2.0e12 < bf16.total_weight_bytes < 2.1e12 and int4.total_weight_bytes < fp8.total_weight_bytes
    # FP8: 1 byte per linear weight + fp32 128x128 scales; kv_b_proj is held bf16
    expert = 3 * 2048 * 7168 + 4 * (2 * 16 * 56 + 56 * 16)
    assert fp8.parts["routed_experts"][1] == 60 * 384 * expert
    # 8 x H200 (141 GB): K2 FP8 does not fit with attention replicated; K2.6 INT4 does
    assert not memory_plan(K2, "fp8", 8, 141).fits and memory_plan(K2, "int4", 8, 141).sessions > 0
    # tp: the weights split 8 ways, the latent KV replicated on every device: one device's capacity
    tp = memory_plan(K2, "int4", 8, 288, parallel="tp")
    assert tp.weight_bytes_per_device == pytest.approx(594_535_653_376 / 8)
    assert tp.kv_tokens == int((251.2e9 - 594_535_653_376 / 8) // 70_272)
    assert memory_plan(K2, "int4", 8, 288, kv_dtype_bytes=1).kv_tokens == pytest.approx(2 * int4.kv_tokens, abs=8)
    less = memory_plan(K2, "int4", 8, 288, reserve_gb=20)
    assert less.kv_bytes_per_device == int4.kv_bytes_per_device - 12e9
    for bad, match in (({"devices": 0}, "devices"), ({"parallel": "pp"}, "parallel"),
                       ({"hbm_fraction": 1.5}, "hbm_fraction"), ({"reserve_gb": -1}, "reserve_gb")):
        with pytest.raises(ValueError, match=match):
            memory_plan(K2, "int4", **{"devices": 8, **bad})


def test_parameter_bytes_follow_the_config():
    """Counts come from the config's shapes: doubling the experts doubles the routed part."""
    more = dataclasses.replace(K2, n_routed_experts=768, n_group=1, topk_group=1)
    assert parameter_bytes(more, "int4")["routed_experts"][1] == 2 * parameter_bytes(K2, "int4")["routed_experts"][1]
    assert parameter_bytes(more, "int4")["attention"] == parameter_bytes(K2, "int4")["attention"]


def test_plan_command_prints_the_plan(capsys, tmp_path):
    assert main(["plan", "--model", "kimi-k2", "--devices", "8", "--hbm-gb", "288"]) == 0
    out = capsys.readouterr().out
    assert "KV per token: 70,272 bytes" in out
    row = next(line.split() for line in out.splitlines() if line.startswith("int4 "))
    assert row == ["int4", "594.5", "85.7", "165.5", "18,842,024", "188"]
    assert next(line for line in out.splitlines() if line.startswith("bf16 ")).split()[3:6] == ["does", "not", "fit"]
    cfg = tmp_path / "config.json"
    cfg.write_text(__import__("json").dumps(K2.to_hf_dict()))
    assert main(["plan", "--model", str(cfg), "--format", "int4", "--hbm-gb", "141"]) == 0
    assert "int4" in capsys.readouterr().out
    assert main(["plan", "--model", "nope"]) == 2
    assert "must be a preset" in capsys.readouterr().err


def test_simulator_takes_its_device_tier_from_the_plan():
    """The K2 scenario's device pages are the plan's KV tokens (tp on its node) over the page size."""
    import math

    from kvtier.sim import hardware
    from kvtier.sim.run import size_tiers
    from kvtier.sim.scenarios import SCENARIOS
    from kvtier.bench.workload import Session, Turn, Workload

    scn, node = SCENARIOS["kimi-mi355x-128"], hardware.node("mi355x")
    assert scn.weight_format == "fp8"
    wl = Workload("t", "t", "builtin", 64, 1.0, 1.0, math.inf, (Session("a", (Turn(64_000, 10, tuple(range(1000)),
                                                                                        0.0, ""),)),))
    for fmt in ("fp8", "int4"):
        plan = memory_plan(K2, fmt, 8, 288, parallel="tp", kv_dtype_bytes=scn.kv_dtype_bytes)
        sizing = size_tiers(dataclasses.replace(scn, weight_format=fmt), K2, node, wl)
        assert sizing.device_pages == plan.kv_tokens // scn.page_size
        assert sizing.weight_bytes == plan.total_weight_bytes
    with pytest.raises(ValueError, match="bf16 weights over 8 x MI355X leave no HBM"):
        size_tiers(dataclasses.replace(scn, weight_format="bf16"), K2, node, wl)
    with pytest.raises(ValueError, match="weight_format"):
        dataclasses.replace(scn, weight_format="int3")
