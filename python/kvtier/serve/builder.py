"""One engine builder for the offline API (:class:`kvtier.LLM`) and the server
(:func:`kvtier.serve.api.server.make_app`): the model (weights or a random preset) and its
cache identity, the engine over it, and where its tokenizer lives.

Hybrid KDA + MLA models (``kimi_linear`` / ``kimi_k3`` weights, presets of
:data:`kvtier.model.kimi_linear_config.HYBRID_PRESETS` such as ``tiny-k3``) are built the same way;
the engine sizes what they cache from the model's ``cache_spec()``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from kvtier.model.checkpoint import random_tensors
from kvtier.model.config import PRESETS, KimiK2Config, did_you_mean, preset
from kvtier.model.kimi_k2 import KimiK2ForCausalLM
from kvtier.model.kimi_linear import KimiLinearForCausalLM, random_hybrid_tensor
from kvtier.model.kimi_linear_config import HYBRID_PRESETS, KimiLinearConfig
from kvtier.model.kimi_linear_loader import hybrid_weight_specs, load_hybrid_weights
from kvtier.model.loader import load_model, load_weights, weights_fingerprint
from kvtier.model.weights import weights_bytes
from kvtier.serve.config import EngineConfig
from kvtier.serve.engine import Engine

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
COMPUTE_DTYPES = ("auto", *_DTYPES)  # what dtype= takes: auto = float32 on a CPU, bfloat16 on a GPU
MAX_RANDOM_PRESET_BYTES = 8 << 30  # presets larger than this are for sizing, not for running here


class _DictSource(dict):
    def get(self, name):  # type: ignore[override]
        return self[name]


def _resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def check_device(name: str, device) -> torch.device:
    """``device`` as a torch device that exists here.

    ``"cpu"`` or ``"cuda"``/``"cuda:N"`` (ROCm's torch also calls its GPUs ``cuda``).

    Raises:
        ValueError: not a str/torch.device, not a torch device, or a ``cuda`` device on a machine
            without a usable CUDA/ROCm GPU (or an index past the last one), naming ``name``.
    """
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"{name} must be a str or torch.device, got {device!r} ({type(device).__name__})")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"{name}={device!r} is not a torch device: {e}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name}={str(device)!r} needs a CUDA or ROCm GPU, and this machine has none usable "
                             f"(torch {torch.__version__}: cuda {torch.version.cuda}, hip {torch.version.hip}, "
                             "torch.cuda.is_available() is False); expected 'cpu' here")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{name}={str(device)!r}: there are {torch.cuda.device_count()} GPUs")
    return dev


def _check_size(name: str, size: int, dtype: torch.dtype) -> None:
    if size > MAX_RANDOM_PRESET_BYTES:
        dtype_name = str(dtype).removeprefix("torch.")
        raise ValueError(f"preset {name!r} has {size / 2**30:,.0f} GiB of weights in {dtype_name} (the dtype it would "
                         f"run in): it is for sizing and simulation (kvtier plan --model {name}). Pass a weights directory "
                         "directory to run it.")


def _random_model(name: str, seed: int, dtype: torch.dtype, device: str) -> KimiK2ForCausalLM:
    config = preset(name)
    _check_size(name, weights_bytes(config, torch.finfo(dtype).bits // 8), dtype)
    model = KimiK2ForCausalLM(config, dtype)
    load_weights(model, _DictSource(random_tensors(config, seed, "float32")))
    return model.to(device)


def _random_hybrid_model(name: str, seed: int, dtype: torch.dtype, device: str) -> KimiLinearForCausalLM:
    """A hybrid preset with the values ``kvtier create-checkpoint --preset NAME --seed SEED`` writes
    (:func:`random_hybrid_tensor` in spec order, before its cast to the weights' dtype), in ``dtype``."""
    config = preset(name)
    specs = hybrid_weight_specs(config)
    _check_size(name, sum(math.prod(s.shape) for s in specs.values()) * torch.finfo(dtype).bits // 8, dtype)
    gen = torch.Generator().manual_seed(seed)
    model = KimiLinearForCausalLM(config, dtype)
    load_hybrid_weights(model, _DictSource({n: random_hybrid_tensor(n, s.shape, gen) for n, s in specs.items()}))
    return model.to(device)


def check_model(model: str | Path) -> None:
    """Raise ValueError unless ``model`` is a weights directory or a preset name
    (:data:`kvtier.model.PRESETS`), naming both."""
    if not Path(model).is_dir() and str(model) not in PRESETS:
        raise ValueError(f"model must be a weights directory or a preset in {sorted(PRESETS)}, got {model!r}"
                         f"{did_you_mean(model)}")


def load_for_serving(model: str | Path, *, dtype: str = "auto", device: str = "cpu",
                     seed: int = 0, dequantize: bool = False
                     ) -> tuple[KimiK2ForCausalLM | KimiLinearForCausalLM, bytes]:
    """The model and its identity for cache salting: ``(model, model_id)``.

    ``model`` is a weights directory (``model_id`` = its fingerprint; FP8 and INT4 weights are
    held as stored unless ``dequantize``, which is part of the id: the two compute differently)
    or a preset name (random weights from ``seed``; ``model_id`` names the preset and seed): a K2
    or hybrid preset (:data:`kvtier.model.PRESETS`: ``tiny``, ``tiny-k3``, ...). Several engines may
    share the returned model (each has its own KV pages and state slots).

    Raises:
        ValueError: neither a directory nor a known preset, a bad ``dtype``, or a ``device``
            that does not exist here (see :func:`check_device`).
    """
    check_model(model)
    check_device("device", device)
    torch_dtype = _resolve_dtype(dtype, device)
    if Path(model).is_dir():
        model_id = weights_fingerprint(model) + (b":dequantized" if dequantize else b"")
        return load_model(model, torch_dtype, device, dequantize=dequantize), model_id
    build = _random_hybrid_model if str(model) in HYBRID_PRESETS else _random_model
    return build(str(model), seed, torch_dtype, device), f"preset:{model}:seed:{seed}".encode()


@dataclass
class BuiltEngine:
    """What :func:`build_engine` returns: the engine, the model's config and the directory of its
    Kimi tokenizer files (``None`` when neither ``tokenizer`` nor a model directory gives one)."""

    engine: Engine
    config: KimiK2Config | KimiLinearConfig
    tokenizer_dir: Path | None


def build_engine(model: str | Path, *, dtype: str = "auto", device: str = "cpu", seed: int = 0,
                 tokenizer: str | Path | None = None, dequantize: bool = False, **engine_args) -> BuiltEngine:
    """The engine over ``model`` (see :func:`load_for_serving`) with ``engine_args`` as
    :meth:`EngineConfig.of` takes them (checked before the model loads).

    Raises:
        ValueError: a bad engine argument (named), or what :func:`load_for_serving` raises.
    """
    config = EngineConfig.of(seed=seed, **engine_args)  # checked before the model loads
    net, model_id = load_for_serving(model, dtype=dtype, device=device, seed=seed, dequantize=dequantize)
    tokenizer_dir = Path(tokenizer) if tokenizer is not None else (Path(model) if Path(model).is_dir() else None)
    return BuiltEngine(Engine(net, config, model_id), net.config, tokenizer_dir)
