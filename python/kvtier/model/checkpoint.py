"""Deterministic random weights in the Hugging Face DeepSeek-V3 layout (a weights directory).

Used by tests, the quickstart and benchmarks in place of real weights (which cannot be
downloaded here). Values are drawn from ``torch.Generator(seed)`` in a fixed order, so the
same (config, seed) always gives the same bytes, and the same values whatever the dtype (an
``int4`` or ``fp8`` directory holds the quantized ``float32`` weights of the same seed).

Layouts as released:

- ``fp8`` (DeepSeek-V3, Kimi K2 base): every linear weight but the router and ``lm_head`` as
  float8_e4m3fn with ``<name>_scale_inv`` fp32 128x128 block scales; ``quantization_config``
  ``quant_method: fp8``.
- ``int4`` (Kimi K2 Thinking, K2.5, K2.6): routed experts as compressed-tensors
  ``pack-quantized`` INT4 group-32 symmetric (``<module>.weight_packed`` int32 [N, K/8],
  ``.weight_scale`` bf16 [N, K/32], ``.weight_shape`` int64 [2]), everything else bf16 (router
  fp32); ``quantization_config`` Kimi K2 Thinking's
  (:data:`kvtier.model.formats.KIMI_K2_THINKING_QUANTIZATION_CONFIG`).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch

from kvtier.model.config import KimiK2Config, preset
from kvtier.model.kimi_linear_config import KimiLinearConfig
from kvtier.model.formats import (
    DEEPSEEK_FP8_QUANTIZATION_CONFIG,
    KIMI_K2_THINKING_QUANTIZATION_CONFIG,
    PRESET_FORMATS,
    weight_class,
)
from kvtier.model.plan import parameter_bytes
from kvtier.model.weights import TensorSpec, weight_specs, write_shards
from kvtier.reference import quant as ref_quant

FP8_MAX = 448.0  # largest finite float8_e4m3fn value
WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn,
                     "int4": torch.int32, "mxfp4": torch.uint8}
INT4_GROUP_SIZE = 32  # Kimi K2 Thinking / K2.5 / K2.6


def _random_tensor(name: str, spec: TensorSpec, gen: torch.Generator) -> torch.Tensor:
    """fp32 values: norms near 1, routing bias near 0, linear weights ~ N(0, 1/fan_in)."""
    if name.endswith("e_score_correction_bias"):
        return 0.1 * torch.randn(spec.shape, generator=gen)
    if len(spec.shape) == 1:
        return 1.0 + 0.1 * torch.randn(spec.shape, generator=gen)
    if name == "model.embed_tokens.weight":
        return torch.randn(spec.shape, generator=gen)
    return torch.randn(spec.shape, generator=gen) / math.sqrt(spec.shape[1])


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [out, in] -> (float8_e4m3fn weight, fp32 scale_inv [ceil(out/b0), ceil(in/b1)]).

    Each block's scale maps its absolute maximum to 448 (the e4m3fn maximum).
    """
    rows, cols = w.shape
    br, bc = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    padded = torch.zeros(br * block[0], bc * block[1])
    padded[:rows, :cols] = w
    blocks = padded.view(br, block[0], bc, block[1])
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / FP8_MAX
    q = (blocks / scale_inv[:, None, :, None]).view(br * block[0], bc * block[1])[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale_inv


def random_tensors(config: KimiK2Config, seed: int, dtype: str = "bfloat16") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of random weights: fp8 adds ``<name>_scale_inv`` after each
    linear weight; int4 writes each routed expert's ``<module>.weight_packed``, ``.weight_scale``
    and ``.weight_shape`` in place of its ``.weight`` (module docstring)."""
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(WEIGHT_DTYPES)}, got {dtype!r}")
    gen = torch.Generator().manual_seed(seed)
    dense = torch.bfloat16 if dtype in ("fp8", "int4") else WEIGHT_DTYPES[dtype]
    for name, spec in weight_specs(config).items():
        value = _random_tensor(name, spec, gen)
        if dtype == "fp8" and spec.quantizable:
            q, scale_inv = quantize_fp8_block(value)
            yield name, q
            yield f"{name}_scale_inv", scale_inv
        elif dtype == "int4" and weight_class(spec.target) == "routed_experts":
            module = name[: -len(".weight")]
            packed, scale = ref_quant.quantize_int4_group(value, INT4_GROUP_SIZE)
            yield f"{module}.weight_packed", packed
            yield f"{module}.weight_scale", scale.to(torch.bfloat16)
            yield f"{module}.weight_shape", torch.tensor(spec.shape, dtype=torch.int64)
        elif name.endswith(("mlp.gate.weight", "e_score_correction_bias")):
            yield name, value  # the router stays fp32, as in DeepSeek-V3 and Kimi releases
        else:
            yield name, value.to(dense)


def _create_hybrid_weights(path, config: KimiLinearConfig, seed: int, dtype: str, max_shard_bytes: int,
                              max_total_bytes: int) -> Path:
    """Random hybrid (``kimi_linear`` / ``kimi_k3``) weights: dense ``float32`` or ``bfloat16``, or
    ``mxfp4`` (routed experts compressed-tensors ``mxfp4-pack-quantized``, the rest bf16, as K3 ships)."""
    from kvtier.model.kimi_linear_loader import hybrid_weight_specs, write_random_hybrid_weights

    if dtype not in ("float32", "bfloat16", "mxfp4"):
        raise ValueError(f"dtype must be 'float32', 'bfloat16' or 'mxfp4' for {config.model_type} weights, "
                         f"got {dtype!r}")
    if dtype == "mxfp4":
        bad = [(n, v) for n, v in (("moe_intermediate_size", config.moe_intermediate_size),
                                   ("routed_expert_hidden_size or hidden_size", config.moe_hidden_size)) if v % 32]
        if bad:
            raise ValueError(f"dtype='mxfp4' needs the experts' sizes to be multiples of 32 (one E8M0 scale per 32), "
                             f"got {bad[0][0]} = {bad[0][1]}")
    width = 4 if dtype == "float32" else 2
    size = sum(math.prod(s.shape) for s in hybrid_weight_specs(config).values()) * width
    if size > max_total_bytes:
        raise ValueError(f"random {dtype} weights of this config take {size / 2**30:.0f} GiB, more than "
                         f"max_total_bytes={max_total_bytes / 2**30:.0f} GiB; random full-size weights are not useful")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    dense = torch.bfloat16 if dtype == "mxfp4" else WEIGHT_DTYPES[dtype]
    return write_random_hybrid_weights(out, config, seed, dense, max_shard_bytes, mxfp4=dtype == "mxfp4")


def create_random_checkpoint(path: str | Path, preset_or_config: str | KimiK2Config | KimiLinearConfig = "tiny",
                             seed: int = 0,
                             dtype: str = "bfloat16", max_shard_bytes: int = 64 << 20,
                             max_total_bytes: int = 8 << 30) -> Path:
    """Write deterministic random weights (config.json + sharded safetensors + index).

    Args:
        path: output directory (created if missing).
        preset_or_config: a preset name (``tiny``, ``tiny-k3``) or a :class:`KimiK2Config` or
            :class:`KimiLinearConfig` (hybrid models: ``float32``, ``bfloat16`` or ``mxfp4``).
        seed: generator seed; the same seed writes the same tensors.
        dtype: ``float32`` | ``bfloat16`` | ``fp8`` (linear weights as e4m3 with 128x128
            ``weight_scale_inv`` block scales, other tensors bf16/fp32 as in DeepSeek-V3 releases)
            | ``int4`` (routed experts compressed-tensors INT4 group-32, as Kimi K2 Thinking /
            K2.6; the config's ``hidden_size`` and ``moe_intermediate_size`` must be multiples of 32)
            | ``mxfp4`` (hybrid models only: routed experts compressed-tensors ``mxfp4-pack-quantized``,
            FP4 E2M1 with E8M0 scales per 32, as Kimi K3 ships them; the rest bf16).
        max_shard_bytes: start a new shard once one exceeds this many bytes.
        max_total_bytes: refuse (ValueError) configs whose weights would be larger.

    Returns:
        The weights directory.

    Raises:
        ValueError: an unknown dtype, a config the dtype's layout cannot hold, or one too large.
    """
    config = preset(preset_or_config) if isinstance(preset_or_config, str) else preset_or_config
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(WEIGHT_DTYPES)}, got {dtype!r}")
    if isinstance(config, KimiLinearConfig):
        return _create_hybrid_weights(path, config, seed, dtype, max_shard_bytes, max_total_bytes)
    if dtype == "mxfp4":
        raise ValueError("dtype='mxfp4' is for hybrid (kimi_linear / kimi_k3) presets such as tiny-k3, got a "
                         f"{config.model_type} config")
    formats = {"int4": "int4", "fp8": "fp8"}.get(dtype, "bf16")
    if dtype == "int4":
        PRESET_FORMATS["int4"].check(config)
    size = sum(b for _, b in parameter_bytes(config, formats, 4 if dtype == "float32" else 2).values())
    if size > max_total_bytes:
        raise ValueError(f"random {dtype} weights of this config take {size / 2**30:.0f} GiB, more than "
                         f"max_total_bytes={max_total_bytes / 2**30:.0f} GiB; random full-size weights are not useful")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    write_shards(out, random_tensors(config, seed, dtype), max_shard_bytes)
    cfg = config.to_hf_dict()
    cfg["torch_dtype"] = "bfloat16" if dtype in ("fp8", "int4") else dtype
    if dtype == "fp8":
        cfg["quantization_config"] = copy.deepcopy(DEEPSEEK_FP8_QUANTIZATION_CONFIG)
    elif dtype == "int4":
        cfg["quantization_config"] = copy.deepcopy(KIMI_K2_THINKING_QUANTIZATION_CONFIG)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
