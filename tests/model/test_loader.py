"""Checkpoint writing and loading: determinism, FP8 block dequantization, layouts, clear errors."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kvtier.model import create_random_checkpoint, dequantize_fp8_block, load_model, preset, quantize_fp8_block

SMALL = dataclasses.replace(preset("tiny"), vocab_size=1000)


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    return create_random_checkpoint(tmp_path_factory.mktemp("bf16"), SMALL, seed=3, dtype="bfloat16",
                                    max_shard_bytes=1 << 20)


def read_all(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_random_checkpoint_is_deterministic_and_sharded(bf16_dir, tmp_path):
    again = create_random_checkpoint(tmp_path / "again", SMALL, seed=3, dtype="bfloat16", max_shard_bytes=1 << 20)
    other = create_random_checkpoint(tmp_path / "other", SMALL, seed=4, dtype="bfloat16", max_shard_bytes=1 << 20)
    a, b, c = read_all(bf16_dir), read_all(again), read_all(other)
    assert len(list(bf16_dir.glob("*.safetensors"))) > 1
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.1.mlp.experts.0.up_proj.weight"],
                           c["model.layers.1.mlp.experts.0.up_proj.weight"])


def test_loaded_parameters_land_where_the_names_say(bf16_dir):
    model = load_model(bf16_dir, torch.float32)
    t = read_all(bf16_dir)
    moe = model.layers[1].mlp
    inter = SMALL.moe_intermediate_size
    assert torch.equal(moe.w13[5, :inter], t["model.layers.1.mlp.experts.5.gate_proj.weight"].float())
    assert torch.equal(moe.w13[5, inter:], t["model.layers.1.mlp.experts.5.up_proj.weight"].float())
    assert torch.equal(moe.w2[5], t["model.layers.1.mlp.experts.5.down_proj.weight"].float())
    assert torch.equal(moe.e_score_correction_bias, t["model.layers.1.mlp.gate.e_score_correction_bias"])
    dense = model.layers[0].mlp
    assert torch.equal(dense.gate_up_proj[SMALL.intermediate_size:], t["model.layers.0.mlp.up_proj.weight"].float())
    assert torch.equal(model.lm_head, t["lm_head.weight"].float())


def test_fp8_block_dequantization_is_exact_per_block():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(130, 300, generator=g)  # partial blocks in both dims
    q, scale_inv = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (2, 3)
    deq = dequantize_fp8_block(q, scale_inv, (128, 128))
    for bi in range(2):
        for bj in range(3):
            rows, cols = slice(bi * 128, (bi + 1) * 128), slice(bj * 128, (bj + 1) * 128)
            assert torch.equal(deq[rows, cols], q[rows, cols].float() * scale_inv[bi, bj])
    # e4m3 keeps 3 mantissa bits: relative error <= 2**-4 for normal values, plus subnormal spacing.
    assert bool(((deq - w).abs() <= 2**-4 * w.abs() + scale_inv.max() * 2**-6).all())
    with pytest.raises(ValueError, match="proj_scale_inv must have shape"):
        dequantize_fp8_block(q, scale_inv[:1], (128, 128), name="proj")


def test_fp8_checkpoint_loads_dequantized(tmp_path):
    path = create_random_checkpoint(tmp_path / "fp8", SMALL, seed=5, dtype="fp8")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    t = read_all(path)
    name = "model.layers.2.self_attn.kv_b_proj.weight"
    assert t[name].dtype == torch.float8_e4m3fn
    model = load_model(path, torch.float32, dequantize=True)
    assert model.layers[1].mlp.w13.dtype == torch.float32  # every weight held dense
    want = dequantize_fp8_block(t[name], t[name + "_scale_inv"], (128, 128))
    assert torch.equal(model.layers[2].self_attn.kv_b_proj, want)
    assert t["model.layers.1.mlp.gate.weight"].dtype == torch.float32


def test_wrapped_multimodal_layout_loads(bf16_dir, tmp_path):
    wrapped = tmp_path / "wrapped"
    wrapped.mkdir()
    tensors = {f"language_model.{k}": v for k, v in read_all(bf16_dir).items()}
    tensors["vision_tower.encoder.blocks.0.wqkv.weight"] = torch.zeros(4, 4)  # the vision encoder is skipped
    tensors["mm_projector.proj.0.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(wrapped / "model.safetensors"))
    text = json.loads((bf16_dir / "config.json").read_text())
    (wrapped / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": text}))
    a, b = load_model(bf16_dir), load_model(wrapped)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def rewrite(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    tensors = read_all(src)
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def test_missing_tensor_is_named(bf16_dir, tmp_path):
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    path = rewrite(bf16_dir, tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=rf"lacks tensor '{name}'.*expected shape"):
        load_model(path)


def test_misshaped_tensor_is_named(bf16_dir, tmp_path):
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    path = rewrite(bf16_dir, tmp_path / "s", lambda t: t.__setitem__(name, t[name][:-1]))
    with pytest.raises(ValueError, match=rf"'{name}' has shape .* expected"):
        load_model(path)


def test_unexpected_tensor_is_named(bf16_dir, tmp_path):
    extra = "model.layers.0.self_attn.q_norm_bogus.weight"
    path = rewrite(bf16_dir, tmp_path / "u", lambda t: t.__setitem__(extra, torch.zeros(3)))
    with pytest.raises(ValueError, match="unexpected tensor"):
        load_model(path)


def test_bad_config_errors(bf16_dir, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((bf16_dir / "config.json").read_text())
    cfg["model_type"] = "llama"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="model_type must be one of"):
        load_model(bad)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "nowhere")


def test_index_names_the_shards(bf16_dir):
    index = json.loads((bf16_dir / "model.safetensors.index.json").read_text())
    for name, fname in list(index["weight_map"].items())[:20]:
        with safe_open(str(bf16_dir / fname), "pt") as f:
            assert name in f.keys()


def test_integer_tensor_and_1d_fp8_are_named(bf16_dir, tmp_path):
    path = rewrite(bf16_dir, tmp_path / "int", lambda t: t.__setitem__("model.norm.weight",
                                                                         t["model.norm.weight"].long()))
    with pytest.raises(ValueError, match="'model.norm.weight' has dtype torch.int64"):
        load_model(path)
    path = rewrite(bf16_dir, tmp_path / "fp8norm", lambda t: t.__setitem__(
        "model.norm.weight", t["model.norm.weight"].float().to(torch.float8_e4m3fn)))
    with pytest.raises(ValueError, match="FP8 tensor 'model.norm.weight' must be a 2-D weight"):
        load_model(path)


def test_malformed_config_json_names_the_file(bf16_dir, tmp_path):
    bad = rewrite(bf16_dir, tmp_path / "json", lambda t: None)
    (bad / "config.json").write_text("{ not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        load_model(bad)


def test_extra_layers_beyond_mtp_are_rejected(bf16_dir, tmp_path):
    # A checkpoint with one more decoder layer than config.json says is not silently truncated.
    extra = {k.replace("model.layers.2.", f"model.layers.{SMALL.num_hidden_layers}."): v
             for k, v in read_all(bf16_dir).items() if k.startswith("model.layers.2.")}
    path = rewrite(bf16_dir, tmp_path / "extra", lambda t: t.update(extra))
    with pytest.raises(ValueError, match="unexpected tensor"):
        load_model(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg))
    assert load_model(path).config.num_hidden_layers == SMALL.num_hidden_layers


def test_random_full_size_checkpoint_is_refused(tmp_path):
    with pytest.raises(ValueError, match="GiB, more than max_total_bytes"):
        create_random_checkpoint(tmp_path / "k2", "kimi-k2")
    assert not (tmp_path / "k2").exists()
