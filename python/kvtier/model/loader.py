"""Load Hugging Face-layout Kimi K2 / DeepSeek-V3 weights into :class:`KimiK2ForCausalLM`.

Reads ``config.json`` and safetensors shards (``model.safetensors.index.json`` or every
``*.safetensors`` file). Quantized weights stay quantized (:mod:`kvtier.model.formats`):

- FP8 e4m3 tensors with ``<name>_scale_inv`` block scales (``quantization_config`` ``quant_method:
  fp8``, ``weight_block_size`` 128x128 unless it says otherwise) are held as FP8 with their scales;
- compressed-tensors INT4 ``pack-quantized`` weights (``<module>.weight_packed`` int32,
  ``.weight_scale``, ``.weight_shape``) are held packed with their group scales.

Each weight class (attention, dense MLP, shared experts, routed experts) is held in the format
its stored tensors have; ``kv_b_proj`` and any quantized tensor outside those classes are
dequantized (the absorbed attention reads ``kv_b_proj`` per head). ``dequantize=True`` holds every
weight dense in the model dtype instead: ``w = fp8 * scale_inv[i // b0, j // b1]``,
``w = q * scale[i, j // group_size]`` (:mod:`kvtier.reference.quant`). Dense bf16/fp16/fp32 tensors
are cast to the model dtype.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch

from kvtier.model.config import KimiK2Config
from kvtier.model.formats import (
    DENSE,
    FP8,
    INT4,
    WEIGHT_CLASSES,
    QuantizationConfig,
    WeightFormats,
    cdiv,
    quantization_config_of,
    weight_class,
)
from kvtier.model.kimi_k2 import KimiK2ForCausalLM
from kvtier.model.kimi_linear_config import HYBRID_MODEL_TYPES
from kvtier.model.safetensors_source import SafetensorsSource, TensorSource
from kvtier.model.weights import TensorSpec, weight_specs
from kvtier.ops.quant import fp8_e4m3_dtype, fp8_e4m3fn_to_fnuz
from kvtier.reference import quant as ref_quant

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
_OTHER_TOWERS = ("vision_tower.", "mm_projector.")  # multimodal weights' vision encoder: not used for text
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def weights_fingerprint(model_dir: str | Path, sample_bytes: int = 1 << 20) -> bytes:
    """32-byte identity of a weights directory, cheap enough to compute at every start.

    SHA-256 over config.json and, per ``*.safetensors`` shard (sorted by name), its name, size
    and first and last ``sample_bytes`` bytes: two directories with different weights (a
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




def _model_type(model_dir: Path) -> str | None:
    try:
        return json.loads((model_dir / "config.json").read_text()).get("model_type")
    except (OSError, json.JSONDecodeError):
        return None  # read_config says why


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                         name: str = "weight") -> torch.Tensor:
    """fp8 [out, in] weight times its [ceil(out/b0), ceil(in/b1)] fp32 block scales -> fp32
    (:func:`kvtier.reference.quant.dequantize_fp8_block` after a shape check).

    Raises:
        ValueError: ``scale_inv`` has the wrong shape (message names ``name``).
    """
    rows, cols = weight.shape
    want = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"{name}_scale_inv must have shape {want} for weight {tuple(weight.shape)} and block "
                         f"{block}, got {tuple(scale_inv.shape)}")
    return ref_quant.dequantize_fp8_block(weight, scale_inv, tuple(block))


def _dtype(source: TensorSource, name: str) -> torch.dtype | None:
    return source.dtype(name) if hasattr(source, "dtype") else source.get(name).dtype


def _raw_name(source: TensorSource, name: str) -> str:
    return source.raw_name(name) if hasattr(source, "raw_name") else name


def _module(name: str) -> str:
    return name.removesuffix(".weight")


def _int4_names(name: str) -> tuple[str, str, str]:
    m = _module(name)
    return f"{m}.weight_packed", f"{m}.weight_scale", f"{m}.weight_shape"


