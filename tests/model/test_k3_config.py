"""Hybrid (kimi_linear / kimi_k3) configs: presets, round trips, and load errors that name the field."""

from __future__ import annotations

import copy
import json

import torch

import pytest

from kvtier.model import load_model, preset
from kvtier.model.kimi_linear_config import KimiLinearConfig
from kvtier.model.kimi_linear_loader import read_hybrid_config


def test_k3_preset_sizes_follow_its_config():
    c = preset("kimi-k3")
    assert len(c.full_attn_layers) == 24 and len(c.kda_layers) == 69
    assert c.full_attn_layers[:2] == (4, 8) and c.full_attn_layers[-2:] == (92, 93)
    assert c.kv_cache_bytes_per_token(2) == 24 * 576 * 2  # 27,648 B of bf16 MLA KV per token
    assert c.state_bytes_per_sequence(4, 2) == 69 * (96 * 128 * 128 * 4 + 3 * 12288 * 3 * 2)
    assert c.sm_scale == pytest.approx(192 ** -0.5)
    tiny = preset("tiny-k3")
    assert tiny.vocab_size == 163840 and tiny.full_attn_layers == (4, 8) and tiny.num_hidden_layers == 8


@pytest.mark.parametrize("name", ["kimi-k3", "kimi-linear-48b", "tiny-k3"])
def test_round_trip_through_config_json(name):
    c = preset(name)
    d = json.loads(json.dumps(c.to_hf_dict()))
    assert (d["model_type"] == "kimi_k3") == (c.model_type == "kimi_k3")
    assert KimiLinearConfig.from_hf_dict(d) == c


def _k3_dict():
    return copy.deepcopy(preset("tiny-k3").to_hf_dict())


def _with(path, value):
    d = _k3_dict()
    node = d["text_config"]
    *parents, last = path
    for key in parents:
        node = node[key]
    node[last] = value
    return d


@pytest.mark.parametrize("path,value,match", [
    (("linear_attn_config", "kda_layers"), [1, 2, 3, 4, 5, 6, 7], r"overlap at layers \[4\]"),
    (("linear_attn_config", "kda_layers"), [1, 2, 3, 5, 6], r"leave layers \[7\]"),
    (("linear_attn_config", "full_attn_layers"), [4, 9], r"full_attn_layers holds .* \[9\]"),
    (("linear_attn_config", "num_heads"), 0, r"linear_attn_config.num_heads must be a positive int"),
    (("linear_attn_config", "gate_lower_bound"), -7.0, r"linear_attn_config.gate_lower_bound"),
    (("linear_attn_config", "short_conv_kernel_size"), 1, r"short_conv_kernel_size"),
    (("hidden_act",), "gelu", r"hidden_act must be one of"),
    (("mla_use_nope",), False, r"mla_use_nope must be true"),
    (("moe_router_activation_func",), "softmax", r"moe_router_activation_func must be 'sigmoid'"),
    (("num_experts_per_token",), 99, r"num_experts_per_token \(99\)"),
    (("routed_expert_hidden_size",), None, r"latent_moe_use_norm needs routed_expert_hidden_size"),
    (("linear_attn_config",), None, r"lacks linear_attn_config"),
])
def test_bad_k3_config_is_a_load_error_naming_the_field(tmp_path, path, value, match):
    (tmp_path / "config.json").write_text(json.dumps(_with(path, value)))
    with pytest.raises(ValueError, match=match) as err:
        load_model(tmp_path)
    assert str(tmp_path / "config.json") in str(err.value)


def test_kda_heads_must_divide_over_tensor_parallel_ranks():
    c = preset("kimi-k3")
    c.check_tensor_parallel(8)
    with pytest.raises(ValueError, match=r"linear_attn_config.num_heads \(96\) must be divisible by the "
                                         r"tensor-parallel size 7"):
        c.check_tensor_parallel(7)


def test_unsupported_quantization_and_wrapper_are_refused(tmp_path):
    d = _k3_dict()
    d["text_config"]["quantization_config"] = {"quant_method": "gptq"}
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"quantization_config .* 'gptq'"):
        read_hybrid_config(tmp_path)
    with pytest.raises(ValueError, match="text_config"):
        KimiLinearConfig.from_hf_dict({"model_type": "kimi_k3"})
    with pytest.raises(ValueError, match="model_type"):
        KimiLinearConfig.from_hf_dict({"model_type": "llama"})


def test_cache_spec_states_the_bytes_the_slots_hold():
    """The one size formula (``cache_spec``) agrees with what a state slot packs and with the page
    pools' rows, for the hybrid model and for K2."""
    from kvtier.model.kimi_linear import KimiLinearForCausalLM
    from kvtier.model.kimi_linear_config import tiny_k3
    from kvtier.model.state_slots import StateSlots

    model = KimiLinearForCausalLM(tiny_k3(), dtype=torch.bfloat16)
    spec = model.cache_spec()
    assert spec.state_bytes == StateSlots(model.config, 1, conv_dtype=torch.bfloat16).checkpoint_bytes
    assert spec.kv_layers == len(model.config.full_attn_layers)
    assert spec.kv_bytes_per_token == model.config.kv_cache_bytes_per_token(2)
    from kvtier.model import KimiK2ForCausalLM, PRESETS

    k2 = KimiK2ForCausalLM(PRESETS["tiny"](), dtype=torch.bfloat16).cache_spec()
    assert k2.state_bytes == 0 and k2.kv_bytes_per_token == PRESETS["tiny"]().kv_cache_bytes_per_token(2)
