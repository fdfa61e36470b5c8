"""``kvtier plan``'s report for any model: the preset, weights directory or config.json it names is read
(:func:`model_config`), then planned as a K2-class model (:mod:`kvtier.model.plan`) or as a hybrid
(:mod:`kvtier.model.hybrid_plan`)."""

from __future__ import annotations

import json
from pathlib import Path

from kvtier.model.config import PRESETS, KimiK2Config, did_you_mean, preset
from kvtier.model.formats import PRESET_FORMATS
from kvtier.model.hybrid_plan import HYBRID_FORMATS, SESSION_LENGTHS, SHIPPED_FORMATS, hybrid_plan_report
from kvtier.model.kimi_linear_config import HYBRID_MODEL_TYPES, KimiLinearConfig
from kvtier.model.plan import PARALLEL, format_plans, memory_plan


def model_config(model: str) -> tuple[KimiK2Config, str]:
    """``(config, name)`` of a preset name, a weights directory or a ``config.json`` path; a hybrid
    preset or ``kimi_linear`` / ``kimi_k3`` config gives a
    :class:`kvtier.model.kimi_linear_config.KimiLinearConfig`.

    Raises:
        ValueError: none of these (or an invalid config.json, naming it).
    """
    if model in PRESETS:
        return preset(model), model
    path = Path(model)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"model must be a preset in {sorted(PRESETS)}, a weights directory or a config.json "
                         f"file, got {model!r}{did_you_mean(model)}")
    try:
        raw = json.loads(file.read_text())
        if raw.get("model_type") in HYBRID_MODEL_TYPES:
            return KimiLinearConfig.from_hf_dict(raw), str(path)
        return KimiK2Config.from_hf_dict(raw), str(path)
    except (ValueError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: {e}") from None


def plan_report(model: str, formats: tuple[str, ...] | None = None, devices: int = 8, hbm_gb: float = 288,
                *, parallel: str | None = None, state_dtype: str = "fp32", session_tokens: int | None = None,
                state_device_bytes: float | None = None, **kwargs) -> str:
    """``kvtier plan``'s output. K2-class models: :func:`format_plans` of :func:`memory_plan` for each of
    ``formats`` (default int4, fp8, bf16; :data:`kvtier.model.formats.PRESET_FORMATS`), ``parallel``
    default dp-ep, sessions of ``session_tokens`` (default 100,000, or the model's context when
    shorter). Hybrid models (Kimi K3): :func:`hybrid_plan_report` (formats default the release's
    first, then the other of mxfp4 and bf16; both layouts unless ``parallel``; ``state_dtype``;
    ``state_device_bytes``, the device checkpoint budget ``kvtier serve`` reserves, None = its
    default; sessions of 128K, 400K and 1M tokens up to the model's context, or
    ``session_tokens``). ``kwargs`` (kv_dtype_bytes, hbm_fraction, reserve_gb, dense_dtype_bytes)
    go to the plan function.

    Raises:
        ValueError: an unknown model or format, ``session_tokens`` past the model's context
            (``max_position_embeddings``), ``state_device_bytes`` for a model without recurrent
            state, or an argument out of range.
    """
    config, name = model_config(model)
    context = config.max_position_embeddings
    if session_tokens is not None and session_tokens > context:
        raise ValueError(f"--session-tokens {session_tokens:,} is past the context of {name} "
                         f"({context:,} tokens, max_position_embeddings); give at most {context:,}")
    if isinstance(config, KimiLinearConfig):
        shipped = SHIPPED_FORMATS.get(config.model_type, ("", "mxfp4"))[1]
        formats = formats or tuple(sorted(HYBRID_FORMATS, key=lambda f: f != shipped))
        for f in formats:
            if f not in HYBRID_FORMATS:
                raise ValueError(f"format must be one of {sorted(HYBRID_FORMATS)} for hybrid model {name}, got {f!r}")
        lengths = (session_tokens,) if session_tokens else tuple(n for n in SESSION_LENGTHS if n <= context) or (
            context,)
        return hybrid_plan_report(config, name, formats, devices, hbm_gb, (parallel,) if parallel else PARALLEL,
                                  state_dtype=state_dtype, session_lengths=lengths,
                                  state_device_bytes=state_device_bytes, **kwargs)
    if state_device_bytes is not None:
        raise ValueError(f"--state-device-bytes is for hybrid models (recurrent-state checkpoints); {name} has none")
    session_tokens = session_tokens or min(100_000, context)
    formats = formats or ("int4", "fp8", "bf16")
    for f in formats:
        if f not in PRESET_FORMATS:
            raise ValueError(f"format must be one of {sorted(PRESET_FORMATS)}, got {f!r}")
    return format_plans([memory_plan(config, f, devices, hbm_gb, parallel=parallel or "dp-ep",
                                     session_tokens=session_tokens, **kwargs) for f in formats], name)
