"""``kvtier plan``'s report for any model: the preset, checkpoint or config.json it names is read
(:func:`model_config`), then planned as a K2-class model (:mod:`kvtier.model.plan`) or as a hybrid
(:mod:`kvtier.model.hybrid_plan`)."""

from __future__ import annotations

import json
from pathlib import Path

from kvtier.model.config import PRESETS, KimiK2Config, preset
from kvtier.model.formats import PRESET_FORMATS
from kvtier.model.hybrid_plan import HYBRID_FORMATS, SESSION_LENGTHS, hybrid_plan_report
from kvtier.model.kimi_linear_config import HYBRID_MODEL_TYPES, KimiLinearConfig
from kvtier.model.plan import PARALLEL, format_plans, memory_plan


def model_config(model: str) -> tuple[KimiK2Config, str]:
    """``(config, name)`` of a preset name, a checkpoint directory or a ``config.json`` path; a hybrid
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
        raise ValueError(f"model must be a preset in {sorted(PRESETS)}, a checkpoint directory or a config.json "
                         f"file, got {model!r}")
    try:
        raw = json.loads(file.read_text())
        if raw.get("model_type") in HYBRID_MODEL_TYPES:
            return KimiLinearConfig.from_hf_dict(raw), str(path)
        return KimiK2Config.from_hf_dict(raw), str(path)
    except (ValueError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: {e}") from None


def plan_report(model: str, formats: tuple[str, ...] | None = None, devices: int = 8, hbm_gb: float = 288,
                *, parallel: str | None = None, state_dtype: str = "fp32", session_tokens: int | None = None,
                **kwargs) -> str:
    """``kvtier plan``'s output. K2-class models: :func:`format_plans` of :func:`memory_plan` for each of
    ``formats`` (default int4, fp8, bf16; :data:`kvtier.model.formats.PRESET_FORMATS`), ``parallel``
    default dp-ep, sessions of ``session_tokens`` (default 100,000). Hybrid models (Kimi K3):
    :func:`hybrid_plan_report` (formats default mxfp4, bf16; both layouts unless ``parallel``;
    ``state_dtype``; sessions of 128K, 400K and 1M tokens, or ``session_tokens``). ``kwargs``
    (kv_dtype_bytes, hbm_fraction, reserve_gb, dense_dtype_bytes) go to the plan function.

    Raises:
        ValueError: an unknown model or format, or an argument out of range.
    """
    config, name = model_config(model)
    if isinstance(config, KimiLinearConfig):
        formats = formats or tuple(HYBRID_FORMATS)
        for f in formats:
            if f not in HYBRID_FORMATS:
                raise ValueError(f"format must be one of {sorted(HYBRID_FORMATS)} for hybrid model {name}, got {f!r}")
        lengths = (session_tokens,) if session_tokens else SESSION_LENGTHS
        return hybrid_plan_report(config, name, formats, devices, hbm_gb, (parallel,) if parallel else PARALLEL,
                                  state_dtype=state_dtype, session_lengths=lengths, **kwargs)
    formats = formats or ("int4", "fp8", "bf16")
    for f in formats:
        if f not in PRESET_FORMATS:
            raise ValueError(f"format must be one of {sorted(PRESET_FORMATS)}, got {f!r}")
    return format_plans([memory_plan(config, f, devices, hbm_gb, parallel=parallel or "dp-ep",
                                     session_tokens=session_tokens or 100_000, **kwargs) for f in formats], name)
