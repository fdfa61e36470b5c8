"""Checkpoints of the hybrid Kimi models: tensor names and shapes, loading, random checkpoints.

Names are those of the released Kimi-Linear checkpoints (what transformers' ``save_pretrained``
writes for ``KimiLinearForCausalLM``): KDA layers ``self_attn.{q,k,v}_proj``, ``{q,k,v}_conv1d``
[P, 1, W], ``f_a_proj``, ``f_b_proj``, ``dt_bias``, ``A_log`` [1, 1, NK, 1], ``b_proj``, the output
gate ``g_a_proj`` + ``g_b_proj`` (or K3's full-rank ``g_proj``), ``o_norm``, ``o_proj``; MoE layers
under ``block_sparse_moe.`` with ``experts.{e}.w1/w2/w3``; dense MLPs under ``mlp.``. K3 adds
``g_proj`` on MLA, ``block_sparse_moe.routed_expert_{down_proj,norm,up_proj}`` and the attention
residual weights (``self_attention_res_{norm,proj}``, ``mlp_res_{norm,proj}``,
``model.output_attn_res_{norm,proj}``). A K3 checkpoint prefixes the text model with
``language_model.`` (its layers as ``language_model.layers.N``): both are read.

Only dense (bf16 / fp16 / fp32) weights are read here; a ``quantization_config`` is refused,
naming the field.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvtier.model.kimi_linear import KimiLinearForCausalLM, random_hybrid_tensor
from kvtier.model.kimi_linear_config import KimiLinearConfig
from kvtier.model.loader import SafetensorsSource
from kvtier.model.weights import TensorSpec, _attention_specs, _mlp_specs

_PREFIXES = ("language_model.model.", "language_model.")
_OTHER_TOWERS = ("vision_tower.", "mm_projector.")


def _kda_specs(c: KimiLinearConfig, p: str, t: str) -> dict[str, TensorSpec]:
    h, pr, d, nk, w = c.hidden_size, c.kda_projection_size, c.linear_head_dim, c.linear_num_heads, \
        c.short_conv_kernel_size
    specs = {f"{p}.{n}_proj.weight": TensorSpec((pr, h), f"{t}.{n}_proj") for n in ("q", "k", "v")}
    for i, n in enumerate("qkv"):
        specs[f"{p}.{n}_conv1d.weight"] = TensorSpec((pr, 1, w), f"{t}.conv_weight", row_offset=i * pr,
                                                     quantizable=False)
    specs[f"{p}.f_a_proj.weight"] = TensorSpec((d, h), f"{t}.f_a_proj")
    specs[f"{p}.f_b_proj.weight"] = TensorSpec((pr, d), f"{t}.f_b_proj")
    specs[f"{p}.dt_bias"] = TensorSpec((pr,), f"{t}.dt_bias", quantizable=False)
    specs[f"{p}.A_log"] = TensorSpec((1, 1, nk, 1), f"{t}.A_log", quantizable=False)
    specs[f"{p}.b_proj.weight"] = TensorSpec((nk, h), f"{t}.b_proj")
    if c.use_full_rank_gate:
        specs[f"{p}.g_proj.weight"] = TensorSpec((pr, h), f"{t}.g_proj")
    else:
        specs[f"{p}.g_a_proj.weight"] = TensorSpec((d, h), f"{t}.g_a_proj")
        specs[f"{p}.g_b_proj.weight"] = TensorSpec((pr, d), f"{t}.g_b_proj")
    specs[f"{p}.o_norm.weight"] = TensorSpec((d,), f"{t}.o_norm", quantizable=False)
    specs[f"{p}.o_proj.weight"] = TensorSpec((h, pr), f"{t}.o_proj")
    return specs


def _moe_specs(c: KimiLinearConfig, p: str, t: str) -> dict[str, TensorSpec]:
    h, lat, inter = c.hidden_size, c.moe_hidden_size, c.moe_intermediate_size
    specs = {
        f"{p}.gate.weight": TensorSpec((c.n_routed_experts, h), f"{t}.gate_weight", quantizable=False),
        f"{p}.gate.e_score_correction_bias": TensorSpec((c.n_routed_experts,), f"{t}.e_score_correction_bias",
                                                        quantizable=False),
    }
    for e in range(c.n_routed_experts):
        specs[f"{p}.experts.{e}.w1.weight"] = TensorSpec((inter, lat), f"{t}.w13", (e,), 0)
        specs[f"{p}.experts.{e}.w3.weight"] = TensorSpec((inter, lat), f"{t}.w13", (e,), inter)
        specs[f"{p}.experts.{e}.w2.weight"] = TensorSpec((lat, inter), f"{t}.w2", (e,), 0)
    if c.routed_expert_hidden_size is not None:
        specs[f"{p}.routed_expert_down_proj.weight"] = TensorSpec((lat, h), f"{t}.routed_expert_down_proj")
        specs[f"{p}.routed_expert_up_proj.weight"] = TensorSpec((h, lat), f"{t}.routed_expert_up_proj")
        if c.latent_moe_use_norm:
            specs[f"{p}.routed_expert_norm.weight"] = TensorSpec((lat,), f"{t}.routed_expert_norm", quantizable=False)
    if c.n_shared_experts:
        specs.update(_mlp_specs(f"{p}.shared_experts", f"{t}.shared_experts", h, inter * c.n_shared_experts))
    return specs


def _layer_specs(c: KimiLinearConfig, i: int) -> dict[str, TensorSpec]:
    p, t = f"model.layers.{i}", f"layers.{i}"
    norms = ["input_layernorm", "post_attention_layernorm"]
    if c.attn_res_block_size is not None:
        norms += ["self_attention_res_norm", "mlp_res_norm"]
    specs = {f"{p}.{n}.weight": TensorSpec((c.hidden_size,), f"{t}.{n}", quantizable=False) for n in norms}
    if c.attn_res_block_size is not None:
        for n in ("self_attention_res_proj", "mlp_res_proj"):
            specs[f"{p}.{n}.weight"] = TensorSpec((1, c.hidden_size), f"{t}.{n}", quantizable=False)
    if c.is_kda_layer(i):
        specs.update(_kda_specs(c, f"{p}.self_attn", f"{t}.self_attn"))
    else:
        specs.update(_attention_specs(c, f"{p}.self_attn", f"{t}.self_attn"))
        if c.mla_use_output_gate:
            specs[f"{p}.self_attn.g_proj.weight"] = TensorSpec((c.num_attention_heads * c.v_head_dim, c.hidden_size),
                                                               f"{t}.self_attn.g_proj")
    if c.is_moe_layer(i):
        specs.update(_moe_specs(c, f"{p}.block_sparse_moe", f"{t}.mlp"))
    else:
        specs.update(_mlp_specs(f"{p}.mlp", f"{t}.mlp", c.hidden_size, c.intermediate_size))
    return specs


def hybrid_checkpoint_specs(config: KimiLinearConfig) -> dict[str, TensorSpec]:
    """Every tensor of a hybrid checkpoint of ``config`` (MTP layers excluded), canonical names."""
    c = config
    specs = {"model.embed_tokens.weight": TensorSpec((c.vocab_size, c.hidden_size), "embed_tokens", quantizable=False)}
    for i in range(c.num_hidden_layers):
        specs.update(_layer_specs(c, i))
    specs["model.norm.weight"] = TensorSpec((c.hidden_size,), "norm", quantizable=False)
    if c.attn_res_block_size is not None:
        specs["model.output_attn_res_norm.weight"] = TensorSpec((c.hidden_size,), "output_attn_res_norm",
                                                                quantizable=False)
        specs["model.output_attn_res_proj.weight"] = TensorSpec((1, c.hidden_size), "output_attn_res_proj",
                                                                quantizable=False)
    specs["lm_head.weight"] = TensorSpec((c.vocab_size, c.hidden_size), "lm_head", quantizable=False)
    return specs


def _canonical(name: str) -> str:
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            return name if name.startswith(("model.", "lm_head.")) else f"model.{name}"
    return name


def _alternative(name: str) -> str:
    """The other spelling of an MLP tensor (transformers writes every MLP under block_sparse_moe)."""
    if ".block_sparse_moe." in name:
        return name.replace(".block_sparse_moe.", ".mlp.")
    return name.replace(".mlp.", ".block_sparse_moe.")


def read_hybrid_config(model_dir: str | Path) -> tuple[KimiLinearConfig, dict]:
    """(config, raw config.json dict) of a ``kimi_linear`` / ``kimi_k3`` checkpoint directory.

    Raises:
        FileNotFoundError: no config.json. ValueError: the config is refused (names the field and the path).
    """
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: a model directory needs config.json")
    raw = json.loads(path.read_text())
    text = raw.get("text_config", raw) if raw.get("model_type") == "kimi_k3" else raw
    try:
        config = KimiLinearConfig.from_hf_dict(raw)
        for where in (raw, text):
            if where.get("quantization_config"):
                raise ValueError("quantization_config is not supported for hybrid models yet (dense bf16/fp16/fp32 "
                                 f"weights only), got quant_method {where['quantization_config'].get('quant_method')!r}")
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return config, raw


def load_hybrid_weights(model: KimiLinearForCausalLM, source) -> None:
    """Fill every parameter of ``model`` from ``source`` (``keys()``, ``get(name)``), checking names,
    shapes and dtypes; MTP layers (past ``num_hidden_layers``) and other towers are skipped.

    Raises:
        ValueError: a missing, misshaped, non-floating or unexpected tensor, naming it.
    """
    c = model.config
    specs = hybrid_checkpoint_specs(c)
    by_name = {_canonical(k): k for k in source.keys()}
    if "lm_head.weight" not in by_name and c.tie_word_embeddings:
        by_name["lm_head.weight"] = by_name.get("model.embed_tokens.weight")
    used = set()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, spec in specs.items():
            key = name if name in by_name else _alternative(name)
            if by_name.get(key) is None:
                raise ValueError(f"checkpoint lacks tensor {name!r} (expected shape {spec.shape})")
            used.add(key)
            t = source.get(by_name[key])
            if not t.is_floating_point():
                raise ValueError(f"tensor {name!r} has dtype {t.dtype}, expected a floating-point dtype")
            if tuple(t.shape) != spec.shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {spec.shape}")
            dst = params[spec.target][spec.index] if spec.index else params[spec.target]
            if dst.numel() != t.numel():  # one part of a fused weight: rows from row_offset
                rows = t.numel() // math.prod(dst.shape[1:])
                dst = dst[spec.row_offset: spec.row_offset + rows]
            dst.copy_(t.reshape(dst.shape).to(dst.dtype))
    for name in sorted(set(by_name) - used - {"lm_head.weight"}):
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if (layer is not None and layer.isdigit() and int(layer) >= c.num_hidden_layers) \
                or name.startswith(_OTHER_TOWERS) or name.endswith("rotary_emb.inv_freq"):
            continue
        raise ValueError(f"checkpoint has unexpected tensor {by_name[name]!r} (not a parameter of this "
                         f"{c.model_type} config)")


def load_hybrid_model(model_dir: str | Path, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu", backend: str = "auto") -> KimiLinearForCausalLM:
    """Build and load a hybrid model from a HF-layout directory (config.json + safetensors).

    Raises:
        FileNotFoundError: no config.json or no safetensors. ValueError: as :func:`read_hybrid_config`
            and :func:`load_hybrid_weights`.
    """
    config, _ = read_hybrid_config(model_dir)
    model = KimiLinearForCausalLM(config, dtype, backend)
    load_hybrid_weights(model, SafetensorsSource(Path(model_dir)))
    return model.to(device)


def write_random_hybrid_checkpoint(out: Path, config: KimiLinearConfig, seed: int, dtype: torch.dtype,
                                   max_shard_bytes: int) -> Path:
    """A deterministic random checkpoint of ``config`` (values of :func:`random_hybrid_tensor` from
    ``torch.Generator(seed)`` in spec order; router and gate parameters fp32, the rest ``dtype``);
    a ``kimi_k3`` config writes its text model under ``language_model.`` as K3 ships."""
    gen = torch.Generator().manual_seed(seed)
    prefix = "language_model." if config.model_type == "kimi_k3" else ""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, spec in hybrid_checkpoint_specs(config).items():
        t = random_hybrid_tensor(name, spec.shape, gen)
        fp32 = name.endswith(("gate.weight", "e_score_correction_bias", "dt_bias", "A_log"))
        t = t if fp32 else t.to(dtype)
        if size and size + t.numel() * t.element_size() > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][prefix + name] = t.contiguous()
        size += t.numel() * t.element_size()
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    cfg = config.to_hf_dict()
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
