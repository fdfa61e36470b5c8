"""Memory plan of a K2-class model on ``devices`` accelerators: weight bytes per device in a
weight format, KV bytes per token, and how many tokens (and 100K-token sessions) of KV fit; and of
a hybrid KDA + MLA model (Kimi K3, :func:`kvtier.model.hybrid_plan.hybrid_memory_plan`): MLA KV per token plus one KDA
state per sequence, sessions of 128K / 400K / 1M tokens.

Every number is derived from the config's shapes through the weight tensor table
(:func:`kvtier.model.weights.weight_specs`) and the formats' byte counts
(:func:`kvtier.model.formats.weight_bytes`), as :class:`kvtier.model.KimiK2ForCausalLM` holds the
weights:

- a weight ``[N, K]`` takes ``N*K*d`` bytes dense (``d`` = ``dense_dtype_bytes``, 2 for bf16),
  ``N*K + 4*ceil(N/128)*ceil(K/128)`` in FP8 128x128 blocks (fp32 scales), ``N*K/2 + 2*N*K/32``
  in INT4 group-32 (bf16 scales);
- ``kv_b_proj``, norms, embeddings and ``lm_head`` are always dense; the router (``mlp.gate``
  and its ``e_score_correction_bias``) is fp32;
- KV bytes per token: the MLA latent row, ``(kv_lora_rank + qk_rope_head_dim) * num_hidden_layers
  * kv_dtype_bytes`` (576 x 61 x 2 = 70,272 bytes for K2 in bf16).

Per device (``hbm_bytes``, decimal GB as vendors quote HBM): usable HBM is ``hbm_bytes *
hbm_fraction - reserve_bytes``; ``hbm_fraction`` stands for the static memory fraction serving
engines take (vLLM's ``gpu_memory_utilization`` default 0.9) and ``reserve_bytes`` is the explicit
allowance for activations, workspace and graphs (default 8 GB per device: a 16K-token prefill
step of K2 holds ~2 GB of MoE activations, plus communication buffers and captured graphs). KV
gets what the weights leave of the usable HBM. Two layouts (``parallel``):

- ``dp-ep``: attention (with the latent norms and ``kv_b_proj``), the router and the norms
  replicated on each device (data-parallel attention), everything else split over the devices
  (experts expert-parallel, dense MLP and shared experts tensor-parallel, vocabulary-parallel
  embeddings and ``lm_head``); each device caches its own sequences, so the KV capacity is the
  sum over devices (SGLang's ``--enable-dp-attention`` deployment of DeepSeek-V3);
- ``tp``: every weight split evenly over the devices (tensor + expert parallel; the few
  replicated tensors, e.g. ``kv_a_proj_with_mqa``, under 2 GB per device for K2, are ignored);
  MLA has one latent KV head, so every device caches every sequence and the capacity is one
  device's (the simulator's :class:`kvtier.sim.hardware.Node`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvtier.model.config import KimiK2Config
from kvtier.model.formats import DENSE, PRESET_FORMATS, WeightFormats, weight_bytes, weight_class
from kvtier.model.weights import TensorSpec, _layer_specs

GB = 1e9
PARALLEL = ("dp-ep", "tp")
PARTS = ("embed_tokens", "attention", "dense_mlp", "shared_experts", "routed_experts", "router", "norms", "lm_head")
FORMAT_LABELS = {"int4": "K2.6 INT4 (routed experts INT4 g32, rest bf16)",
                 "fp8": "K2 FP8 (linear layers FP8 128x128, rest bf16)",
                 "bf16": "bf16 (nothing quantized)"}
REPLICATED = {"dp-ep": ("attention", "router", "norms"), "tp": ()}  # parts every device holds whole
ROUTER_BYTES = 4  # the model holds the router (gate weight, e_score_correction_bias) in fp32


def _part(name: str, spec: TensorSpec) -> str:
    cls = weight_class(spec.target)
    if cls is not None:
        return cls
    if name.endswith(("mlp.gate.weight", "e_score_correction_bias")):
        return "router"
    if ".self_attn." in name:
        return "attention"  # kv_b_proj and the latent norms
    if name.startswith("model.embed_tokens"):
        return "embed_tokens"
    if name.startswith("lm_head"):
        return "lm_head"
    return "norms"


def _count_specs(config: KimiK2Config):
    """(name, spec, multiplicity) covering every tensor: one dense and one MoE layer's tensors,
    counted once per such layer (all layers of a kind have the same shapes)."""
    c = config
    h, v = c.hidden_size, c.vocab_size
    yield "model.embed_tokens.weight", TensorSpec((v, h), "embed_tokens", quantizable=False), 1
    yield "model.norm.weight", TensorSpec((h,), "norm", quantizable=False), 1
    yield "lm_head.weight", TensorSpec((v, h), "lm_head", quantizable=False), 1
    kinds = [(0, c.first_k_dense_replace), (c.first_k_dense_replace, c.num_hidden_layers - c.first_k_dense_replace)]
    for layer, count in kinds:
        if count:
            for name, spec in _layer_specs(c, layer).items():
                yield name, spec, count


def parameter_bytes(config: KimiK2Config, formats: WeightFormats | str = "bf16",
                    dense_dtype_bytes: float = 2) -> dict[str, tuple[int, int]]:
    """``{part: (parameters, bytes)}`` of the whole model (all layers, all devices) held in
    ``formats`` (a :class:`WeightFormats` or a :data:`kvtier.model.formats.PRESET_FORMATS` name),
    dense tensors at ``dense_dtype_bytes`` (2 = bf16). Parts: :data:`PARTS`; scales are counted in
    their weight's part. MTP layers are not counted (they are not loaded)."""
    fm = PRESET_FORMATS[formats] if isinstance(formats, str) else formats
    out = {p: [0, 0] for p in PARTS}
    for name, spec, count in _count_specs(config):
        part = _part(name, spec)
        cls = weight_class(spec.target)
        n = math.prod(spec.shape)
        if part == "router":
            nbytes = n * ROUTER_BYTES
        elif len(spec.shape) == 2:
            nbytes = weight_bytes(spec.shape, fm.of(cls) if cls else DENSE, fm, dense_dtype_bytes)
        else:
            nbytes = int(n * dense_dtype_bytes)
        out[part][0] += n * count
        out[part][1] += nbytes * count
    return {p: (int(a), int(b)) for p, (a, b) in out.items()}


