"""Checkpoints kept quantized: compressed-tensors INT4 group-32 (Kimi K2 Thinking / K2.6 layout)
and FP8 128x128 block (DeepSeek-V3 / K2 layout) load without dequantizing, hold the bytes the
memory plan counts, generate what the same weights dequantized generate, and bad
``quantization_config`` / tensors fail at load naming the tensor and the field."""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvtier import LLM, SamplingParams
from kvtier.model import create_random_checkpoint, load_model, preset
from kvtier.model.formats import KIMI_K2_THINKING_QUANTIZATION_CONFIG, WeightFormats
from kvtier.model.plan import parameter_bytes
from kvtier.reference import quant as ref

# vocab 1000 keeps the LM head small; moe_intermediate_size 128 puts the up half of every fused
# gate/up weight on a 128-row block boundary, so every class can be held in FP8.
CONFIG = dataclasses.replace(preset("tiny"), vocab_size=1000, moe_intermediate_size=128)
I, H = CONFIG.moe_intermediate_size, CONFIG.hidden_size
EXPERT = "model.layers.1.mlp.experts.5"
ATOL = {"int4": 1e-4, "fp8": 1e-4}  # fp32 both ways; FP8 with its activation quantization switched off


def read_all(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return {dt: create_random_checkpoint(tmp_path_factory.mktemp(dt), CONFIG, seed=3, dtype=dt, max_shard_bytes=1 << 20)
            for dt in ("int4", "fp8", "float32")}


def resident_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_int4_checkpoint_has_the_compressed_tensors_layout(ckpt, tmp_path):
    path = ckpt["int4"]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["quantization_config"] == KIMI_K2_THINKING_QUANTIZATION_CONFIG
    assert cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == 32
    t = read_all(path)
    assert f"{EXPERT}.gate_proj.weight" not in t
    packed, scale, shape = (t[f"{EXPERT}.down_proj.{n}"] for n in ("weight_packed", "weight_scale", "weight_shape"))
    assert packed.dtype == torch.int32 and packed.shape == (H, I // 8)
    assert scale.dtype == torch.bfloat16 and scale.shape == (H, I // 32)
    assert shape.dtype == torch.int64 and shape.tolist() == [H, I]
    # only routed experts are INT4; the router stays fp32, the rest bf16
    assert t["model.layers.1.mlp.shared_experts.down_proj.weight"].dtype == torch.bfloat16
    assert t["model.layers.1.self_attn.o_proj.weight"].dtype == torch.bfloat16
    assert t["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    # the packed values are the float32 checkpoint of the same seed, quantized symmetric group-32
    dense = t_f32 = read_all(ckpt["float32"])[f"{EXPERT}.down_proj.weight"]
    deq = ref.dequantize_int4_group(packed, scale, group_size=32)
    step = scale.float().repeat_interleave(32, -1)
    assert bool(((deq - dense).abs() <= step * (0.5 + 8 * 2**-8)).all())  # half a step + bf16 scale rounding
    assert int(ref.unpack_int4(packed).min()) >= -8 and int(ref.unpack_int4(packed).max()) <= 7
    again = create_random_checkpoint(tmp_path / "again", CONFIG, seed=3, dtype="int4", max_shard_bytes=1 << 20)
    b = read_all(again)
    assert b.keys() == t.keys() and all(torch.equal(t[k], b[k]) for k in t)
    assert t_f32.dtype == torch.float32


def test_int4_checkpoint_loads_packed(ckpt):
    model = load_model(ckpt["int4"], torch.float32)
    assert model.formats == WeightFormats(routed_experts="int4")
    moe = model.layers[1].mlp
    assert not hasattr(moe, "w13")
    assert moe.w13_packed.dtype == torch.int32 and moe.w13_packed.shape == (CONFIG.n_routed_experts, 2 * I, H // 8)
    assert moe.w13_scale.dtype == torch.bfloat16 and moe.w13_scale.shape == (CONFIG.n_routed_experts, 2 * I, H // 32)
    assert moe.w2_packed.shape == (CONFIG.n_routed_experts, H, I // 8) and moe.w2_scale.shape[-1] == I // 32
    assert moe.shared_experts.gate_up_proj.dtype == torch.float32
    t = read_all(ckpt["int4"])
    assert torch.equal(moe.w13_packed[5, :I], t[f"{EXPERT}.gate_proj.weight_packed"])
    assert torch.equal(moe.w13_packed[5, I:], t[f"{EXPERT}.up_proj.weight_packed"])
    assert torch.equal(moe.w13_scale[5, I:], t[f"{EXPERT}.up_proj.weight_scale"])
    assert torch.equal(moe.w2_packed[5], t[f"{EXPERT}.down_proj.weight_packed"])
    # resident bytes: what the plan counts; routed experts 0.5 + 2/32 bytes per weight
    assert resident_bytes(model) == sum(b for _, b in parameter_bytes(CONFIG, "int4", 4).values())
    routed = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".mlp.w" in n)
    weights = (CONFIG.num_hidden_layers - 1) * CONFIG.n_routed_experts * 3 * I * H
    assert routed == weights // 2 + weights // 32 * 2
    dense = load_model(ckpt["int4"], torch.float32, dequantize=True)
    assert dense.formats == WeightFormats() and torch.equal(
        dense.layers[1].mlp.w13[5, I:], ref.dequantize_int4_group(t[f"{EXPERT}.up_proj.weight_packed"],
                                                                 t[f"{EXPERT}.up_proj.weight_scale"]))
    assert resident_bytes(dense) - resident_bytes(model) == weights * 4 - routed


def test_fp8_checkpoint_loads_fp8(ckpt):
    model = load_model(ckpt["fp8"], torch.float32)
    assert model.formats == WeightFormats("fp8", "fp8", "fp8", "fp8")
    attn, moe, dense_mlp = model.layers[1].self_attn, model.layers[1].mlp, model.layers[0].mlp
    assert attn.q_a_proj.dtype == torch.float8_e4m3fn and attn.q_a_proj_scale_inv.shape == (1, 1)  # 96 x 128
    assert attn.kv_b_proj.dtype == torch.float32  # absorbed per head: held dequantized
    assert moe.w13.dtype == torch.float8_e4m3fn and moe.w13_scale_inv.shape == (CONFIG.n_routed_experts, 2, 1)
    assert dense_mlp.gate_up_proj_scale_inv.shape == (4, 1)
    t = read_all(ckpt["fp8"])
    assert torch.equal(moe.w13_scale_inv[5, 1], t[f"{EXPERT}.up_proj.weight_scale_inv"][0])
    assert torch.equal(moe.w13[5, I:].view(torch.uint8), t[f"{EXPERT}.up_proj.weight"].view(torch.uint8))
    name = "model.layers.2.self_attn.kv_b_proj.weight"
    assert torch.equal(model.layers[2].self_attn.kv_b_proj,
                       ref.dequantize_fp8_block(t[name], t[name + "_scale_inv"]))
    assert resident_bytes(model) == sum(b for _, b in parameter_bytes(CONFIG, "fp8", 4).values())
    assert moe.w2.element_size() == 1 and moe.w2_scale_inv.dtype == torch.float32


def test_fp8_fused_halves_off_a_block_row_are_held_dense(tmp_path):
    small = dataclasses.replace(CONFIG, moe_intermediate_size=64)  # up rows start mid-block
    path = create_random_checkpoint(tmp_path / "fp8", small, seed=1, dtype="fp8")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_model(path)
    assert sorted(str(w.message).split(" in fp8")[0] for w in caught) == ["routed_experts", "shared_experts"]
    assert all("intermediate size (64)" in str(w.message) and "held dequantized" in str(w.message) for w in caught)
    assert model.formats == WeightFormats("fp8", "fp8", "dense", "dense")
    assert model.layers[1].mlp.w13.dtype == torch.float32


def _generate_and_score(path, dequantize, prompt, tokens=None):
    """Greedy-decode 6 tokens after ``prompt`` (``tokens`` None) or score ``prompt + tokens``."""
    llm = LLM(str(path), dtype="float32", num_device_pages=32, page_size=16, max_num_batched_tokens=24,
              dequantize=dequantize)
    if tokens is None:
        params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True, prompt_logprobs=True, ignore_eos=True)
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
        return out.token_ids, torch.tensor(out.prompt_logprobs + out.logprobs, dtype=torch.float64)
    out = llm.generate(prompt_token_ids=[prompt + tokens], sampling_params=SamplingParams(max_tokens=1,
                                                                                         prompt_logprobs=True))[0]
    return torch.tensor(out.prompt_logprobs, dtype=torch.float64)


@pytest.mark.parametrize("dtype", ["int4", "fp8"])
def test_generation_matches_the_weights_dequantized(ckpt, dtype):
    """The quantized model's prompt log-probs (chunked prefill) and greedy decode log-probs equal
    the dequantized model's log-probs of the same tokens. FP8 is W8A8: its activation quantization
    is switched off here (:func:`kvtier.reference.quant.fp8_activation_quant`), so what is
    compared is the weights' placement and scales; with it on, see the next test."""
    prompt = torch.randint(0, CONFIG.vocab_size, (45,), generator=torch.Generator().manual_seed(1)).tolist()
    with ref.fp8_activation_quant(dtype != "fp8"):
        tokens, got = _generate_and_score(ckpt[dtype], False, prompt)
        want = _generate_and_score(ckpt[dtype], True, prompt, tokens)
    err = (got - want).abs()
    assert got.shape == want.shape == (len(prompt) - 1 + 6,)
    assert float(err.max()) <= ATOL[dtype], f"{dtype}: max |diff| {float(err.max()):.3g} at {int(err.argmax())}"


def test_fp8_w8a8_generation_stays_near_the_dequantized_weights(ckpt):
    """With its activation quantization on, the FP8 model's log-probs differ from the
    dequantized weights' by what FP8 activations cost on this random model: the same order as
    the FP8 weight quantization itself (float32 vs dequantized checkpoint weights)."""
    prompt = torch.randint(0, CONFIG.vocab_size, (45,), generator=torch.Generator().manual_seed(1)).tolist()
    tokens, got = _generate_and_score(ckpt["fp8"], False, prompt)
    want = _generate_and_score(ckpt["fp8"], True, prompt, tokens)
    weights_only = _generate_and_score(ckpt["float32"], False, prompt, tokens)
    act_err, weight_err = (got - want).abs(), (weights_only - want).abs()
    assert 0 < float(act_err.mean()) <= 2 * float(weight_err.mean()), (float(act_err.mean()), float(weight_err.mean()))


# ---- bad input ---------------------------------------------------------------------------

def rewrite(src: Path, dst: Path, edit_tensors=None, edit_config=None) -> Path:
    dst.mkdir()
    tensors = read_all(src)
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _weights(field, value):
    def edit(cfg):
        cfg["quantization_config"]["config_groups"]["group_0"]["weights"][field] = value
    return edit


FIRST = "model.layers.1.mlp.experts.0.gate_proj.weight_packed"
BAD_CONFIGS = {
    "bits": (_weights("num_bits", 8), rf"'{FIRST}'.*config_groups\.group_0\.weights\.num_bits must be 4"),
    "asymmetric": (_weights("symmetric", False), rf"'{FIRST}'.*weights\.symmetric must be true"),
    "group48": (_weights("group_size", 48), rf"'{FIRST}'.*weights\.group_size=48 does not divide .*128"),
    "channel": (_weights("strategy", "channel"), rf"'{FIRST}'.*weights\.strategy must be 'group'"),
    "w4a8": (lambda c: c["quantization_config"]["config_groups"]["group_0"].__setitem__(
        "input_activations", {"num_bits": 8}), rf"'{FIRST}'.*group_0\.input_activations must be null"),
    "format": (lambda c: c["quantization_config"].__setitem__("format", "int-quantized"),
               rf"'{FIRST}'.*group_0\.format must be 'pack-quantized'"),
    "method": (lambda c: c["quantization_config"].__setitem__("quant_method", "gptq"),
               r"quantization_config\.quant_method must be 'fp8' .* or 'compressed-tensors'.*'gptq'"),
    "ignored": (lambda c: c["quantization_config"]["ignore"].append("re:.*experts.*"),
                r"'model\.layers\.1\.mlp\.experts\.0\.gate_proj\.weight_packed' is INT4-packed but no "
                r"quantization_config\.config_groups entry targets it \(or quantization_config\.ignore lists it\)"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_unsupported_quantization_config_is_named(ckpt, tmp_path, case):
    edit, message = BAD_CONFIGS[case]
    path = rewrite(ckpt["int4"], tmp_path / case, edit_config=edit)
    with pytest.raises(ValueError, match=message):
        load_model(path)


def test_group_size_not_dividing_in_features_is_named(tmp_path):
    odd = dataclasses.replace(CONFIG, moe_intermediate_size=96)  # down_proj in_features 96: 96 % 64 != 0
    path = create_random_checkpoint(tmp_path / "c", odd, seed=2, dtype="int4")
    path = rewrite(path, tmp_path / "g64", edit_config=_weights("group_size", 64))
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.experts\.0\.down_proj\.weight_packed'.*"
                                         r"weights\.group_size=64 does not divide its in_features 96"):
        load_model(path)


@pytest.mark.parametrize("missing,message", [
    ("weight_scale", r"lacks tensor '{m}\.weight_scale' \(INT4 group scales .*quantization_config\.format"),
    ("weight_shape", r"lacks tensor '{m}\.weight_shape'"),
    ("weight_packed", r"lacks tensor '{m}\.weight_packed': quantization_config\.config_groups targets"),
])
def test_missing_int4_tensor_is_named(ckpt, tmp_path, missing, message):
    module = "model.layers.2.mlp.experts.7.up_proj"
    path = rewrite(ckpt["int4"], tmp_path / missing, lambda t: t.pop(f"{module}.{missing}"))
    with pytest.raises(ValueError, match=message.format(m=module.replace(".", r"\."))):
        load_model(path)


def test_bad_int4_tensors_are_named(ckpt, tmp_path):
    module = "model.layers.1.mlp.experts.3.down_proj"
    path = rewrite(ckpt["int4"], tmp_path / "shape", lambda t: t.__setitem__(f"{module}.weight_shape",
                                                                             torch.tensor([H, I + 8])))
    with pytest.raises(ValueError, match=rf"'{module}.weight_shape' must hold the integers \[{H}, {I}\]"):
        load_model(path)
    path = rewrite(ckpt["int4"], tmp_path / "scale", lambda t: t.__setitem__(
        f"{module}.weight_scale", t[f"{module}.weight_scale"][:, :1].contiguous()))
    with pytest.raises(ValueError, match=rf"'{module}.weight_scale' has shape \({H}, 1\), expected \({H}, {I // 32}\)"):
        load_model(path)
    path = rewrite(ckpt["int4"], tmp_path / "dtype", lambda t: t.__setitem__(
        f"{module}.weight_packed", t[f"{module}.weight_packed"].to(torch.int64)))
    with pytest.raises(ValueError, match=rf"'{module}.weight_packed' has dtype torch.int64, expected torch.int32"):
        load_model(path)


def test_fp8_without_scales_or_with_a_bad_config_is_named(ckpt, tmp_path):
    name = "model.layers.1.mlp.experts.2.gate_proj.weight"
    path = rewrite(ckpt["fp8"], tmp_path / "noscale", lambda t: t.pop(f"{name}_scale_inv"))
    with pytest.raises(ValueError, match=rf"FP8 tensor '{name}' has no '{name}_scale_inv' .*weight_block_size"):
        load_model(path)
    path = rewrite(ckpt["fp8"], tmp_path / "block", edit_config=lambda c: c["quantization_config"].__setitem__(
        "weight_block_size", [64, 64]))
    first = "model.layers.0.self_attn.q_a_proj.weight"
    with pytest.raises(ValueError, match=rf"{first}_scale_inv must have shape \(2, 2\) for weight \(96, 128\) and "
                                         r"block \(64, 64\) \(quantization_config\.weight_block_size\), got \(1, 1\)"):
        load_model(path)
    path = rewrite(ckpt["fp8"], tmp_path / "fmt", edit_config=lambda c: c["quantization_config"].__setitem__(
        "fmt", "e5m2"))
    with pytest.raises(ValueError, match=r"quantization_config\.fmt must be 'e4m3'"):
        load_model(path)


def test_mixed_formats_in_one_class_are_named(ckpt, tmp_path):
    name = "model.layers.2.self_attn.o_proj.weight"
    t = read_all(ckpt["fp8"])
    dense = ref.dequantize_fp8_block(t[name], t[f"{name}_scale_inv"]).to(torch.bfloat16)

    def edit(tensors):
        tensors[name] = dense
        tensors.pop(f"{name}_scale_inv")
    path = rewrite(ckpt["fp8"], tmp_path / "mixed", edit)
    with pytest.raises(ValueError, match=rf"'{name}' is stored dense but .* is stored fp8: every attention weight"):
        load_model(path)
    assert load_model(path, dequantize=True).formats == WeightFormats()


def test_k2_thinking_config_is_what_kimi_ships():
    q = copy.deepcopy(KIMI_K2_THINKING_QUANTIZATION_CONFIG)
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "pack-quantized"
    w = q["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["group_size"]) == (4, "int", True, "group", 32)
    assert q["ignore"] == ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                           "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]


# ---- the quantized model on the Triton kernels and under torch.compile ---------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter check; GPUs run the compiled kernels")
@pytest.mark.parametrize("dtype, atol", [("int4", 1e-4), ("fp8", 2e-2)])
def test_quantized_model_on_triton_matches_torch(ckpt, dtype, atol, monkeypatch):
    """Prompt and decode log-probs of the quantized model with its quantized linears and fused
    MoE on the Triton kernels (interpreter) equal the torch backend's. fp32 both ways; INT4
    (W4A16) differs by summation order only (measured 1.4e-6); FP8 (W8A8) may also round an
    activation that sits on an fp8 rounding boundary the other way (measured 1e-6 here, allowed
    a flip's worth)."""
    from kvtier.ops import dispatch
    from kvtier.ops import quant as quant_ops

    resolved: set[tuple[str, str]] = set()

    def recording(op, *args):
        name = dispatch.resolve_backend(op, *args)
        resolved.add((op, name))
        return name

    monkeypatch.setattr(quant_ops, "resolve_backend", recording)
    prompt = torch.randint(0, CONFIG.vocab_size, (13,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=True, prompt_logprobs=True, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(ckpt[dtype]), dtype="float32", num_device_pages=16, page_size=16, max_num_batched_tokens=8)
        llm.engine.runner.model.set_backend(backend)
        outs[backend] = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    moe = "fused_moe_w4a16" if dtype == "int4" else "fused_moe_fp8_block"
    assert (moe, "triton") in resolved and (moe, "torch") in resolved
    if dtype == "fp8":
        assert ("linear_fp8_block", "triton") in resolved
    ref_out, got = outs["torch"], outs["triton"]
    assert got.token_ids == ref_out.token_ids
    got_lp = torch.tensor(got.prompt_logprobs + got.logprobs)
    want_lp = torch.tensor(ref_out.prompt_logprobs + ref_out.logprobs)
    assert float((got_lp - want_lp).abs().max()) <= atol


@pytest.mark.parametrize("dtype", ["int4", "fp8"])
def test_quantized_decode_step_traces_whole(ckpt, dtype):
    """Dynamo fullgraph (eager backend) through the quantized ops: no graph break, same output."""
    from tests.helpers.step_inputs import _caches, _decode_inputs, _page_tables, _prefill

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(1)
    model = load_model(ckpt[dtype], torch.float32)
    caches, table = _caches(model), _page_tables(gen)
    traced = torch.compile(model, fullgraph=True, backend="eager")
    with torch.inference_mode():
        eager_caches = [c.clone() for c in caches]
        _prefill(model, eager_caches, table, torch.Generator().manual_seed(2))
        _prefill(model, caches, table, torch.Generator().manual_seed(2), run=traced)
        ids, positions, batch = _decode_inputs(model, table, gen)
        planned = model.plan(positions, batch, caches)
        want = model(ids, positions, planned, eager_caches)
        got = traced(ids, positions, planned, caches)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_create_checkpoint_command_writes_int4(tmp_path, capsys):
    from kvtier.cli import main

    assert main(["create-checkpoint", str(tmp_path / "c"), "--dtype", "int4", "--seed", "3"]) == 0
    assert "wrote int4 checkpoint of preset 'tiny'" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    assert cfg["quantization_config"] == KIMI_K2_THINKING_QUANTIZATION_CONFIG and cfg["torch_dtype"] == "bfloat16"
    index = json.loads((tmp_path / "c" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.2.mlp.experts.15.down_proj.weight_packed" in index
    assert "model.layers.2.mlp.experts.15.down_proj.weight" not in index


@pytest.fixture
def no_fp8_activation_quant():
    with ref.fp8_activation_quant(False):
        yield


def test_fp8_weights_convert_to_e4m3fnuz_without_changing_the_model(ckpt, no_fp8_activation_quant):
    """gfx942's matrix cores take float8_e4m3fnuz: the loader re-expresses the weights there; the
    values (weight x scale) stay the same, and so do the logits with the activation quantization
    off (W8A8 quantizes activations to the weight's fp8 dtype, whose largest value differs)."""
    from kvtier.model.loader import convert_fp8_weights
    from tests.helpers.step_inputs import _caches, _decode_inputs, _page_tables, _prefill

    def logits(model):
        gen = torch.Generator().manual_seed(3)
        caches, table = _caches(model), _page_tables(gen)
        with torch.inference_mode():
            _prefill(model, caches, table, torch.Generator().manual_seed(4))
            ids, positions, batch = _decode_inputs(model, table, gen)
            return model.compute_logits(model(ids, positions, batch, caches))

    model = load_model(ckpt["fp8"], torch.float32)
    before = logits(model)
    w = model.layers[1].mlp.w13
    value = ref.dequantize_fp8_block(w[3], model.layers[1].mlp.w13_scale_inv[3])
    fp8_weights = sum(p.dtype == torch.float8_e4m3fn for p in model.parameters())
    assert convert_fp8_weights(model, torch.float8_e4m3fnuz) == fp8_weights > 0
    assert all(p.dtype != torch.float8_e4m3fn for p in model.parameters())
    moe = model.layers[1].mlp
    assert moe.w13.dtype == torch.float8_e4m3fnuz
    assert torch.equal(ref.dequantize_fp8_block(moe.w13[3], moe.w13_scale_inv[3]), value)
    torch.testing.assert_close(logits(model), before, atol=1e-5, rtol=0)
    assert convert_fp8_weights(model, torch.float8_e4m3fn) == 0
