"""The DeepSeek-V3 weight tensor names and shapes, and where each lands in our model.

One table serves the loader (to check and place tensors) and the random-weights writer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtier.model.config import KimiK2Config


@dataclass(frozen=True)
class TensorSpec:
    """One weight tensor.

    Attributes:
        shape: expected shape in elements.
        target: dotted path of our parameter that receives it.
        index: leading index into the target (e.g. ``(expert,)``), or () for the whole tensor.
        row_offset: first row of the target slice (gate rows at 0, up rows at I in fused weights).
        quantizable: stored as FP8 in block-quantized weights (2-D linear weights only).
    """

    shape: tuple[int, ...]
    target: str
    index: tuple[int, ...] = ()
    row_offset: int = 0
    quantizable: bool = True


def _mlp_specs(prefix: str, target: str, hidden: int, inter: int, index: tuple[int, ...] = ()) -> dict:
    return {
        f"{prefix}.gate_proj.weight": TensorSpec((inter, hidden), f"{target}.gate_up_proj" if not index
                                                 else f"{target}.w13", index, 0),
        f"{prefix}.up_proj.weight": TensorSpec((inter, hidden), f"{target}.gate_up_proj" if not index
                                               else f"{target}.w13", index, inter),
        f"{prefix}.down_proj.weight": TensorSpec((hidden, inter), f"{target}.down_proj" if not index
                                                 else f"{target}.w2", index, 0),
    }


def _attention_specs(c: KimiK2Config, p: str, t: str) -> dict[str, TensorSpec]:
    nh = c.num_attention_heads
    specs = {}
    if c.q_lora_rank is None:
        specs[f"{p}.q_proj.weight"] = TensorSpec((nh * c.qk_head_dim, c.hidden_size), f"{t}.q_proj")
    else:
        specs[f"{p}.q_a_proj.weight"] = TensorSpec((c.q_lora_rank, c.hidden_size), f"{t}.q_a_proj")
        specs[f"{p}.q_a_layernorm.weight"] = TensorSpec((c.q_lora_rank,), f"{t}.q_a_layernorm", quantizable=False)
        specs[f"{p}.q_b_proj.weight"] = TensorSpec((nh * c.qk_head_dim, c.q_lora_rank), f"{t}.q_b_proj")
    specs[f"{p}.kv_a_proj_with_mqa.weight"] = TensorSpec((c.kv_cache_dim, c.hidden_size), f"{t}.kv_a_proj_with_mqa")
    specs[f"{p}.kv_a_layernorm.weight"] = TensorSpec((c.kv_lora_rank,), f"{t}.kv_a_layernorm", quantizable=False)
    specs[f"{p}.kv_b_proj.weight"] = TensorSpec((nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
                                                f"{t}.kv_b_proj")
    specs[f"{p}.o_proj.weight"] = TensorSpec((c.hidden_size, nh * c.v_head_dim), f"{t}.o_proj")
    return specs


def _layer_specs(c: KimiK2Config, i: int) -> dict[str, TensorSpec]:
    p, t = f"model.layers.{i}", f"layers.{i}"
    specs = {
        f"{p}.input_layernorm.weight": TensorSpec((c.hidden_size,), f"{t}.input_layernorm", quantizable=False),
        f"{p}.post_attention_layernorm.weight": TensorSpec((c.hidden_size,), f"{t}.post_attention_layernorm",
                                                           quantizable=False),
    }
    specs.update(_attention_specs(c, f"{p}.self_attn", f"{t}.self_attn"))
    if not c.is_moe_layer(i):
        specs.update(_mlp_specs(f"{p}.mlp", f"{t}.mlp", c.hidden_size, c.intermediate_size))
        return specs
    specs[f"{p}.mlp.gate.weight"] = TensorSpec((c.n_routed_experts, c.hidden_size), f"{t}.mlp.gate_weight",
                                               quantizable=False)
    specs[f"{p}.mlp.gate.e_score_correction_bias"] = TensorSpec((c.n_routed_experts,),
                                                                f"{t}.mlp.e_score_correction_bias", quantizable=False)
    for e in range(c.n_routed_experts):
        specs.update(_mlp_specs(f"{p}.mlp.experts.{e}", f"{t}.mlp", c.hidden_size, c.moe_intermediate_size, (e,)))
    if c.n_shared_experts:
        specs.update(_mlp_specs(f"{p}.mlp.shared_experts", f"{t}.mlp.shared_experts", c.hidden_size,
                                c.moe_intermediate_size * c.n_shared_experts))
    return specs


def weights_bytes(config: KimiK2Config, bytes_per_element: float) -> int:
    """Bytes of all weight tensors at ``bytes_per_element`` (for size guards)."""
    return int(sum(math.prod(s.shape) for s in weight_specs(config).values()) * bytes_per_element)


def weight_specs(config: KimiK2Config) -> dict[str, TensorSpec]:
    """All tensors DeepSeek-V3-layout weights of ``config`` hold (MTP layers excluded)."""
    c = config
    specs = {"model.embed_tokens.weight": TensorSpec((c.vocab_size, c.hidden_size), "embed_tokens", quantizable=False)}
    for i in range(c.num_hidden_layers):
        specs.update(_layer_specs(c, i))
    specs["model.norm.weight"] = TensorSpec((c.hidden_size,), "norm", quantizable=False)
    specs["lm_head.weight"] = TensorSpec((c.vocab_size, c.hidden_size), "lm_head", quantizable=False)
    return specs


def write_shards(out, tensors, max_shard_bytes: int) -> None:
    """Write ``(name, tensor)`` pairs as Hugging Face safetensors shards in ``out`` (a directory
    that exists): ``model-0000i-of-0000n.safetensors``, a new shard once one would exceed
    ``max_shard_bytes`` bytes, and ``model.safetensors.index.json`` (``weight_map``, total bytes)."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    out = Path(out)
    shards: list[dict] = [{}]
    size = 0
    for name, t in tensors:
        if size and size + t.numel() * t.element_size() > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
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