def _is_linear(name: str, spec: TensorSpec) -> bool:
    """A linear layer's weight in the stored module tree (compressed-tensors' ``Linear``)."""
    return len(spec.shape) == 2 and (spec.quantizable or name == "lm_head.weight")


def stored_formats(config: KimiK2Config, source: TensorSource, quant: QuantizationConfig,
                       tensor_names: Mapping[str, str] | None = None) -> dict[str, str]:
    """The format (``dense`` | ``fp8`` | ``int4``) each stored weight is in, by spec name.

    INT4 = ``<module>.weight_packed`` present; FP8 = the weight's dtype is float8; else dense.
    Checked against ``quant``: an INT4 tensor the config does not target (or a targeted one that
    is not packed), FP8 beside compressed-tensors, packed weights without a config, and a
    config group the stored shapes or fields do not fit all fail here.

    Args:
        tensor_names: spec name -> stored name (tied ``lm_head``); default the spec name.

    Raises:
        ValueError: naming the tensor and the ``quantization_config`` field.
    """
    available = set(source.keys())
    out = {}
    for name, spec in weight_specs(config).items():
        src = (tensor_names or {}).get(name, name)
        packed, scale, shape = _int4_names(src)
        if packed in available:
            fmt = INT4
        elif src in available and _dtype(source, src) in FP8_DTYPES:
            fmt = FP8
        else:
            fmt = DENSE
        if quant.method == "compressed-tensors" and _is_linear(src, spec):
            stored_name = src if src in available else packed if packed in available else None
            module = _module(_raw_name(source, stored_name)) if stored_name else _module(src)
            module = module.removesuffix(".weight_packed")
            want = quant.format_of(module, spec.shape[1])
            if want == INT4 and fmt != INT4:
                raise ValueError(
                    f"the weights directory lacks tensor {packed!r}: quantization_config.config_groups targets "
                    f"{_module(src)!r} "
                    f"(and quantization_config.ignore does not list it), so it must be INT4-packed"
                    + (f", but the weights hold {src!r} unpacked" if src in available else ""))
            if want == DENSE and fmt == INT4:
                raise ValueError(f"tensor {packed!r} is INT4-packed but no quantization_config.config_groups entry "
                                 "targets it (or quantization_config.ignore lists it)")
        if fmt == INT4:
            if quant.method != "compressed-tensors":
                raise ValueError(f"tensor {packed!r} is INT4-packed but config.json has no compressed-tensors "
                                 f"quantization_config (quantization_config.quant_method is {quant.method!r})")
            for extra, what in ((scale, "INT4 group scales"), (shape, "the logical [out, in] shape")):
                if extra not in available:
                    raise ValueError(f"the weights directory lacks tensor {extra!r} ({what} of {packed!r}, required by "
                                     "quantization_config.format 'pack-quantized')")
        if fmt == FP8:
            if quant.method == "compressed-tensors":
                raise ValueError(f"tensor {src!r} is FP8 but quantization_config.quant_method is 'compressed-tensors' "
                                 "(its FP8 scheme is not supported; only INT4 pack-quantized groups)")
            if len(spec.shape) != 2:
                raise ValueError(f"FP8 tensor {src!r} must be a 2-D weight with block scales, got shape "
                                 f"{tuple(source.get(src).shape)}")
            if f"{src}_scale_inv" not in available:
                raise ValueError(f"FP8 tensor {src!r} has no {src + '_scale_inv'!r} (the block scales of "
                                 f"quantization_config.weight_block_size {list(quant.block_size)})")
        out[name] = fmt
    return out