@dataclass(frozen=True)
class MemoryPlan:
    """One (model, format, devices) memory plan (module docstring). Bytes are per device unless
    named ``total``; tokens and sessions are of the whole group of devices.

    Attributes:
        format: weight format name (``int4`` | ``fp8`` | ``bf16``) or ``custom``.
        devices, hbm_bytes, parallel, kv_dtype_bytes, session_tokens: the inputs.
        parts: ``{part: (parameters, bytes)}`` of the whole model.
        total_weight_bytes: all weights, all devices.
        weight_bytes_per_device: weights one device holds under ``parallel``.
        usable_bytes_per_device: ``hbm_bytes * hbm_fraction - reserve_bytes``.
        kv_bytes_per_device: usable HBM the weights leave (negative: they do not fit).
        kv_bytes_per_token: MLA latent bytes per token, all layers.
        kv_tokens: tokens of KV the group holds (0 when the weights do not fit).
        sessions: ``kv_tokens // session_tokens``.
    """

    format: str
    devices: int
    hbm_bytes: float
    parallel: str
    kv_dtype_bytes: float
    session_tokens: int
    hbm_fraction: float
    reserve_bytes: float
    parts: dict[str, tuple[int, int]] = field(repr=False)
    total_weight_bytes: int
    weight_bytes_per_device: float
    usable_bytes_per_device: float
    kv_bytes_per_device: float
    kv_bytes_per_token: float
    kv_tokens: int
    sessions: int

    @property
    def fits(self) -> bool:
        return self.kv_bytes_per_device > 0

    @property
    def total_parameters(self) -> int:
        return sum(p for p, _ in self.parts.values())


