"""Weight formats: which linear weights are held dense, FP8 block-scaled or INT4 group-scaled,
and the weights' ``quantization_config`` that says so.

Formats (per weight ``[N, K]`` = ``[out_features, in_features]``; layouts in docs/quantization.md):

- ``dense``: the model dtype (bf16 / fp32), ``N*K*dtype`` bytes.
- ``fp8``: ``float8_e4m3fn [N, K]`` with ``float32 scale_inv [ceil(N/b0), ceil(K/b1)]``,
  ``w = fp8 * scale_inv[n // b0, k // b1]``; DeepSeek-V3 / Kimi K2 base ship every linear layer
  but the router and ``lm_head`` so, ``weight_block_size`` ``(b0, b1) = (128, 128)``.
- ``int4``: compressed-tensors ``pack-quantized`` symmetric INT4: ``int32 packed [N, K/8]``
  (eight 4-bit values per word, value ``j`` of a word in bits ``4j..4j+3``, stored as
  ``q + 8`` for ``q`` in [-8, 7]) with ``bf16 scale [N, K/group_size]``, ``w = q * scale[n, k // g]``;
  Kimi K2 Thinking / K2.5 / K2.6 ship their routed experts so with ``group_size`` 32.

The model holds one format per *weight class* (:data:`WEIGHT_CLASSES`): attention projections,
the dense MLP of the first layers, shared experts, routed experts. Source of the
compressed-tensors fields: Kimi-K2-Thinking's ``config.json`` and the compressed-tensors
``QuantizationArgs`` / ``pack_to_int32`` conventions.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.model.config import KimiK2Config

DENSE, FP8, INT4 = "dense", "fp8", "int4"
FORMATS = (DENSE, FP8, INT4)
WEIGHT_CLASSES = ("attention", "dense_mlp", "shared_experts", "routed_experts")
INT4_PACK = 8  # 4-bit values per int32 word

# Kimi-K2-Thinking's config.json quantization_config (K2.5 and K2.6 carry the same under
# text_config, with vision modules added to ``ignore``): routed experts INT4, all else bf16.
KIMI_K2_THINKING_QUANTIZATION_CONFIG: dict[str, Any] = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
                "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True, "type": "int",
            },
        },
    },
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}
# DeepSeek-V3's and Kimi K2 base's: every linear layer FP8 e4m3 with 128x128 block scales.
DEEPSEEK_FP8_QUANTIZATION_CONFIG: dict[str, Any] = {
    "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
}


@dataclass(frozen=True)
class WeightFormats:
    """The format of each weight class (``dense`` | ``fp8`` | ``int4``) and their block/group sizes.

    ``kv_b_proj`` is always held dense: the absorbed attention uses it as two per-head batched
    matrices (``W_UK``, ``W_UV``), not as a linear layer, so a quantized one is dequantized on load.
    The router (``mlp.gate``), norms, embeddings and ``lm_head`` are never quantized.

    Attributes:
        attention, dense_mlp, shared_experts, routed_experts: format of that class.
        block_size: FP8 ``(b0, b1)`` block in (rows, columns) = (out, in) elements.
        group_size: INT4 group along ``in_features`` (a multiple of 8).

    Raises:
        ValueError: an unknown format or a bad block/group size, naming the field.
    """

    attention: str = DENSE
    dense_mlp: str = DENSE
    shared_experts: str = DENSE
    routed_experts: str = DENSE
    block_size: tuple[int, int] = (128, 128)
    group_size: int = 32

    def __post_init__(self) -> None:
        for cls in WEIGHT_CLASSES:
            if getattr(self, cls) not in FORMATS:
                raise ValueError(f"WeightFormats.{cls} must be one of {FORMATS}, got {getattr(self, cls)!r}")
        b = tuple(self.block_size)
        if len(b) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in b):
            raise ValueError(f"WeightFormats.block_size must be two positive ints, got {self.block_size!r}")
        object.__setattr__(self, "block_size", b)
        g = self.group_size
        if not isinstance(g, int) or isinstance(g, bool) or g <= 0 or g % INT4_PACK:
            raise ValueError(f"WeightFormats.group_size must be a positive multiple of {INT4_PACK}, got {g!r}")

    def of(self, weight_class: str) -> str:
        return getattr(self, weight_class)

    @property
    def quantized(self) -> bool:
        return any(self.of(c) != DENSE for c in WEIGHT_CLASSES)

    def problems(self, config: KimiK2Config) -> dict[str, str]:
        """``{weight_class: reason}`` for each class ``config``'s shapes cannot be held in its format.

        INT4 needs ``in_features % group_size == 0`` for every weight of an INT4 class; FP8 needs
        the fused gate/up weights' halves to start on a block row (``intermediate % b0 == 0``), as
        ``w13`` / ``gate_up_proj`` hold one scale grid for both.
        """
        out = {}
        for cls, in_features, fused in _class_shapes(config):
            fmt = self.of(cls)
            if fmt == FP8 and fused and fused % self.block_size[0]:
                out[cls] = (f"{cls} in fp8: the fused gate/up weight needs its intermediate size ({fused}) to be a "
                            f"multiple of weight_block_size[0]={self.block_size[0]} (one scale grid for both halves)")
            bad = [k for k in in_features if fmt == INT4 and k % self.group_size]
            if bad:
                out[cls] = f"{cls} in int4: in_features {bad[0]} is not a multiple of group_size {self.group_size}"
        return out

    def check(self, config: KimiK2Config) -> None:
        """Raise ValueError with the first of :meth:`problems`."""
        for reason in self.problems(config).values():
            raise ValueError(reason)


def _class_shapes(c: KimiK2Config):
    """(class, in_features of its weights, fused gate/up intermediate size or 0) per present class."""
    attn_k = (c.hidden_size, c.num_attention_heads * c.v_head_dim) + ((c.q_lora_rank,) if c.q_lora_rank else ())
    yield "attention", attn_k, 0
    if c.first_k_dense_replace:
        yield "dense_mlp", (c.hidden_size, c.intermediate_size), c.intermediate_size
    if c.first_k_dense_replace < c.num_hidden_layers:
        if c.n_shared_experts:
            shared = c.moe_intermediate_size * c.n_shared_experts
            yield "shared_experts", (c.hidden_size, shared), shared
        yield "routed_experts", (c.hidden_size, c.moe_intermediate_size), c.moe_intermediate_size


PRESET_FORMATS = {
    "bf16": WeightFormats(),
    "fp8": WeightFormats(attention=FP8, dense_mlp=FP8, shared_experts=FP8, routed_experts=FP8),
    "int4": WeightFormats(routed_experts=INT4),
}
"""``bf16``: nothing quantized; ``fp8``: Kimi K2 / DeepSeek-V3 as released; ``int4``: Kimi K2.6
(K2 Thinking, K2.5) as released: routed experts INT4 group-32, everything else bf16."""


def weight_class(target: str) -> str | None:
    """The weight class of a model parameter path (:class:`kvtier.model.weights.TensorSpec`
    ``target``), or None for one that is never quantized (norms, router, embeddings, kv_b_proj)."""
    parts = target.split(".")
    if parts[0] != "layers" or len(parts) < 4:
        return None
    if parts[2] == "self_attn":
        return None if parts[3] in ("kv_b_proj", "q_a_layernorm", "kv_a_layernorm") else "attention"
    if parts[2] == "mlp":
        if parts[3] == "shared_experts":
            return "shared_experts"
        if parts[3] in ("w13", "w2"):
            return "routed_experts"
        if parts[3] in ("gate_up_proj", "down_proj"):
            return "dense_mlp"
    return None


# ---- quantization_config -----------------------------------------------------------------

@dataclass(frozen=True)
class _Group:
    """One compressed-tensors config group: its targets and where its fields came from."""

    name: str
    targets: tuple[str, ...]
    weights: Mapping[str, Any]
    input_activations: Any
    output_activations: Any
    format: str | None


def _matches(module: str, patterns, linear: bool) -> bool:
    """compressed-tensors matching: ``re:<regex>`` (``re.match`` on the module name), the class
    name ``Linear`` (every linear layer), or an exact module name."""
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], module):
                return True
        elif p == "Linear":
            if linear:
                return True
        elif p == module:
            return True
    return False


class QuantizationConfig:
    """The weights' ``quantization_config``, checked: FP8 block (``quant_method: fp8``) or
    compressed-tensors INT4 ``pack-quantized`` groups.

    Config-wide fields are checked at construction; a config group's ``weights`` are checked when
    a tensor it targets is resolved (:meth:`format_of`), so the error names that tensor.

    Raises:
        ValueError: an unsupported method or field, naming ``quantization_config.<field>``.
    """

    def __init__(self, raw: Mapping[str, Any] | None):
        self.raw = dict(raw or {})
        self.method = self.raw.get("quant_method")
        self.block_size: tuple[int, int] = (128, 128)
        self.groups: list[_Group] = []
        self.ignore: tuple[str, ...] = ()
        q = "quantization_config"
        if not self.raw:
            self.method = None
        elif self.method == "fp8":
            fmt = self.raw.get("fmt", "e4m3")
            if fmt != "e4m3":
                raise ValueError(f"{q}.fmt must be 'e4m3' (float8_e4m3fn weights), got {fmt!r}")
            b = self.raw.get("weight_block_size", [128, 128])
            if not (isinstance(b, (list, tuple)) and len(b) == 2
                    and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in b)):
                raise ValueError(f"{q}.weight_block_size must be two positive ints (rows, columns), got {b!r}")
            self.block_size = (int(b[0]), int(b[1]))
            act = self.raw.get("activation_scheme", "dynamic")
            if act != "dynamic":
                raise ValueError(f"{q}.activation_scheme must be 'dynamic' (no static activation scales), got {act!r}")
        elif self.method == "compressed-tensors":
            top_format = self.raw.get("format")
            status = self.raw.get("quantization_status", "compressed")
            if status != "compressed":
                raise ValueError(f"{q}.quantization_status must be 'compressed' (packed weights), got {status!r}")
            if self.raw.get("sparsity_config"):
                raise ValueError(f"{q}.sparsity_config must be empty (sparse weights are not supported), got "
                                 f"{self.raw['sparsity_config']!r}")
            if self.raw.get("kv_cache_scheme") is not None:
                raise ValueError(f"{q}.kv_cache_scheme must be null (KV quantization is not supported), got "
                                 f"{self.raw['kv_cache_scheme']!r}")
            ignore = self.raw.get("ignore") or []
            if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
                raise ValueError(f"{q}.ignore must be a list of module names or 're:' patterns, got {ignore!r}")
            self.ignore = tuple(ignore)
            groups = self.raw.get("config_groups")
            if not isinstance(groups, dict) or not groups:
                raise ValueError(f"{q}.config_groups must be a non-empty object of config groups, got {groups!r}")
            for name, g in groups.items():
                where = f"{q}.config_groups.{name}"
                if not isinstance(g, dict):
                    raise ValueError(f"{where} must be an object, got {g!r}")
                targets = g.get("targets")
                if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
                    raise ValueError(f"{where}.targets must be a non-empty list of module names or patterns, "
                                     f"got {targets!r}")
                if not isinstance(g.get("weights"), dict):
                    raise ValueError(f"{where}.weights must be an object (weight quantization args), got "
                                     f"{g.get('weights')!r}")
                self.groups.append(_Group(name, tuple(targets), g["weights"], g.get("input_activations"),
                                          g.get("output_activations"), g.get("format", top_format)))
        else:
            raise ValueError(f"{q}.quant_method must be 'fp8' (block FP8) or 'compressed-tensors' (INT4 "
                             f"pack-quantized), got {self.method!r}")

    def group_size(self) -> int | None:
        """The INT4 group size all groups share (None without compressed-tensors groups)."""
        sizes = {g.weights.get("group_size") for g in self.groups}
        if len(sizes) > 1:
            raise ValueError(f"quantization_config.config_groups: every group must have one group_size, got "
                             f"{sorted(map(str, sizes))}")
        return next(iter(sizes)) if sizes else None

    def format_of(self, module: str, in_features: int) -> str:
        """``int4`` when a compressed-tensors group targets ``module`` (its stored name without
        ``.weight``) and ``ignore`` does not, else ``dense``; ``fp8`` configs answer ``fp8`` (whether a
        tensor is FP8 is read from its dtype). Checks the targeting group's ``weights``.

        Raises:
            ValueError: the group asks for anything but symmetric INT4 ``pack-quantized`` groups
                whose size divides ``in_features``, naming the tensor and the field.
        """
        if self.method == "fp8":
            return FP8
        if self.method != "compressed-tensors" or _matches(module, self.ignore, True):
            return DENSE
        for g in self.groups:
            if _matches(module, g.targets, True):
                _check_int4_group(g, f"{module}.weight_packed", in_features)
                return INT4
        return DENSE


def _check_int4_group(g: _Group, tensor: str, in_features: int) -> None:
    where = f"quantization_config.config_groups.{g.name}"
    w = g.weights

    def need(field: str, ok: bool, want: str) -> None:
        if not ok:
            raise ValueError(f"tensor {tensor!r}: {where}.{field} must be {want}, got {_get(g, field)!r}")

    need("format", g.format == "pack-quantized", "'pack-quantized' (INT4 packed into int32)")
    need("weights.num_bits", w.get("num_bits") == 4, "4 (INT4 weights)")
    need("weights.type", w.get("type") == "int", "'int'")
    need("weights.symmetric", w.get("symmetric") is True, "true (asymmetric weight_zero_point is not supported)")
    need("weights.strategy", w.get("strategy") == "group", "'group' (one scale per group_size inputs)")
    gs = w.get("group_size")
    need("weights.group_size", isinstance(gs, int) and not isinstance(gs, bool) and gs > 0 and gs % INT4_PACK == 0,
         f"a positive multiple of {INT4_PACK}")
    if in_features % gs:
        raise ValueError(f"tensor {tensor!r}: {where}.weights.group_size={gs} does not divide its in_features "
                         f"{in_features}")
    need("weights.actorder", w.get("actorder") is None, "null (activation-ordered groups, g_idx, are not supported)")
    need("weights.dynamic", not w.get("dynamic"), "false (static weight scales)")
    need("weights.block_structure", w.get("block_structure") is None, "null")
    need("input_activations", g.input_activations is None, "null (W4A16: activations are not quantized)")
    need("output_activations", g.output_activations is None, "null")


def _get(g: _Group, field: str):
    if field == "format":
        return g.format
    if field in ("input_activations", "output_activations"):
        return getattr(g, field)
    return g.weights.get(field.split(".", 1)[1])


def quantization_config_of(raw_config: Mapping[str, Any]) -> QuantizationConfig:
    """The checked ``quantization_config`` of a ``config.json`` dict (top level or ``text_config``)."""
    q = raw_config.get("quantization_config") or (raw_config.get("text_config") or {}).get("quantization_config")
    return QuantizationConfig(q)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def weight_bytes(shape: tuple[int, int], fmt: str, formats: WeightFormats, dense_bytes: float,
                 lead: int = 1) -> int:
    """Bytes ``lead`` weights of ``shape = (N, K)`` take held in ``fmt`` (scales included):
    dense ``N*K*dense_bytes``; fp8 ``N*K + ceil(N/b0)*ceil(K/b1)*4``; int4 ``N*K/2 + N*K/g*2``."""
    n, k = shape
    if fmt == DENSE:
        return int(lead * n * k * dense_bytes)
    if fmt == FP8:
        b0, b1 = formats.block_size
        return lead * (n * k + cdiv(n, b0) * cdiv(k, b1) * 4)
    return lead * (n * k // 2 + n * (k // formats.group_size) * 2)


__all__ = [
    "DEEPSEEK_FP8_QUANTIZATION_CONFIG", "DENSE", "FP8", "FORMATS", "INT4", "KIMI_K2_THINKING_QUANTIZATION_CONFIG",
    "PRESET_FORMATS", "WEIGHT_CLASSES", "QuantizationConfig", "WeightFormats", "cdiv",
    "quantization_config_of", "weight_bytes", "weight_class",
]