def formats_of_checkpoint(config: KimiK2Config, formats: Mapping[str, str], quant: QuantizationConfig
                          ) -> WeightFormats:
    """The :class:`WeightFormats` that holds each weight class as its tensors are stored.

    A class whose shapes its stored format's fused layout cannot hold (FP8 gate/up halves not on
    a block row: :meth:`WeightFormats.problems`, only small test configs) is held dense, with a
    warning.

    Raises:
        ValueError: a class whose tensors are stored in more than one format, naming the first
            tensor that differs.
    """
    chosen: dict[str, tuple[str, str]] = {}
    for name, spec in weight_specs(config).items():
        cls = weight_class(spec.target)
        if cls is None:
            continue
        fmt = formats[name]
        first = chosen.setdefault(cls, (fmt, name))
        if first[0] != fmt:
            raise ValueError(f"tensor {name!r} is stored {fmt} but {first[1]!r} is stored {first[0]}: every {cls} "
                             "weight must have one format to be held quantized (load with dequantize=True)")
    kwargs = {cls: chosen[cls][0] for cls in WEIGHT_CLASSES if cls in chosen}
    group = quant.group_size() if quant.method == "compressed-tensors" else None
    formats = WeightFormats(**kwargs, block_size=quant.block_size, **({"group_size": group} if group else {}))
    for cls, reason in formats.problems(config).items():  # shapes the fused layouts cannot hold (small configs)
        warnings.warn(f"{reason}: {cls} is held dequantized", stacklevel=3)
        formats = dataclasses.replace(formats, **{cls: DENSE})
    return formats


def _check(t: torch.Tensor, name: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...] | None,
           what: str) -> torch.Tensor:
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"tensor {name!r} has dtype {t.dtype}, expected {what}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    return t


