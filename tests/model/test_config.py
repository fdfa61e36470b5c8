"""KimiK2Config: presets, derived values, HF config.json round trips and validation errors."""

import dataclasses
import json
import math

import pytest

from kvtier.model import KimiK2Config, YarnScaling, preset
from kvtier.model.config import yarn_get_mscale


def test_k2_preset_matches_published_shapes():
    c = preset("kimi-k2")
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads) == (7168, 61, 64)
    assert (c.kv_lora_rank, c.qk_rope_head_dim, c.kv_cache_dim) == (512, 64, 576)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.vocab_size) == (384, 8, 163840)
    # docs/kimi.md: 1,152 B per token per layer in bf16, 70,272 B over 61 layers.
    assert c.kv_cache_bytes_per_token(2) == 70272


@pytest.mark.parametrize("factor, want", [(32.0, 0.130861), (64.0, 0.144680)])
def test_sm_scale_is_yarn_scaled_not_576(factor, want):
    c = dataclasses.replace(preset("kimi-k2"), rope_scaling=dataclasses.replace(
        preset("kimi-k2").rope_scaling, factor=factor))
    assert c.sm_scale == pytest.approx(want, abs=1e-6)
    assert c.sm_scale != pytest.approx(576 ** -0.5)
    assert yarn_get_mscale(factor, 1.0) == pytest.approx(0.1 * math.log(factor) + 1)


def test_tiny_preset_is_small_with_real_vocab():
    c = preset("tiny")
    assert c.vocab_size == 163840 and c.n_routed_experts >= 8 and c.num_hidden_layers <= 4


def k2_config_json():
    # The shape of the public Kimi-K2-Instruct config.json (rope_scaling + rope_theta at top level).
    c = preset("kimi-k2").to_hf_dict()
    c.update(model_type="kimi_k2", rope_scaling={"type": "yarn", "factor": 32.0,
                                                 "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                                                 "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    return c


def test_from_hf_dict_round_trip_and_wrappers():
    raw = k2_config_json()
    c = KimiK2Config.from_hf_dict(json.loads(json.dumps(raw)))
    assert c == preset("kimi-k2")
    wrapped = {"model_type": "kimi_k25", "text_config": {**raw, "model_type": "deepseek_v3"}}
    assert KimiK2Config.from_hf_dict(wrapped).hidden_size == 7168
    # transformers-5 style: rope_parameters carries rope_theta and the YaRN fields.
    t5 = {k: v for k, v in raw.items() if k not in ("rope_scaling", "rope_theta")}
    t5.update(model_type="deepseek_v3", rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0,
                                                         "original_max_position_embeddings": 4096,
                                                         "beta_fast": 1, "beta_slow": 1, "mscale": 1.0,
                                                         "mscale_all_dim": 1.0})
    assert KimiK2Config.from_hf_dict(t5).rope_scaling == preset("kimi-k2").rope_scaling


@pytest.mark.parametrize("field, value, match", [
    ("model_type", "llama", "model_type"),
])
def test_unknown_model_type(field, value, match):
    raw = k2_config_json()
    raw[field] = value
    with pytest.raises(ValueError, match=match):
        KimiK2Config.from_hf_dict(raw)


def test_missing_required_field_is_named():
    raw = k2_config_json()
    del raw["kv_lora_rank"]
    with pytest.raises(ValueError, match="kv_lora_rank"):
        KimiK2Config.from_hf_dict(raw)


@pytest.mark.parametrize("changes, match", [
    ({"n_group": 5}, "n_group"),
    ({"topk_group": 2, "n_group": 1}, "topk_group"),
    ({"num_experts_per_tok": 400}, "num_experts_per_tok"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"q_lora_rank": -1}, "q_lora_rank"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"first_k_dense_replace": 99}, "first_k_dense_replace"),
    ({"qk_rope_head_dim": 63}, "qk_rope_head_dim"),
])
def test_invalid_fields_are_named(changes, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(preset("kimi-k2"), **changes)


def test_unknown_preset_and_bad_rope_scaling():
    with pytest.raises(ValueError, match="preset"):
        preset("kimi-k9")
    with pytest.raises(ValueError, match="rope_scaling"):
        YarnScaling.from_dict({"type": "linear", "factor": 2.0, "original_max_position_embeddings": 4})
