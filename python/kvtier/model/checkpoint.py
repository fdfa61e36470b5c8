"""Deterministic random checkpoints in the Hugging Face DeepSeek-V3 layout.

Used by tests, the quickstart and benchmarks in place of real weights (which cannot be
downloaded here). Values are drawn from ``torch.Generator(seed)`` in a fixed order, so the
same (config, seed) always gives the same bytes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvtier.model.config import KimiK2Config, preset
from kvtier.model.weights import TensorSpec, checkpoint_bytes, checkpoint_specs

FP8_MAX = 448.0  # largest finite float8_e4m3fn value
CHECKPOINT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


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
    """(name, tensor) pairs of a random checkpoint; fp8 adds ``<name>_scale_inv`` after each weight."""
    if dtype not in CHECKPOINT_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(CHECKPOINT_DTYPES)}, got {dtype!r}")
    gen = torch.Generator().manual_seed(seed)
    for name, spec in checkpoint_specs(config).items():
        value = _random_tensor(name, spec, gen)
        if dtype == "fp8" and spec.quantizable:
            q, scale_inv = quantize_fp8_block(value)
            yield name, q
            yield f"{name}_scale_inv", scale_inv
        elif name.endswith(("mlp.gate.weight", "e_score_correction_bias")):
            yield name, value  # the router stays fp32, as in DeepSeek-V3 releases
        else:
            yield name, value.to(torch.bfloat16 if dtype == "fp8" else CHECKPOINT_DTYPES[dtype])


def create_random_checkpoint(path: str | Path, preset_or_config: str | KimiK2Config = "tiny", seed: int = 0,
                             dtype: str = "bfloat16", max_shard_bytes: int = 64 << 20,
                             max_total_bytes: int = 8 << 30) -> Path:
    """Write a deterministic random checkpoint (config.json + sharded safetensors + index).

    Args:
        path: output directory (created if missing).
        preset_or_config: a preset name (``tiny``) or a :class:`KimiK2Config`.
        seed: generator seed; the same seed writes the same tensors.
        dtype: ``float32`` | ``bfloat16`` | ``fp8`` (linear weights as e4m3 with 128x128
            ``weight_scale_inv`` block scales, other tensors bf16/fp32 as in DeepSeek-V3 releases).
        max_shard_bytes: start a new shard once one exceeds this many bytes.
        max_total_bytes: refuse (ValueError) configs whose checkpoint would be larger.

    Returns:
        The checkpoint directory.
    """
    config = preset(preset_or_config) if isinstance(preset_or_config, str) else preset_or_config
    if dtype not in CHECKPOINT_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(CHECKPOINT_DTYPES)}, got {dtype!r}")
    size = checkpoint_bytes(config, CHECKPOINT_DTYPES[dtype].itemsize)
    if size > max_total_bytes:
        raise ValueError(f"a random {dtype} checkpoint of this config takes {size / 2**30:.0f} GiB, more than "
                         f"max_total_bytes={max_total_bytes / 2**30:.0f} GiB; random full-size checkpoints are not useful")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in random_tensors(config, seed, dtype):
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
    cfg = config.to_hf_dict()
    cfg["torch_dtype"] = "bfloat16" if dtype == "fp8" else dtype
    if dtype == "fp8":
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