def _read_int4(source: TensorSource, src: str, spec: TensorSpec, group_size: int):
    packed_name, scale_name, shape_name = _int4_names(src)
    n, k = spec.shape
    logical = source.get(shape_name)
    if logical.dtype.is_floating_point or logical.numel() != 2 or tuple(int(v) for v in logical.reshape(-1)) != (n, k):
        raise ValueError(f"tensor {shape_name!r} must hold the integers {[n, k]} (out, in), got {logical.tolist()}")
    packed = _check(source.get(packed_name), packed_name, (n, k // 8), (torch.int32,), "torch.int32 (8 INT4 per word)")
    scale = source.get(scale_name)
    if not scale.is_floating_point():
        raise ValueError(f"tensor {scale_name!r} has dtype {scale.dtype}, expected a floating-point dtype")
    _check(scale, scale_name, (n, k // group_size), None, "")
    return packed, scale


def _read_fp8(source: TensorSource, src: str, spec: TensorSpec, block: tuple[int, int]):
    w = source.get(src)
    if w.dim() != 2:
        raise ValueError(f"FP8 tensor {src!r} must be a 2-D weight with block scales, got shape {tuple(w.shape)}")
    _check(w, src, spec.shape, None, "")
    scale_name = f"{src}_scale_inv"
    s = source.get(scale_name)
    if not s.is_floating_point():
        raise ValueError(f"tensor {scale_name!r} has dtype {s.dtype}, expected float32 block scales")
    want = (cdiv(spec.shape[0], block[0]), cdiv(spec.shape[1], block[1]))
    if tuple(s.shape) != want:
        raise ValueError(f"{src}_scale_inv must have shape {want} for weight {tuple(w.shape)} and block "
                         f"{tuple(block)} (quantization_config.weight_block_size), got {tuple(s.shape)}")
    return w, s


def _read_dense(source: TensorSource, src: str, spec: TensorSpec, fmt: str, quant: QuantizationConfig,
                group_size: int) -> torch.Tensor:
    """The tensor as floating point values, dequantized (fp32) when it is stored quantized."""
    if fmt == INT4:
        packed, scale = _read_int4(source, src, spec, group_size)
        return ref_quant.dequantize_int4_group(packed, scale, group_size=group_size)
    if fmt == FP8:
        w, s = _read_fp8(source, src, spec, quant.block_size)
        return ref_quant.dequantize_fp8_block(w, s, quant.block_size)
    t = source.get(src)
    if not (t.is_floating_point() or t.dtype in FP8_DTYPES):
        raise ValueError(f"tensor {src!r} has dtype {t.dtype}, expected a floating-point or FP8 dtype")
    return _check(t, src, spec.shape, None, "")


def _expected_names(src: str, fmt: str) -> tuple[str, ...]:
    if fmt == INT4:
        return _int4_names(src)
    return (src, f"{src}_scale_inv") if fmt == FP8 else (src,)


def _check_unexpected(config: KimiK2Config, available: set[str], expected: set[str], num_mtp_layers: int) -> None:
    for name in sorted(available - expected):
        m = _LAYER.match(name)
        if m and config.num_hidden_layers <= int(m.group(1)) < config.num_hidden_layers + num_mtp_layers:
            continue  # multi-token-prediction layers: not used for plain decoding
        if name.endswith("rotary_emb.inv_freq") or name.startswith(_OTHER_TOWERS):
            continue
        raise ValueError(f"the weights have an unexpected tensor {name!r} (not a DeepSeek-V3 parameter of this config)")


def _rows(dst: torch.Tensor, spec: TensorSpec, offset: int, rows: int) -> torch.Tensor:
    if spec.index:
        dst = dst[spec.index]
    if offset or dst.shape[0] != rows:
        dst = dst[offset : offset + rows]
    return dst


def load_weights(model: KimiK2ForCausalLM, source: TensorSource, block: tuple[int, int] = (128, 128),
                 num_mtp_layers: int = 0, quant: QuantizationConfig | None = None) -> None:
    """Fill every parameter of ``model`` from ``source`` (checked names, shapes and dtypes).

    Weights of a class ``model.formats`` holds quantized are copied as stored (FP8 weight and
    ``scale_inv``; INT4 ``weight_packed`` and ``weight_scale``); every other weight is read
    dequantized if stored quantized, and cast to its parameter's dtype.

    ``num_mtp_layers`` layers after the last decoder layer (multi-token prediction,
    ``num_nextn_predict_layers`` in config.json) are skipped; any other extra tensor is an error.

    Args:
        block: FP8 block size when ``quant`` is None (weights without quantization_config).
        quant: the weights' checked ``quantization_config``.

    Raises:
        ValueError: a missing, misshaped or unexpected tensor, or a format the model does not
            hold its class in, naming the tensor (and the quantization_config field).
    """
    config = model.config
    quant = quant or QuantizationConfig({"quant_method": "fp8", "weight_block_size": list(block)})
    specs = weight_specs(config)
    available = set(source.keys())
    names = {}
    if "lm_head.weight" not in available and config.tie_word_embeddings:
        names["lm_head.weight"] = "model.embed_tokens.weight"
    stored = stored_formats(config, source, quant, names)
    group_size = quant.group_size() or model.formats.group_size
    if model.formats.quantized and INT4 in stored.values() and group_size != model.formats.group_size:
        raise ValueError(f"quantization_config.config_groups group_size {group_size} differs from the model's "
                         f"WeightFormats.group_size {model.formats.group_size}")
    expected = {n for name, fmt in stored.items() for n in _expected_names(names.get(name, name), fmt)}
    _check_unexpected(config, available, expected, num_mtp_layers)
    for name, fmt in stored.items():
        if fmt == DENSE and names.get(name, name) not in available:
            raise ValueError(f"the weights directory lacks tensor {name!r} (expected shape {specs[name].shape})")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, spec in specs.items():
            src, fmt = names.get(name, name), stored[name]
            cls = weight_class(spec.target)
            held = model.formats.of(cls) if cls else DENSE
            n = spec.shape[0]
            if held == DENSE:
                t = _read_dense(source, src, spec, fmt, quant, group_size)
                _rows(params[spec.target], spec, spec.row_offset, n).copy_(t.to(params[spec.target].dtype))
            elif held != fmt:
                raise ValueError(f"tensor {src!r} is stored {fmt} but the model holds {cls} as {held}")
            elif fmt == FP8:
                w, s = _read_fp8(source, src, spec, model.formats.block_size)
                b0 = model.formats.block_size[0]
                _rows(params[spec.target], spec, spec.row_offset, n).copy_(w)
                _rows(params[f"{spec.target}_scale_inv"], spec, spec.row_offset // b0, cdiv(n, b0)).copy_(s.float())
            else:
                packed, scale = _read_int4(source, src, spec, group_size)
                _rows(params[f"{spec.target}_packed"], spec, spec.row_offset, n).copy_(packed)
                dst = _rows(params[f"{spec.target}_scale"], spec, spec.row_offset, n)
                dst.copy_(scale.to(dst.dtype))


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               dequantize: bool = False) -> KimiK2ForCausalLM:
    """Build and load a model from a HF-layout directory (config.json + safetensors).

    ``kimi_linear`` / ``kimi_k3`` weights give a hybrid
    :class:`kvtier.model.kimi_linear.KimiLinearForCausalLM`
    (:func:`kvtier.model.kimi_linear_loader.load_hybrid_model`: dense weights, MXFP4 routed experts).

    Args:
        model_dir: directory with ``config.json`` and ``*.safetensors`` (optionally an index).
        dtype: compute dtype and that of dense parameters (fp32, bf16 or fp16); the router stays fp32.
        device: where the parameters live.
        dequantize: hold every weight dense in ``dtype`` (FP8 and INT4 weights dequantized on
            load) instead of in its stored format.

    Raises:
        FileNotFoundError: no config.json or no safetensors.
        ValueError: unknown ``model_type``, invalid config, unsupported ``quantization_config``,
            missing/misshaped/unexpected tensor (naming the tensor and the field).
    """
    model_dir = Path(model_dir)
    if _model_type(model_dir) in HYBRID_MODEL_TYPES:
        from kvtier.model.kimi_linear_loader import load_hybrid_model

        return load_hybrid_model(model_dir, dtype, device, dequantize=dequantize)
    config, raw = read_config(model_dir)
    try:
        quant = quantization_config_of(raw)
    except ValueError as e:
        raise ValueError(f"{model_dir / 'config.json'}: {e}") from None
    if quant.method is None:
        quant = QuantizationConfig({"quant_method": "fp8"})  # FP8 tensors without a config: 128x128 blocks
    source = SafetensorsSource(model_dir)
    text = raw.get("text_config", raw) if raw.get("model_type") not in ("kimi_k2", "deepseek_v3") else raw
    names = ({"lm_head.weight": "model.embed_tokens.weight"}
             if "lm_head.weight" not in set(source.keys()) and config.tie_word_embeddings else {})
    formats = (WeightFormats() if dequantize
               else formats_of_checkpoint(config, stored_formats(config, source, quant, names), quant))
    model = KimiK2ForCausalLM(config, dtype, formats=formats)
    load_weights(model, source, quant.block_size, int(text.get("num_nextn_predict_layers") or 0), quant)
    model = model.to(device)
    if formats.quantized and torch.device(device).type == "cuda":
        from kvtier.ops._triton import arch_of

        convert_fp8_weights(model, fp8_e4m3_dtype(arch_of(torch.device(device))))
    return model


def convert_fp8_weights(model: KimiK2ForCausalLM, fp8_dtype: torch.dtype) -> int:
    """Hold ``model``'s FP8 weights in ``fp8_dtype`` (:func:`kvtier.ops.fp8_e4m3_dtype` of the
    device's arch: ``float8_e4m3fnuz`` on gfx942, whose matrix cores take no other), re-expressing
    each ``float8_e4m3fn`` weight and its ``_scale_inv`` without rounding
    (:func:`kvtier.ops.fp8_e4m3fn_to_fnuz`). Returns how many weights were converted.

    Raises:
        ValueError: ``fp8_dtype`` is not an e4m3 dtype.
    """
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_dtype must be one of {FP8_DTYPES}, got {fp8_dtype}")
    if fp8_dtype == torch.float8_e4m3fn:
        return 0
    params = dict(model.named_parameters())
    converted = 0
    with torch.no_grad():
        for name, p in params.items():
            if p.dtype == torch.float8_e4m3fn:
                scale = params[f"{name}_scale_inv"]
                w, s = fp8_e4m3fn_to_fnuz(p.data, scale.data)
                p.data = w
                scale.data.copy_(s)
                converted += 1
    return converted