def memory_plan(config: KimiK2Config, formats: WeightFormats | str = "int4", devices: int = 8, hbm_gb: float = 288,
                *, parallel: str = "dp-ep", kv_dtype_bytes: float = 2, dense_dtype_bytes: float = 2,
                hbm_fraction: float = 0.9, reserve_gb: float = 8, session_tokens: int = 100_000) -> MemoryPlan:
    """The memory plan of ``config`` held in ``formats`` on ``devices`` x ``hbm_gb`` (module docstring).

    Args:
        config: the model shape.
        formats: a :data:`kvtier.model.formats.PRESET_FORMATS` name or a :class:`WeightFormats`.
        devices: accelerators in the group (>= 1).
        hbm_gb: HBM per device, GB (1e9 bytes): 288 for MI355X, 141 for H200.
        parallel: ``dp-ep`` or ``tp`` (module docstring).
        kv_dtype_bytes: bytes per cached KV value (2 = bf16, 1 = FP8).
        dense_dtype_bytes: bytes per dense weight value (2 = bf16).
        hbm_fraction: share of HBM the engine takes (0 < f <= 1).
        reserve_gb: per-device allowance for activations and workspace, GB (>= 0).
        session_tokens: tokens per session for the session count (100,000).

    Raises:
        ValueError: an argument out of range, naming it.
    """
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ValueError(f"devices must be a positive int, got {devices!r}")
    if parallel not in PARALLEL:
        raise ValueError(f"parallel must be one of {PARALLEL}, got {parallel!r}")
    for name, value, lo in (("hbm_gb", hbm_gb, 0), ("kv_dtype_bytes", kv_dtype_bytes, 0),
                            ("dense_dtype_bytes", dense_dtype_bytes, 0), ("session_tokens", session_tokens, 0)):
        if not value > lo:
            raise ValueError(f"{name} must be > {lo}, got {value!r}")
    if not 0 < hbm_fraction <= 1:
        raise ValueError(f"hbm_fraction must be in (0, 1], got {hbm_fraction!r}")
    if not reserve_gb >= 0:
        raise ValueError(f"reserve_gb must be >= 0, got {reserve_gb!r}")
    name = formats if isinstance(formats, str) else "custom"
    parts = parameter_bytes(config, formats, dense_dtype_bytes)
    total = sum(b for _, b in parts.values())
    per_device = sum(b if part in REPLICATED[parallel] else b / devices for part, (_, b) in parts.items())
    hbm = hbm_gb * GB
    usable = hbm * hbm_fraction - reserve_gb * GB
    kv_free = usable - per_device
    kv_per_token = config.kv_cache_bytes_per_token(kv_dtype_bytes)
    tokens_per_device = int(kv_free // kv_per_token) if kv_free > 0 else 0
    tokens = tokens_per_device * (devices if parallel == "dp-ep" else 1)
    return MemoryPlan(name, devices, hbm, parallel, kv_dtype_bytes, session_tokens, hbm_fraction, reserve_gb * GB,
                      parts, total, per_device, usable, kv_free, kv_per_token, tokens, tokens // session_tokens)


def format_plans(plans: list[MemoryPlan], model_name: str = "") -> str:
    """A plain-text report of ``plans`` (one model and device group, several formats)."""
    p0 = plans[0]
    lines = [
        f"model {model_name}: {p0.total_parameters / 1e9:,.1f}B parameters; {p0.devices} devices x "
        f"{p0.hbm_bytes / GB:g} GB HBM, {p0.parallel}; usable per device {p0.hbm_bytes / GB:g} GB x "
        f"{p0.hbm_fraction:g} - {p0.reserve_bytes / GB:g} GB reserve = {p0.usable_bytes_per_device / GB:,.1f} GB",
        f"KV per token: {p0.kv_bytes_per_token:,.0f} bytes (MLA latent, {p0.kv_dtype_bytes:g}-byte values); "
        f"sessions of {p0.session_tokens:,} tokens",
        "",
        f"{'format':<8}{'weights total GB':>18}{'per device GB':>15}{'KV per device GB':>18}"
        f"{'KV tokens':>15}{'sessions':>10}",
    ]
    for p in plans:
        kv = f"{p.kv_bytes_per_device / GB:,.1f}" if p.fits else "does not fit"
        lines.append(f"{p.format:<8}{p.total_weight_bytes / GB:>18,.1f}{p.weight_bytes_per_device / GB:>15,.1f}"
                     f"{kv:>18}{p.kv_tokens:>15,}{p.sessions:>10,}")
    lines.append("")
    lines.append("weights per device by part (GB):")
    lines.append(f"{'part':<16}" + "".join(f"{p.format:>10}" for p in plans))
    for part in PARTS:
        row = []
        for p in plans:
            b = p.parts[part][1]
            row.append(b / (1 if part in REPLICATED[p.parallel] else p.devices) / GB)
        lines.append(f"{part:<16}" + "".join(f"{x:>10,.2f}" for x in row))
    lines.append("")
    lines.extend(f"{p.format}: {FORMAT_LABELS.get(p.format, p.format)}" for p in plans)
    return "\n".join(lines)
