"""Weights of the hybrid Kimi models: tensor names and shapes, loading, random weights.

Names are those of the released Kimi-Linear weights (what transformers' ``save_pretrained``
writes for ``KimiLinearForCausalLM``): KDA layers ``self_attn.{q,k,v}_proj``, ``{q,k,v}_conv1d``
[P, 1, W], ``f_a_proj``, ``f_b_proj``, ``dt_bias``, ``A_log`` [1, 1, NK, 1], ``b_proj``, the output
gate ``g_a_proj`` + ``g_b_proj`` (or K3's full-rank ``g_proj``), ``o_norm``, ``o_proj``; MoE layers
under ``block_sparse_moe.`` with ``experts.{e}.w1/w2/w3``; dense MLPs under ``mlp.``. K3 adds
``g_proj`` on MLA, ``block_sparse_moe.routed_expert_{down_proj,norm,up_proj}`` and the attention
residual weights (``self_attention_res_{norm,proj}``, ``mlp_res_{norm,proj}``,
``model.output_attn_res_{norm,proj}``). K3 weights prefix the text model with
``language_model.`` (its layers as ``language_model.layers.N``): both are read.

Weights are dense (bf16 / fp16 / fp32), except that a compressed-tensors ``mxfp4-pack-quantized``
``quantization_config`` (Kimi K3 as shipped) stores its targeted modules as ``<module>.weight_packed``
uint8 ``[N, K // 2]`` + ``<module>.weight_scale`` uint8 E8M0 ``[N, K // 32]``
(:mod:`kvtier.reference.mxfp4`): the routed experts are kept packed (``w13_packed`` / ``w13_scale`` /
``w2_packed`` / ``w2_scale`` on the MoE, run by :func:`kvtier.ops.fused_moe_mxfp4`) unless
``dequantize=True``; any other packed module is dequantized on load. Any other quantization
config is a load error naming the tensor and the ``quantization_config`` field
(:class:`Mxfp4Config`).
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import torch

from kvtier.model.kimi_linear import KimiLinearForCausalLM, random_hybrid_tensor
from kvtier.model.kimi_linear_config import KimiLinearConfig
from kvtier.model.safetensors_source import SafetensorsSource
from kvtier.model.weights import TensorSpec, _attention_specs, _mlp_specs, write_shards
from kvtier.reference import mxfp4 as ref_mxfp4

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


def hybrid_weight_specs(config: KimiLinearConfig) -> dict[str, TensorSpec]:
    """Every tensor of hybrid weights of ``config`` (MTP layers excluded), canonical names."""
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


MXFP4_FORMAT = "mxfp4-pack-quantized"
# what ``kvtier create-checkpoint --preset tiny-k3 --dtype mxfp4`` writes: routed experts MXFP4 (compressed-tensors
# mxfp4-pack-quantized, E8M0 scales per 32), every other module dense
K3_MXFP4_QUANTIZATION_CONFIG: dict = {
    "quant_method": "compressed-tensors", "format": MXFP4_FORMAT, "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": [r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"], "input_activations": None,
        "output_activations": None, "format": MXFP4_FORMAT,
        "weights": {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32,
                    "scale_dtype": "torch.uint8", "zp_dtype": None, "dynamic": False, "actorder": None,
                    "block_structure": None, "observer": "minmax", "observer_kwargs": {}}}},
    "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {},
}
_SCALE_DTYPES = (None, "torch.uint8", "uint8", "torch.float8_e8m0fnu", "float8_e8m0fnu")


def _matches(module: str, patterns) -> bool:
    """compressed-tensors matching: ``re:<regex>`` (``re.match`` on the module name), the class name
    ``Linear`` (every linear module), or an exact module name."""
    return any((p.startswith("re:") and re.match(p[3:], module)) or p == "Linear" or p == module for p in patterns)


class Mxfp4Config:
    """Hybrid weights' ``quantization_config``, checked: compressed-tensors
    ``mxfp4-pack-quantized`` (FP4 E2M1 weights, an E8M0 scale per 32 along K) or none.

    Config-wide fields are checked at construction; a group's ``weights`` when a tensor it targets is
    resolved (:meth:`targets`), so the error names that tensor. Activations are not quantized (W4A16): a
    group's ``input_activations`` may be null or the dynamic MXFP8 group-32 scheme K3 was trained
    with, which is accepted and run in the model dtype.

    Raises:
        ValueError: an unsupported method or field, naming ``quantization_config.<field>``.
    """

    def __init__(self, raw: dict | None):
        self.raw = dict(raw or {})
        self.groups: list[tuple[str, dict]] = []
        self.ignore: tuple[str, ...] = ()
        if not self.raw:
            return
        q = "quantization_config"
        method = self.raw.get("quant_method")
        if method != "compressed-tensors":
            raise ValueError(f"unsupported quantization_config ({q}.quant_method must be 'compressed-tensors' with "
                             f"format '{MXFP4_FORMAT}' for hybrid models), got {method!r}")
        for field, ok, want in (
                ("quantization_status", self.raw.get("quantization_status", "compressed") == "compressed",
                 "'compressed' (packed weights)"),
                ("sparsity_config", not self.raw.get("sparsity_config"), "empty (sparse weights are not supported)"),
                ("kv_cache_scheme", self.raw.get("kv_cache_scheme") is None,
                 "null (KV quantization is not supported)")):
            if not ok:
                raise ValueError(f"{q}.{field} must be {want}, got {self.raw.get(field)!r}")
        ignore = self.raw.get("ignore") or []
        if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
            raise ValueError(f"{q}.ignore must be a list of module names or 're:' patterns, got {ignore!r}")
        self.ignore = tuple(ignore)
        groups = self.raw.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ValueError(f"{q}.config_groups must be a non-empty object of config groups, got {groups!r}")
        for name, g in groups.items():
            targets = g.get("targets") if isinstance(g, dict) else None
            if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
                raise ValueError(f"{q}.config_groups.{name}.targets must be a non-empty list of module names or "
                                 f"patterns, got {targets!r}")
            if not isinstance(g.get("weights"), dict):
                raise ValueError(f"{q}.config_groups.{name}.weights must be an object, got {g.get('weights')!r}")
            self.groups.append((name, g))

    @property
    def quantized(self) -> bool:
        return bool(self.groups)

    def targets(self, module: str, tensor: str) -> bool:
        """Whether ``module`` (its stored name without ``.weight``) is stored MXFP4; checks the
        targeting group, naming ``tensor`` in the error."""
        if not self.groups or _matches(module, self.ignore):
            return False
        for name, g in self.groups:
            if _matches(module, g["targets"]):
                _check_mxfp4_group(name, g, self.raw.get("format"), tensor)
                return True
        return False


def _check_mxfp4_group(name: str, g: dict, top_format, tensor: str) -> None:
    where = f"quantization_config.config_groups.{name}"
    w = g["weights"]
    fmt = g.get("format", top_format)

    def need(field: str, value, ok: bool, want: str) -> None:
        if not ok:
            raise ValueError(f"tensor {tensor!r}: {where}.{field} must be {want}, got {value!r}")

    need("format", fmt, fmt == MXFP4_FORMAT, f"'{MXFP4_FORMAT}' (FP4 E2M1 codes two per byte)")
    need("weights.num_bits", w.get("num_bits"), w.get("num_bits") == 4, "4 (FP4 weights)")
    need("weights.type", w.get("type"), w.get("type") == "float", "'float' (E2M1)")
    need("weights.strategy", w.get("strategy"), w.get("strategy") == "group", "'group' (one scale per 32 inputs)")
    need("weights.group_size", w.get("group_size"), w.get("group_size") == ref_mxfp4.MXFP4_GROUP,
         f"{ref_mxfp4.MXFP4_GROUP} (MX blocks)")
    need("weights.symmetric", w.get("symmetric"), w.get("symmetric", True) is True, "true")
    need("weights.scale_dtype", w.get("scale_dtype"), w.get("scale_dtype") in _SCALE_DTYPES, "uint8 (E8M0 exponents)")
    need("weights.zp_dtype", w.get("zp_dtype"), w.get("zp_dtype") is None, "null (no zero points)")
    need("weights.dynamic", w.get("dynamic"), not w.get("dynamic"), "false (static weight scales)")
    need("weights.actorder", w.get("actorder"), w.get("actorder") is None, "null")
    need("weights.block_structure", w.get("block_structure"), w.get("block_structure") is None, "null")
    a = g.get("input_activations")
    mxfp8 = (isinstance(a, dict) and a.get("num_bits") == 8 and a.get("type") == "float" and bool(a.get("dynamic"))
             and a.get("group_size") == ref_mxfp4.MXFP4_GROUP)
    need("input_activations", a, a is None or mxfp8, "null or dynamic MXFP8 group-32 (run in the model dtype)")
    need("output_activations", g.get("output_activations"), g.get("output_activations") is None, "null")


def read_hybrid_config(model_dir: str | Path) -> tuple[KimiLinearConfig, dict]:
    """(config, raw config.json dict) of a ``kimi_linear`` / ``kimi_k3`` weights directory.

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
            Mxfp4Config(where.get("quantization_config"))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return config, raw


