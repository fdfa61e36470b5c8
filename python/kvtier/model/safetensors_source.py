"""Tensors of a Hugging Face-layout weights directory by name, read from its safetensors shards
(``model.safetensors.index.json``, or every ``*.safetensors`` file), for both loaders
(:mod:`kvtier.model.loader`, :mod:`kvtier.model.kimi_linear_loader`)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

_PREFIXES = ("language_model.",)  # multimodal K2.5/K2.6 weights wrap the text model


class TensorSource(Protocol):
    def keys(self) -> Iterable[str]: ...
    def get(self, name: str) -> torch.Tensor: ...


# safetensors dtype names (the header's "dtype") of the dtypes stored weights may hold
_ST_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
              "F64": torch.float64, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
              "U8": torch.uint8, "BOOL": torch.bool, "F8_E5M2": torch.float8_e5m2}


class SafetensorsSource:
    """Tensors of every shard in a weights directory, by canonical (unprefixed) name."""

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

    def _handle(self, file: str):
        if file not in self._handles:
            self._handles[file] = safe_open(str(self._dir / file), "pt")
        return self._handles[file]

    def get(self, name: str) -> torch.Tensor:
        raw, file = self._where[name]
        return self._handle(file).get_tensor(raw)

    def dtype(self, name: str) -> torch.dtype | None:
        """The tensor's dtype from the shard header (no data read); None for an unknown one."""
        raw, file = self._where[name]
        return _ST_DTYPES.get(self._handle(file).get_slice(raw).get_dtype())

    def raw_name(self, name: str) -> str:
        """The tensor's name in the shard (``language_model.`` kept)."""
        return self._where[name][0]


def _canonical(name: str) -> str:
    for p in _PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    return name
