"""Kimi K3's MXFP4 routed experts: ``kvtier create-checkpoint --preset tiny-k3 --dtype mxfp4`` writes a
compressed-tensors ``mxfp4-pack-quantized`` checkpoint; the loader keeps the experts packed (the
MoE runs ``fused_moe_mxfp4``, SiTU-GLU fused) and ``dequantize=True`` expands them; both give the
same logits. Any other quantization config is a load error naming the tensor and the field. The
fused SiTU MoE agrees with the per-expert loop written from the formula's source."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kvtier import ops
from kvtier.cli import main
from kvtier.model.kimi_linear import situ_and_mul
from kvtier.model.kimi_linear_config import tiny_k3
from kvtier.model.loader import load_model
from kvtier.reference.mxfp4 import dequantize_mxfp4
from tests.helpers.hybrid_forward import _run

TINY = tiny_k3()


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-k3-mxfp4")
    assert main(["create-checkpoint", str(path), "--preset", "tiny-k3", "--dtype", "mxfp4", "--seed", "4"]) == 0
    return path


def test_packed_checkpoint_layout(mxfp4_dir):
    raw = json.loads((mxfp4_dir / "config.json").read_text())
    q = raw["text_config"]["quantization_config"]
    assert q["format"] == "mxfp4-pack-quantized" and q["config_groups"]["group_0"]["weights"]["type"] == "float"
    names = json.loads((mxfp4_dir / "model.safetensors.index.json").read_text())["weight_map"]
    e0 = "language_model.model.layers.1.block_sparse_moe.experts.0"
    assert {f"{e0}.w1.weight_packed", f"{e0}.w1.weight_scale", f"{e0}.w2.weight_packed"} <= set(names)
    assert f"{e0}.w1.weight" not in names
    assert "language_model.model.layers.1.block_sparse_moe.shared_experts.down_proj.weight" in names


def test_packed_and_dequantized_models_give_the_same_logits(mxfp4_dir):
    packed = load_model(mxfp4_dir)
    dense = load_model(mxfp4_dir, dequantize=True)
    moe_p, moe_d = packed.layers[1].mlp, dense.layers[1].mlp
    lat, inter = TINY.moe_hidden_size, TINY.moe_intermediate_size
    assert moe_p.w13_packed.dtype == torch.uint8 and tuple(moe_p.w13_packed.shape) == (16, 2 * inter, lat // 2)
    assert tuple(moe_p.w2_scale.shape) == (16, lat, inter // 32) and not hasattr(moe_p, "w13")
    torch.testing.assert_close(dequantize_mxfp4(moe_p.w13_packed, moe_p.w13_scale), moe_d.w13, rtol=0, atol=0)
    ids = torch.randint(0, TINY.vocab_size, (21,), generator=torch.Generator().manual_seed(1)).tolist()
    hp, hd = _run(packed, ids, (21,)), _run(dense, ids, (13, 8))
    assert torch.isfinite(hp).all()
    torch.testing.assert_close(packed.compute_logits(hp), dense.compute_logits(hd), rtol=1e-4, atol=1e-4)


def test_fused_situ_moe_matches_the_per_expert_formula():
    """SiTU-GLU (vllm ``SituAndMul``, used by ``vllm/models/kimi_k3``) through the fused op equals the
    per-expert loop with the activation applied to ``w13 @ x``."""
    gen = torch.Generator().manual_seed(2)
    e, lat, inter, t = 6, 64, 32, 9
    w13, w2 = torch.randn(e, 2 * inter, lat, generator=gen) / 8, torch.randn(e, lat, inter, generator=gen) / 6
    x = torch.randn(t, lat, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:3] for _ in range(t)]).to(torch.int32)
    weights = torch.rand(t, 3, generator=gen)
    want = torch.zeros(t, lat)
    for i in range(t):
        for j in range(3):
            k = int(ids[i, j])
            want[i] += weights[i, j] * (w2[k] @ situ_and_mul(w13[k] @ x[i], 4.0, 25.0))
    got = ops.fused_moe(x, w13, w2, weights, ids, activation="situ", situ_beta=4.0, situ_linear_beta=25.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _with_group(src, tmp_path, edit):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    edit(raw["text_config"]["quantization_config"])
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize("field, value, message", [
    ("num_bits", 8, r"weights\.num_bits must be 4"),
    ("type", "int", r"weights\.type must be 'float'"),
    ("group_size", 16, r"weights\.group_size must be 32"),
    ("scale_dtype", "torch.bfloat16", r"weights\.scale_dtype must be uint8"),
    ("dynamic", True, r"weights\.dynamic must be false"),
])
def test_other_weight_configs_are_load_errors_naming_tensor_and_field(mxfp4_dir, tmp_path, field, value, message):
    path = _with_group(mxfp4_dir, tmp_path, lambda q: q["config_groups"]["group_0"]["weights"].update({field: value}))
    with pytest.raises(ValueError, match=r"tensor '.*block_sparse_moe\.experts\.0\.w1\.weight_packed': "
                                         r"quantization_config\.config_groups\.group_0\." + message):
        load_model(path)


def test_other_formats_and_methods_are_load_errors(mxfp4_dir, tmp_path):
    path = _with_group(mxfp4_dir, tmp_path, lambda q: q["config_groups"]["group_0"].update(format="pack-quantized"))
    with pytest.raises(ValueError, match=r"group_0\.format must be 'mxfp4-pack-quantized'"):
        load_model(path)
    path = _with_group(mxfp4_dir, tmp_path / "b", lambda q: q.update(quant_method="fp8"))
    with pytest.raises(ValueError, match=r"quantization_config\.quant_method must be 'compressed-tensors'"):
        load_model(path)
    path = _with_group(mxfp4_dir, tmp_path / "c", lambda q: q["config_groups"]["group_0"].update(
        input_activations={"num_bits": 8, "type": "int", "dynamic": True}))
    with pytest.raises(ValueError, match=r"group_0\.input_activations must be null or dynamic MXFP8"):
        load_model(path)


def test_missing_scales_name_the_tensor(mxfp4_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "ckpt"
    shutil.copytree(mxfp4_dir, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    gone = "language_model.model.layers.2.block_sparse_moe.experts.3.w2.weight_scale"
    shard = dst / index["weight_map"].pop(gone)
    tensors = load_file(str(shard))
    del tensors[gone]
    save_file(tensors, str(shard))
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"lacks tensor '.*experts\.3\.w2\.weight_scale'.*mxfp4-pack-quantized"):
        load_model(dst)