def _is_routed_expert(spec: TensorSpec) -> bool:
    return bool(spec.index) and spec.target.endswith((".w13", ".w2"))


def hold_packed_experts(model: KimiLinearForCausalLM) -> None:
    """Replace every MoE's dense ``w13`` / ``w2`` by empty MXFP4 parameters (uint8, no grad):
    ``w13_packed`` [E, 2I, L // 2], ``w13_scale`` [E, 2I, L // 32], ``w2_packed`` [E, L, I // 2],
    ``w2_scale`` [E, L, I // 32]; the MoE then runs :func:`kvtier.ops.fused_moe_mxfp4`."""
    g = ref_mxfp4.MXFP4_GROUP
    for module in model.modules():
        if hasattr(module, "w13") and hasattr(module, "e_score_correction_bias"):
            for name in ("w13", "w2"):
                e, n, k = getattr(module, name).shape
                delattr(module, name)
                for suffix, width in (("packed", k // 2), ("scale", k // g)):
                    setattr(module, f"{name}_{suffix}",
                            torch.nn.Parameter(torch.empty(e, n, width, dtype=torch.uint8), requires_grad=False))


def _read_packed(source, by_name, key: str, name: str, spec: TensorSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight_packed uint8, weight_scale uint8) of the MXFP4 module of stored weight ``name``."""
    module = name[: -len(".weight")]
    n, k = spec.shape
    out = []
    for suffix, shape in (("weight_packed", (n, k // 2)), ("weight_scale", (n, k // ref_mxfp4.MXFP4_GROUP))):
        raw = by_name.get(f"{key[: -len('.weight')]}.{suffix}")
        if raw is None:
            raise ValueError(f"the weights directory lacks tensor '{module}.{suffix}' (MXFP4 {suffix.split('_')[1]} of "
                             f"{module}, required by quantization_config.format '{MXFP4_FORMAT}')")
        t = source.get(raw)
        if t.dtype == getattr(torch, "float8_e8m0fnu", None):
            t = t.view(torch.uint8)
        if t.dtype != torch.uint8 or tuple(t.shape) != shape:
            raise ValueError(f"tensor '{module}.{suffix}' must be uint8 of shape {shape} (MXFP4 of a {spec.shape} "
                             f"weight), got {t.dtype} {tuple(t.shape)}")
        out.append(t)
    return out[0], out[1]


def load_hybrid_weights(model: KimiLinearForCausalLM, source, quant: Mxfp4Config | None = None,
                        dequantize: bool = False) -> None:
    """Fill every parameter of ``model`` from ``source`` (``keys()``, ``get(name)``), checking names,
    shapes and dtypes; MTP layers (past ``num_hidden_layers``) and other towers are skipped.

    With an MXFP4 ``quant``, the modules it targets are read as ``weight_packed`` / ``weight_scale``:
    routed experts stay packed (call :func:`hold_packed_experts` on ``model`` first) unless
    ``dequantize``, other modules are dequantized into their dense parameter.

    Raises:
        ValueError: a missing, misshaped, non-floating or unexpected tensor, or a quantization field
            the format does not allow, naming the tensor (and the field).
    """
    c = model.config
    quant = quant or Mxfp4Config(None)
    specs = hybrid_weight_specs(c)
    by_name = {_canonical(k): k for k in source.keys()}
    if "lm_head.weight" not in by_name and c.tie_word_embeddings:
        by_name["lm_head.weight"] = by_name.get("model.embed_tokens.weight")
    used = set()
    params = dict(model.named_parameters())
    packed_model = any(n.endswith("w13_packed") for n in params)
    with torch.no_grad():
        for name, spec in specs.items():
            key = name if name in by_name or f"{name[:-7]}.weight_packed" in by_name else _alternative(name)
            raw_module = by_name.get(f"{key[:-7]}.weight_packed", "")[: -len(".weight_packed")]
            if raw_module and spec.quantizable and len(spec.shape) == 2 and quant.targets(raw_module,
                                                                                       f"{raw_module}.weight_packed"):
                used.update({f"{key[:-7]}.weight_packed", f"{key[:-7]}.weight_scale", f"{key[:-7]}.weight_shape"})
                packed, scale = _read_packed(source, by_name, key, name, spec)
                if _is_routed_expert(spec) and packed_model:
                    for suffix, t in (("packed", packed), ("scale", scale)):
                        dst = params[f"{spec.target}_{suffix}"][spec.index]
                        rows = t.shape[0]
                        dst[spec.row_offset: spec.row_offset + rows].copy_(t)
                    continue
                t = ref_mxfp4.dequantize_mxfp4(packed, scale)
            else:
                if quant.quantized and spec.quantizable and len(spec.shape) == 2 and \
                        quant.targets(by_name.get(key, key)[: -len(".weight")], f"{name[:-7]}.weight_packed"):
                    raise ValueError(f"the weights directory lacks tensor '{name[:-7]}.weight_packed' "
                                     f"(quantization_config.config_groups targets {name[:-7]} as '{MXFP4_FORMAT}')")
                if by_name.get(key) is None:
                    raise ValueError(f"the weights directory lacks tensor {name!r} (expected shape {spec.shape})")
                if packed_model and _is_routed_expert(spec):
                    raise ValueError(f"tensor {name!r} is stored dense but the model holds its routed experts MXFP4 "
                                     "(one format per weight class); load with dequantize=True")
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
        raise ValueError(f"the weights have an unexpected tensor {by_name[name]!r} (not a parameter of this "
                         f"{c.model_type} config)")


def load_hybrid_model(model_dir: str | Path, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu", backend: str = "auto",
                      dequantize: bool = False) -> KimiLinearForCausalLM:
    """Build and load a hybrid model from a HF-layout directory (config.json + safetensors).

    Weights ``mxfp4-pack-quantized`` keep their routed experts packed (the MoE runs
    :func:`kvtier.ops.fused_moe_mxfp4`); ``dequantize=True`` expands them to ``dtype`` (the bf16
    :func:`kvtier.ops.fused_moe` path).

    Raises:
        FileNotFoundError: no config.json or no safetensors. ValueError: as :func:`read_hybrid_config`
            and :func:`load_hybrid_weights`.
    """
    config, raw = read_hybrid_config(model_dir)
    text = raw.get("text_config", raw) if raw.get("model_type") == "kimi_k3" else raw
    quant = Mxfp4Config(raw.get("quantization_config") or text.get("quantization_config"))
    model = KimiLinearForCausalLM(config, dtype, backend)
    if quant.quantized and not dequantize:
        hold_packed_experts(model)
    load_hybrid_weights(model, SafetensorsSource(Path(model_dir)), quant, dequantize)
    return model.to(device)


def _random_tensors(config: KimiLinearConfig, seed: int, dtype: torch.dtype, mxfp4: bool):
    gen = torch.Generator().manual_seed(seed)
    for name, spec in hybrid_weight_specs(config).items():
        t = random_hybrid_tensor(name, spec.shape, gen)
        if mxfp4 and _is_routed_expert(spec):
            packed, scale = ref_mxfp4.quantize_mxfp4(t)
            yield f"{name[: -len('.weight')]}.weight_packed", packed
            yield f"{name[: -len('.weight')]}.weight_scale", scale
            continue
        fp32 = name.endswith(("gate.weight", "e_score_correction_bias", "dt_bias", "A_log"))
        yield name, t if fp32 else t.to(dtype)


def write_random_hybrid_weights(out: Path, config: KimiLinearConfig, seed: int, dtype: torch.dtype,
                                   max_shard_bytes: int, mxfp4: bool = False) -> Path:
    """Deterministic random weights of ``config`` (values of :func:`random_hybrid_tensor` from
    ``torch.Generator(seed)`` in spec order; router and gate parameters fp32, the rest ``dtype``);
    a ``kimi_k3`` config writes its text model under ``language_model.`` as K3 ships. ``mxfp4``:
    the routed experts as compressed-tensors ``mxfp4-pack-quantized`` (``weight_packed`` /
    ``weight_scale``, quantized from the same draws; :data:`K3_MXFP4_QUANTIZATION_CONFIG`)."""
    prefix = "language_model." if config.model_type == "kimi_k3" else ""
    write_shards(out, ((prefix + name, t) for name, t in _random_tensors(config, seed, dtype, mxfp4)), max_shard_bytes)
    cfg = config.to_hf_dict()
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    if mxfp4:
        quant = copy.deepcopy(K3_MXFP4_QUANTIZATION_CONFIG)
        if prefix:  # module names as the stored weights spell them
            quant["ignore"] = [f"{prefix}lm_head", "lm_head"]
        (cfg["text_config"] if "text_config" in cfg else cfg)["quantization_config"] = quant
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
