"""Load a Hugging Face-layout Kimi K2 / DeepSeek-V3 checkpoint into :class:`KimiK2ForCausalLM`.

Reads ``config.json`` and safetensors shards (``model.safetensors.index.json`` or every
``*.safetensors`` file). bf16/fp16/fp32 tensors are cast to the model dtype; FP8 e4m3 tensors
with ``<name>_scale_inv`` block scales (128x128 unless ``quantization_config.weight_block_size``
says otherwise) are dequantized on load: ``w = fp8.float() * scale_inv[i // 128, j // 128]``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from kvtier.model.config import KimiK2Config
from kvtier.model.kimi_k2 import KimiK2ForCausalLM
from kvtier.model.weights import TensorSpec, checkpoint_specs

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
_PREFIXES = ("language_model.",)  # multimodal K2.5/K2.6 checkpoints wrap the text model
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class TensorSource(Protocol):
    def keys(self) -> Iterable[str]: ...
    def get(self, name: str) -> torch.Tensor: ...


class SafetensorsSource:
    """Tensors of every shard in a checkpoint directory, by canonical (unprefixed) name."""

    def __init__(self, model_dir: Path):
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(model_dir.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
            weight_map = {}
            for f in files:
                with safe_open(str(f), "pt") as h:
                    weight_map.update({k: f.name for k in h.keys()})
        self._dir = model_dir
        self._where = {_canonical(k): (k, v) for k, v in weight_map.items()}
        self._handles: dict[str, object] = {}

    def keys(self) -> Iterable[str]:
        return self._where.keys()

    def get(self, name: str) -> torch.Tensor:
        raw, file = self._where[name]
        if file not in self._handles:
            self._handles[file] = safe_open(str(self._dir / file), "pt")
        return self._handles[file].get_tensor(raw)


def _canonical(name: str) -> str:
    for p in _PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    return name


def checkpoint_fingerprint(model_dir: str | Path, sample_bytes: int = 1 << 20) -> bytes:
    """32-byte identity of a checkpoint directory, cheap enough to compute at every start.

    SHA-256 over config.json and, per ``*.safetensors`` shard (sorted by name), its name, size
    and first and last ``sample_bytes`` bytes: two checkpoints with different weights (a
    fine-tune, another random seed) differ there, while reading whole shards would take minutes.
    """
    model_dir = Path(model_dir)
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for shard in sorted(model_dir.glob("*.safetensors")):
        size = shard.stat().st_size
        h.update(f"{shard.name}:{size}".encode())
        with shard.open("rb") as f:
            h.update(f.read(sample_bytes))
            f.seek(max(size - sample_bytes, 0))
            h.update(f.read(sample_bytes))
    return h.digest()


def read_config(model_dir: str | Path) -> tuple[KimiK2Config, dict]:
    """(config, raw config.json dict). Raises FileNotFoundError / ValueError with the path."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: a model directory needs config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    try:
        return KimiK2Config.from_hf_dict(raw), raw
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                         name: str = "weight") -> torch.Tensor:
    """fp8 [out, in] weight times its [ceil(out/b0), ceil(in/b1)] fp32 block scales -> fp32.

    Raises:
        ValueError: ``scale_inv`` has the wrong shape (message names ``name``).
    """
    rows, cols = weight.shape
    want = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"{name}_scale_inv must have shape {want} for weight {tuple(weight.shape)} and block "
                         f"{block}, got {tuple(scale_inv.shape)}")
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale


def _fetch(source: TensorSource, available: set[str], name: str, spec: TensorSpec,
           block: tuple[int, int]) -> torch.Tensor:
    if name not in available:
        raise ValueError(f"checkpoint lacks tensor {name!r} (expected shape {spec.shape})")
    t = source.get(name)
    if not (t.is_floating_point() or t.dtype in FP8_DTYPES):
        raise ValueError(f"tensor {name!r} has dtype {t.dtype}, expected a floating-point or FP8 dtype")
    if tuple(t.shape) != spec.shape:
        raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {spec.shape}")
    if t.dtype in FP8_DTYPES:
        if t.dim() != 2:
            raise ValueError(f"FP8 tensor {name!r} must be a 2-D weight with block scales, got shape {tuple(t.shape)}")
        scale_name = f"{name}_scale_inv"
        if scale_name not in available:
            raise ValueError(f"FP8 tensor {name!r} has no {scale_name!r}")
        t = dequantize_fp8_block(t, source.get(scale_name), block, name)
    return t


def _check_unexpected(config: KimiK2Config, available: set[str], specs: Mapping[str, TensorSpec],
                      num_mtp_layers: int) -> None:
    for name in sorted(available - specs.keys()):
        if name.endswith("_scale_inv") and name[: -len("_scale_inv")] in specs:
            continue
        m = _LAYER.match(name)
        if m and config.num_hidden_layers <= int(m.group(1)) < config.num_hidden_layers + num_mtp_layers:
            continue  # multi-token-prediction layers: not used for plain decoding
        if name.endswith("rotary_emb.inv_freq"):
            continue
        raise ValueError(f"checkpoint has unexpected tensor {name!r} (not a DeepSeek-V3 parameter of this config)")


def load_weights(model: KimiK2ForCausalLM, source: TensorSource, block: tuple[int, int] = (128, 128),
                 num_mtp_layers: int = 0) -> None:
    """Fill every parameter of ``model`` from ``source`` (checked names, shapes and dtypes).

    ``num_mtp_layers`` layers after the last decoder layer (multi-token prediction,
    ``num_nextn_predict_layers`` in config.json) are skipped; any other extra tensor is an error.

    Raises:
        ValueError: a missing, misshaped or unexpected tensor, naming it.
    """
    config = model.config
    specs = checkpoint_specs(config)
    available = set(source.keys())
    if "lm_head.weight" not in available and config.tie_word_embeddings:
        specs = {**specs, "lm_head.weight": TensorSpec(specs["lm_head.weight"].shape, "lm_head")}
        available_lm = "model.embed_tokens.weight"
    else:
        available_lm = "lm_head.weight"
    _check_unexpected(config, available, specs, num_mtp_layers)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, spec in specs.items():
            src_name = available_lm if name == "lm_head.weight" else name
            t = _fetch(source, available, src_name, spec, block)
            dst = params[spec.target]
            if spec.index:
                dst = dst[spec.index]
            if spec.row_offset or dst.shape[0] != spec.shape[0]:
                dst = dst[spec.row_offset : spec.row_offset + spec.shape[0]]
            dst.copy_(t.to(dst.dtype))


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
               ) -> KimiK2ForCausalLM:
    """Build and load a model from a HF-layout directory (config.json + safetensors).

    Args:
        model_dir: directory with ``config.json`` and ``*.safetensors`` (optionally an index).
        dtype: parameter dtype (fp32, bf16 or fp16); the router stays fp32.
        device: where the parameters live.

    Raises:
        FileNotFoundError: no config.json or no safetensors.
        ValueError: unknown ``model_type``, invalid config, missing/misshaped/unexpected tensor.
    """
    model_dir = Path(model_dir)
    config, raw = read_config(model_dir)
    quant = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config") or {}
    block = tuple(quant.get("weight_block_size", (128, 128)))
    model = KimiK2ForCausalLM(config, dtype)
    text = raw.get("text_config", raw) if raw.get("model_type") not in ("kimi_k2", "deepseek_v3") else raw
    load_weights(model, SafetensorsSource(model_dir), block, int(text.get("num_nextn_predict_layers") or 0))
    return model.to(device)
