"""Memory plan of a hybrid KDA + MLA model (Kimi K3, Kimi-Linear) on ``devices`` accelerators:
weight bytes per device in a weight format, MLA KV bytes per token plus one KDA recurrent state
(and conv window) per sequence, and how many sessions of 128K / 400K / 1M tokens fit. The
layouts, the usable-HBM rule and the byte counts of dense weights are :mod:`kvtier.model.plan`'s;
docs/k3.md has the K3 table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvtier.model.plan import GB, PARALLEL, ROUTER_BYTES
from kvtier.model.weights import TensorSpec

HYBRID_PARTS = ("embed_tokens", "kda_attention", "mla_attention", "dense_mlp", "shared_experts", "latent_proj",
                "routed_experts", "router", "norms", "lm_head")
HYBRID_FORMATS = {"mxfp4": "routed experts MXFP4: E2M1 + E8M0 per 32, rest bf16", "bf16": "bf16, nothing quantized"}
# The weights each hybrid model_type is released in, and the name the report gives it: K3 ships MXFP4
# routed experts (docs/k3.md), Kimi-Linear-48B-A3B bf16 weights.
SHIPPED_FORMATS = {"kimi_k3": ("K3", "mxfp4"), "kimi_linear": ("Kimi-Linear", "bf16")}
HYBRID_REPLICATED = {"dp-ep": ("kda_attention", "mla_attention", "router", "norms"), "tp": ()}
STATE_DTYPE_BYTES = {"fp32": 4, "bf16": 2}
SESSION_LENGTHS = (131_072, 409_600, 1_048_576)  # 128K, 400K, 1M tokens (K = 1024)
_FP32_HYBRID = ("gate.weight", "e_score_correction_bias", "dt_bias", "A_log")  # held fp32 by the model


def _hybrid_part(name: str, spec: TensorSpec, kda: bool) -> str:
    from kvtier.model.kimi_linear_loader import _is_routed_expert

    if _is_routed_expert(spec):
        return "routed_experts"
    if name.endswith(("block_sparse_moe.gate.weight", "e_score_correction_bias")):
        return "router"
    if ".shared_experts." in name:
        return "shared_experts"
    if "routed_expert_down_proj" in name or "routed_expert_up_proj" in name:
        return "latent_proj"
    if name.startswith("model.embed_tokens"):
        return "embed_tokens"
    if name.startswith("lm_head"):
        return "lm_head"
    if ".self_attn." in name and not name.endswith(("layernorm.weight", "o_norm.weight")):
        return "kda_attention" if kda else "mla_attention"
    if ".mlp." in name and len(spec.shape) == 2:
        return "dense_mlp"
    return "norms"


def hybrid_parameter_bytes(config, format: str = "mxfp4", dense_dtype_bytes: float = 2
                           ) -> dict[str, tuple[int, int]]:
    """``{part: (parameters, bytes)}`` of a hybrid model (all layers, all devices) in ``format``
    (:data:`HYBRID_FORMATS`): routed experts MXFP4 (``N*K/2 + N*K/32`` bytes per ``[N, K]`` weight:
    :func:`kvtier.reference.mxfp4.mxfp4_bytes`) or dense; the router, ``dt_bias`` and ``A_log`` fp32;
    every other tensor dense at ``dense_dtype_bytes``. One layer of each kind (KDA or MLA, dense MLP
    or MoE) is enumerated and counted once per such layer. Parts: :data:`HYBRID_PARTS`.

    Raises:
        ValueError: an unknown ``format``.
    """
    from kvtier.model.kimi_linear_loader import _layer_specs
    from kvtier.reference.mxfp4 import mxfp4_bytes

    if format not in HYBRID_FORMATS:
        raise ValueError(f"format must be one of {sorted(HYBRID_FORMATS)} for a hybrid model, got {format!r}")
    c = config
    kinds: dict[tuple[bool, bool], list[int]] = {}
    for i in range(c.num_hidden_layers):
        kinds.setdefault((c.is_kda_layer(i), c.is_moe_layer(i)), []).append(i)
    items = [("model.embed_tokens.weight", TensorSpec((c.vocab_size, c.hidden_size), "embed_tokens"), False, 1),
             ("lm_head.weight", TensorSpec((c.vocab_size, c.hidden_size), "lm_head"), False, 1),
             ("model.norm.weight", TensorSpec((c.hidden_size,), "norm"), False, 1)]
    if c.attn_res_block_size is not None:
        items.append(("model.output_attn_res_norm.weight", TensorSpec((2 * c.hidden_size,), "norms"), False, 1))
    for (kda, _), layers in kinds.items():
        items += [(n, s, kda, len(layers)) for n, s in _layer_specs(c, layers[0]).items()]
    out = {p: [0, 0] for p in HYBRID_PARTS}
    for name, spec, kda, count in items:
        part = _hybrid_part(name, spec, kda)
        n = math.prod(spec.shape)
        if part == "routed_experts" and format == "mxfp4":
            nbytes = mxfp4_bytes(*spec.shape)
        elif name.endswith(_FP32_HYBRID):
            nbytes = n * ROUTER_BYTES
        else:
            nbytes = int(n * dense_dtype_bytes)
        out[part][0] += n * count
        out[part][1] += nbytes * count
    return {p: (int(a), int(b)) for p, (a, b) in out.items()}


@dataclass(frozen=True)
class HybridMemoryPlan:
    """One (hybrid model, format, devices, layout) memory plan. Bytes are per device unless named
    ``total``; sessions are of the whole group of devices.

    Attributes:
        format, devices, hbm_bytes, parallel, hbm_fraction, reserve_bytes: the inputs.
        parts: ``{part: (parameters, bytes)}`` of the whole model.
        total_weight_bytes, weight_bytes_per_device, usable_bytes_per_device: as :class:`MemoryPlan`.
        free_bytes_per_device: usable HBM the weights leave for MLA KV and KDA states (negative: no fit).
        kv_bytes_per_token: MLA latent bytes per token over the MLA layers (27,648 for K3 in bf16).
        state_dtype: ``fp32`` | ``bf16`` (the KDA recurrent state; conv windows in the activation dtype).
        recurrent_bytes_per_sequence, conv_bytes_per_sequence: a sequence's KDA state over all KDA layers.
        session_lengths: tokens per session for :attr:`sessions`.
        sessions: ``{length: sessions that fit}``: per device ``room // (length * kv_per_token *
            kv_share + state)`` with dp-ep (times ``devices``: each caches its own sequences); with tp every
            device holds every sequence's KV (one latent head) and ``1 / devices`` of its state (KDA heads
            split). ``room`` and ``kv_share`` follow :attr:`state_device_bytes`.
        state_device_bytes: the device's recurrent-state checkpoint budget, as ``kvtier serve
            --state-device-bytes`` reserves it: None = serve's default, as many bytes as the device KV
            pages (``room = free``, ``kv_share = 2``: each session's KV counted once more for the
            checkpoints beside it); a number of bytes per device (``room = free - state_device_bytes``,
            ``kv_share = 1``; 0 = no device checkpoints).
    """

    format: str
    devices: int
    hbm_bytes: float
    parallel: str
    hbm_fraction: float
    reserve_bytes: float
    parts: dict[str, tuple[int, int]] = field(repr=False)
    total_weight_bytes: int
    weight_bytes_per_device: float
    usable_bytes_per_device: float
    free_bytes_per_device: float
    kv_bytes_per_token: int
    state_dtype: str
    recurrent_bytes_per_sequence: int
    conv_bytes_per_sequence: int
    session_lengths: tuple[int, ...]
    sessions: dict[int, int]
    state_device_bytes: float | None = None

    @property
    def fits(self) -> bool:
        return self.free_bytes_per_device > 0

    @property
    def state_bytes_per_sequence(self) -> int:
        return self.recurrent_bytes_per_sequence + self.conv_bytes_per_sequence

    @property
    def total_parameters(self) -> int:
        return sum(p for p, _ in self.parts.values())

    @property
    def checkpoint_bytes_per_device(self) -> float:
        """Bytes of one state checkpoint (one sequence's state) on a device: all of it with dp-ep,
        ``1 / devices`` of it with tp."""
        return self.state_bytes_per_sequence / (self.devices if self.parallel == "tp" else 1)

    def session_bytes_per_device(self, length: int) -> float:
        """Bytes one session of ``length`` tokens takes on a device that holds it: KV, its state slot
        and, with serve's default checkpoint budget (:attr:`state_device_bytes` None), as many bytes
        of device checkpoints as of KV."""
        kv_share = 2 if self.state_device_bytes is None else 1
        return length * self.kv_bytes_per_token * kv_share + self.checkpoint_bytes_per_device

    def device_checkpoints(self, length: int | None = None) -> int:
        """State checkpoints the device checkpoint budget holds per device; with serve's default
        budget (as many bytes as the KV) that depends on the session ``length`` filling the device.

        Raises:
            ValueError: ``length`` None, or not one of :attr:`session_lengths`, with the default budget.
        """
        if self.state_device_bytes is None:
            if length not in self.sessions:
                raise ValueError(f"length must be one of {self.session_lengths} with the default checkpoint "
                                 f"budget, got {length!r}")
            per_device = self.sessions[length] // (self.devices if self.parallel == "dp-ep" else 1)
            budget = per_device * length * self.kv_bytes_per_token
        else:
            budget = self.state_device_bytes
        return int(budget // self.checkpoint_bytes_per_device)


def hybrid_memory_plan(config, format: str = "mxfp4", devices: int = 8, hbm_gb: float = 288, *,
                       parallel: str = "dp-ep", kv_dtype_bytes: int = 2, state_dtype: str = "fp32",
                       conv_dtype_bytes: int = 2, dense_dtype_bytes: float = 2, hbm_fraction: float = 0.9,
                       reserve_gb: float = 8, session_lengths: tuple[int, ...] = SESSION_LENGTHS,
                       state_device_bytes: float | None = None) -> HybridMemoryPlan:
    """The memory plan of a hybrid (KDA + MLA) model such as Kimi K3 on ``devices`` x ``hbm_gb``: the
    numbers ``kvtier plan --model kimi-k3`` prints and the simulator's K3 scenario sizes its pools with.

    Weights per device as :func:`memory_plan` (``dp-ep``: attention, router and norms replicated;
    ``tp``: all split); usable HBM ``hbm_gb * hbm_fraction - reserve_gb``; what the weights leave
    holds MLA KV (``config.kv_cache_bytes_per_token(kv_dtype_bytes)``) and one KDA state per sequence
    (``[heads, head_dim, head_dim]`` in ``state_dtype`` plus the ``[conv_dim, W - 1]`` conv window at
    ``conv_dtype_bytes``, per KDA layer), and the device's state checkpoints as ``kvtier serve``
    reserves them (``state_device_bytes``). :class:`HybridMemoryPlan` says how sessions are counted.

    Args:
        config: a :class:`kvtier.model.kimi_linear_config.KimiLinearConfig`.
        format: ``mxfp4`` | ``bf16`` (:data:`HYBRID_FORMATS`).
        devices, hbm_gb, parallel, hbm_fraction, reserve_gb, dense_dtype_bytes: as :func:`memory_plan`.
        kv_dtype_bytes: bytes per cached MLA value (2 = bf16, 1 = FP8).
        state_dtype: ``fp32`` (the KDA kernels' default) or ``bf16``.
        conv_dtype_bytes: bytes per conv-window value (the activation dtype, 2 = bf16).
        session_lengths: session lengths in tokens (default 128K, 400K, 1M).
        state_device_bytes: checkpoint budget per device (``kvtier serve --state-device-bytes``);
            None = serve's default, as many bytes as the device KV pages; 0 = none.

    Raises:
        ValueError: an argument out of range or an unknown format / layout / state dtype, naming it.
    """
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ValueError(f"devices must be a positive int, got {devices!r}")
    if parallel not in PARALLEL:
        raise ValueError(f"parallel must be one of {PARALLEL}, got {parallel!r}")
    if state_dtype not in STATE_DTYPE_BYTES:
        raise ValueError(f"state_dtype must be one of {sorted(STATE_DTYPE_BYTES)}, got {state_dtype!r}")
    for name, value in (("hbm_gb", hbm_gb), ("kv_dtype_bytes", kv_dtype_bytes), ("conv_dtype_bytes", conv_dtype_bytes),
                        ("dense_dtype_bytes", dense_dtype_bytes)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    if not 0 < hbm_fraction <= 1:
        raise ValueError(f"hbm_fraction must be in (0, 1], got {hbm_fraction!r}")
    if not reserve_gb >= 0:
        raise ValueError(f"reserve_gb must be >= 0, got {reserve_gb!r}")
    if not session_lengths or not all(isinstance(n, int) and n > 0 for n in session_lengths):
        raise ValueError(f"session_lengths must be positive ints, got {session_lengths!r}")
    if state_device_bytes is not None and not state_device_bytes >= 0:
        raise ValueError(f"state_device_bytes (--state-device-bytes) must be >= 0 bytes per device (None = as many "
                         f"as the device KV), got {state_device_bytes!r}")
    parts = hybrid_parameter_bytes(config, format, dense_dtype_bytes)
    total = sum(b for _, b in parts.values())
    per_device = sum(b if part in HYBRID_REPLICATED[parallel] else b / devices for part, (_, b) in parts.items())
    usable = hbm_gb * GB * hbm_fraction - reserve_gb * GB
    free = usable - per_device
    recurrent = config.recurrent_bytes_per_sequence(STATE_DTYPE_BYTES[state_dtype])
    conv = config.conv_bytes_per_sequence(conv_dtype_bytes)
    plan = HybridMemoryPlan(format, devices, hbm_gb * GB, parallel, hbm_fraction, reserve_gb * GB, parts, total,
                            per_device, usable, free, config.kv_cache_bytes_per_token(kv_dtype_bytes), state_dtype,
                            recurrent, conv, tuple(session_lengths), {}, state_device_bytes)
    scale = devices if parallel == "dp-ep" else 1
    room = free - (state_device_bytes or 0)
    for length in session_lengths:
        plan.sessions[length] = int(room // plan.session_bytes_per_device(length)) * scale if room > 0 else 0
    return plan


def _tokens(n: int) -> str:
    return f"{n // 1_048_576}M" if n % 1_048_576 == 0 else f"{n // 1024}K" if n % 1024 == 0 else f"{n:,}"


def format_label(config, format: str) -> str:
    """What ``format`` means for the hybrid model ``config``: ``"K3 as shipped (...)"`` for the
    format its release has (:data:`SHIPPED_FORMATS`), else the format and ``not as shipped``."""
    title, shipped = SHIPPED_FORMATS.get(config.model_type, (config.model_type, None))
    if format == shipped:
        return f"{title} as shipped ({HYBRID_FORMATS[format]})"
    return f"{HYBRID_FORMATS[format]} (not as {title} ships)"


def _checkpoint_line(p0: HybridMemoryPlan) -> str:
    if p0.state_device_bytes is None:
        return ("device state checkpoints: as many bytes as the device KV (kvtier serve's default "
                "--state-device-bytes), so each session counts its KV twice")
    if not p0.state_device_bytes:
        return "device state checkpoints: none (--state-device-bytes 0)"
    return (f"device state checkpoints: {p0.state_device_bytes / GB:,.1f} GB per device "
            f"(--state-device-bytes {p0.state_device_bytes:,.0f}), {p0.device_checkpoints():,} checkpoints "
            f"of {p0.checkpoint_bytes_per_device / 2**20:,.1f} MiB ({p0.parallel}), taken from the free memory "
            "before sessions")


def format_hybrid_plans(plans: list[HybridMemoryPlan], model_name: str = "", config=None) -> str:
    """A plain-text report of hybrid ``plans`` (one model and device group; formats x layouts);
    ``config`` (the model's) labels each format as shipped or not (:func:`format_label`)."""
    p0 = plans[0]
    mib = 2 ** 20
    lines = [
        f"model {model_name}: {p0.total_parameters / 1e9:,.1f}B parameters; {p0.devices} devices x "
        f"{p0.hbm_bytes / GB:g} GB HBM; usable per device {p0.hbm_bytes / GB:g} GB x {p0.hbm_fraction:g} - "
        f"{p0.reserve_bytes / GB:g} GB reserve = {p0.usable_bytes_per_device / GB:,.1f} GB",
        f"MLA KV per token: {p0.kv_bytes_per_token:,} bytes",
        f"KDA state per sequence ({p0.state_dtype}): {p0.state_bytes_per_sequence:,} bytes "
        f"({p0.state_bytes_per_sequence / mib:,.1f} MiB = recurrent {p0.recurrent_bytes_per_sequence / mib:,.1f} MiB "
        f"+ conv {p0.conv_bytes_per_sequence / mib:,.1f} MiB), "
        f"as much as {p0.state_bytes_per_sequence / p0.kv_bytes_per_token:,.0f} tokens of MLA KV",
        _checkpoint_line(p0),
        "",
        f"{'format':<8}{'layout':<7}{'weights total GB':>18}{'per device GB':>15}{'free per device GB':>20}"
        + "".join(f"{'sessions ' + _tokens(n):>{max(16, len(_tokens(n)) + 10)}}" for n in p0.session_lengths),
    ]
    for p in plans:
        free = f"{p.free_bytes_per_device / GB:,.1f}" if p.fits else "does not fit"
        lines.append(f"{p.format:<8}{p.parallel:<7}{p.total_weight_bytes / GB:>18,.1f}"
                     f"{p.weight_bytes_per_device / GB:>15,.1f}{free:>20}"
                     + "".join(f"{p.sessions[n]:>{max(16, len(_tokens(n)) + 10)},}" for n in p.session_lengths))
    lines += ["", "weights per device by part (GB):",
              f"{'part':<16}" + "".join(f"{p.format + ' ' + p.parallel:>14}" for p in plans)]
    for part in HYBRID_PARTS:
        row = [p.parts[part][1] / (1 if part in HYBRID_REPLICATED[p.parallel] else p.devices) / GB for p in plans]
        lines.append(f"{part:<16}" + "".join(f"{x:>14,.2f}" for x in row))
    lines.append("")
    lines.extend(f"{f}: {format_label(config, f) if config is not None else HYBRID_FORMATS[f]}"
                 for f in dict.fromkeys(p.format for p in plans))
    lines.append("dp-ep: attention, router and norms on every device, each device caches its own sessions; "
                 "tp: all split, every device holds every session's KV and 1/devices of its KDA state")
    return "\n".join(lines)


def hybrid_plan_report(config, model_name: str, formats: tuple[str, ...] = ("mxfp4", "bf16"), devices: int = 8,
                       hbm_gb: float = 288, parallel: tuple[str, ...] = PARALLEL, **kwargs) -> str:
    """``kvtier plan``'s output for a hybrid model: :func:`format_hybrid_plans` over ``formats`` x
    ``parallel`` layouts; ``kwargs`` go to :func:`hybrid_memory_plan`.

    Raises:
        ValueError: as :func:`hybrid_memory_plan`.
    """
    plans = [hybrid_memory_plan(config, f, devices, hbm_gb, parallel=lay, **kwargs)
             for f in formats for lay in parallel]
    return format_hybrid_plans(plans, model_name, config)
