"""Configuration of the hybrid Kimi models: Kimi-Linear (``kimi_linear``) and Kimi K3 (``kimi_k3``).

Both are stacks of Kimi Delta Attention (KDA) layers and MLA layers without positional encoding,
with DeepSeek-V3-style MoE. K3 adds a latent MoE (routed experts at ``routed_expert_hidden_size``),
SiTU-GLU activations, attention residuals over blocks of layers and a sigmoid output gate on MLA.
Field names are those of the released ``config.json`` files as transformers' ``KimiLinearConfig``
and the vllm package's ``KimiLinearConfig`` read them (see docs/k3.md); a ``kimi_k3``
config wraps the text model in ``text_config``.

``KimiLinearConfig.from_hf_dict`` checks everything a forward pass relies on and names the
field of anything it refuses.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.model.cache_spec import CacheSpec

HYBRID_MODEL_TYPES = ("kimi_linear", "kimi_k3")
HIDDEN_ACTS = ("silu", "situ")
KDA_GATE_LOWER_BOUND_MIN = -5.0
"""Smallest ``gate_lower_bound`` accepted (the bound the released kernels support)."""

# config.json spellings of each field (the first is the one written); transformers' KimiLinearConfig
# saves the "num_experts" family, the released weights use the same.
_ALIASES: dict[str, tuple[str, ...]] = {
    "n_routed_experts": ("num_experts", "n_routed_experts", "num_local_experts"),
    "num_experts_per_tok": ("num_experts_per_token", "num_experts_per_tok"),
    "n_shared_experts": ("num_shared_experts", "n_shared_experts"),
    "norm_topk_prob": ("moe_renormalize", "norm_topk_prob"),
    "n_group": ("num_expert_group", "n_group"),
    "scoring_func": ("moe_router_activation_func", "scoring_func"),
    "max_position_embeddings": ("max_position_embeddings", "model_max_length"),
}
# the config.json name of each field, for error messages
_FIELD_NAMES = {"linear_num_heads": "linear_attn_config.num_heads", "linear_head_dim": "linear_attn_config.head_dim",
                **{name: keys[0] for name, keys in _ALIASES.items()}}
_KDA_KEYS = ("kda_layers", "full_attn_layers", "num_heads", "head_dim", "short_conv_kernel_size")


@dataclass(frozen=True)
class KimiLinearConfig:
    """Shape, layer plan and routing of a hybrid KDA + MLA model (all sizes in elements).

    Layers: ``kda_layers`` and ``full_attn_layers`` are 1-based layer numbers (as in
    ``linear_attn_config``) that together cover ``1..num_hidden_layers`` exactly once.

    KDA (``linear_*`` fields, from ``linear_attn_config``): ``linear_num_heads`` heads of
    ``linear_head_dim``; a causal depthwise convolution of ``short_conv_kernel_size`` taps over
    q, k and v; per-channel decay ``g = gate_lower_bound * sigmoid(exp(A_log) * (f + dt_bias))``
    when ``gate_lower_bound`` is set, else ``-exp(A_log) * softplus(f + dt_bias)``; the output
    gate is full rank (``g_proj``) when ``use_full_rank_gate``, else low rank (``g_a_proj``,
    ``g_b_proj``).

    MLA: DeepSeek-V3 shapes with ``mla_use_nope`` (the ``qk_rope_head_dim`` dims are cached and
    used unrotated; the softmax scale is ``qk_head_dim ** -0.5``); ``mla_use_output_gate``
    multiplies the attention output by ``sigmoid(g_proj(x))`` before ``o_proj``.

    MoE: noaux_tc sigmoid routing as K2 (:class:`kvtier.model.KimiK2Config`); with
    ``routed_expert_hidden_size`` the routed experts run in that latent width between
    ``routed_expert_down_proj`` and ``routed_expert_up_proj`` (with an RMSNorm on the latent
    output when ``latent_moe_use_norm``). ``hidden_act`` ``situ`` is SiTU-GLU with
    ``activation_situ_beta`` and ``activation_situ_linear_beta``.

    ``attn_res_block_size``: attention residuals over blocks of that many layers (K3), None for
    plain residual adds.

    Raises:
        ValueError: on any inconsistent or unsupported field, naming it and what was expected.
    """

    hidden_size: int
    num_hidden_layers: int
    kda_layers: tuple[int, ...]
    full_attn_layers: tuple[int, ...]
    linear_num_heads: int
    linear_head_dim: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    intermediate_size: int
    first_k_dense_replace: int
    routed_scaling_factor: float
    short_conv_kernel_size: int = 4
    gate_lower_bound: float | None = None
    use_full_rank_gate: bool = False
    mla_use_nope: bool = True
    mla_use_output_gate: bool = False
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    moe_layer_freq: int = 1
    routed_expert_hidden_size: int | None = None
    latent_moe_use_norm: bool = False
    hidden_act: str = "silu"
    activation_situ_beta: float | None = None
    activation_situ_linear_beta: float | None = None
    attn_res_block_size: int | None = None
    rms_norm_eps: float = 1e-5
    vocab_size: int = 163840
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    eos_token_id: tuple[int, ...] = (163586,)
    model_type: str = "kimi_linear"

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_hidden_layers", "linear_num_heads", "linear_head_dim", "num_attention_heads",
                     "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                     "num_experts_per_tok", "moe_intermediate_size", "intermediate_size", "n_group", "topk_group",
                     "vocab_size", "max_position_embeddings", "moe_layer_freq"):
            _positive_int(_FIELD_NAMES.get(name, name), getattr(self, name))
        for name in ("q_lora_rank", "routed_expert_hidden_size", "attn_res_block_size"):
            value = getattr(self, name)
            if value is not None:
                _positive_int(name, value)
        self._check_layers()
        self._check_kda()
        self._check_mla()
        self._check_moe()
        _check(self.hidden_act in HIDDEN_ACTS, f"hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        if self.hidden_act == "situ":
            for name in ("activation_situ_beta", "activation_situ_linear_beta"):
                value = getattr(self, name)
                _check(value is None or value > 0, f"{name} must be > 0 (or null), got {value!r}")
        _check(self.rms_norm_eps > 0, f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        _check(self.model_type in HYBRID_MODEL_TYPES,
               f"model_type must be one of {HYBRID_MODEL_TYPES}, got {self.model_type!r}")

    def _check_layers(self) -> None:
        n = self.num_hidden_layers
        for name in ("kda_layers", "full_attn_layers"):
            layers = getattr(self, name)
            bad = [x for x in layers if not isinstance(x, int) or isinstance(x, bool) or not 1 <= x <= n]
            _check(not bad, f"linear_attn_config.{name} holds 1-based layer numbers in [1, {n}], got {bad}")
            dup = sorted({x for x in layers if layers.count(x) > 1})
            _check(not dup, f"linear_attn_config.{name} lists layers {dup} more than once")
        both = sorted(set(self.kda_layers) & set(self.full_attn_layers))
        _check(not both, f"linear_attn_config.kda_layers and linear_attn_config.full_attn_layers overlap at "
                         f"layers {both} (1-based)")
        gap = sorted(set(range(1, n + 1)) - set(self.kda_layers) - set(self.full_attn_layers))
        _check(not gap, f"linear_attn_config.kda_layers and linear_attn_config.full_attn_layers leave layers {gap} "
                        f"(1-based) of num_hidden_layers={n} unassigned")

    def _check_kda(self) -> None:
        _check(isinstance(self.short_conv_kernel_size, int) and self.short_conv_kernel_size >= 2,
               f"linear_attn_config.short_conv_kernel_size must be an int >= 2, got {self.short_conv_kernel_size!r}")
        lb = self.gate_lower_bound
        _check(lb is None or KDA_GATE_LOWER_BOUND_MIN <= lb < 0,
               f"linear_attn_config.gate_lower_bound must be in [{KDA_GATE_LOWER_BOUND_MIN}, 0) or null, got {lb!r}")

    def _check_mla(self) -> None:
        _check(self.mla_use_nope is True,
               "mla_use_nope must be true: hybrid Kimi models' MLA layers carry no positional encoding "
               f"(rotary MLA is the kimi_k2 model type), got {self.mla_use_nope!r}")

    def _check_moe(self) -> None:
        _check(self.n_shared_experts >= 0, f"num_shared_experts must be >= 0, got {self.n_shared_experts}")
        n = self.num_hidden_layers
        _check(0 <= self.first_k_dense_replace <= n,
               f"first_k_dense_replace must be in [0, num_hidden_layers={n}], got {self.first_k_dense_replace}")
        _check(self.moe_layer_freq == 1, f"moe_layer_freq must be 1 (every layer past the dense ones is MoE), "
                                         f"got {self.moe_layer_freq}")
        _check(self.n_routed_experts % self.n_group == 0,
               f"num_experts ({self.n_routed_experts}) must be divisible by num_expert_group ({self.n_group})")
        _check(self.n_routed_experts // self.n_group >= 2,
               f"each of the num_expert_group={self.n_group} groups needs >= 2 experts, "
               f"got {self.n_routed_experts // self.n_group}")
        _check(self.topk_group <= self.n_group,
               f"topk_group ({self.topk_group}) must be <= num_expert_group ({self.n_group})")
        _check(self.num_experts_per_tok <= self.topk_group * (self.n_routed_experts // self.n_group),
               f"num_experts_per_token ({self.num_experts_per_tok}) must be <= the experts in topk_group groups "
               f"({self.topk_group * (self.n_routed_experts // self.n_group)})")
        _check(self.scoring_func == "sigmoid",
               f"moe_router_activation_func must be 'sigmoid', got {self.scoring_func!r}")
        _check(self.topk_method == "noaux_tc", f"topk_method must be 'noaux_tc', got {self.topk_method!r}")
        _check(self.routed_scaling_factor > 0, f"routed_scaling_factor must be > 0, got {self.routed_scaling_factor}")
        _check(not self.latent_moe_use_norm or self.routed_expert_hidden_size is not None,
               "latent_moe_use_norm needs routed_expert_hidden_size (the latent width the norm runs over)")

    # ---- derived quantities -------------------------------------------------------------
    def is_kda_layer(self, layer_idx: int) -> bool:
        """Whether 0-based layer ``layer_idx`` is a KDA layer (else MLA)."""
        return layer_idx + 1 in self.kda_layers

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace

    @property
    def kda_layer_ids(self) -> tuple[int, ...]:
        """0-based indices of the KDA layers, ascending."""
        return tuple(sorted(x - 1 for x in self.kda_layers))

    @property
    def mla_layer_ids(self) -> tuple[int, ...]:
        """0-based indices of the MLA layers, ascending (one paged KV cache each)."""
        return tuple(sorted(x - 1 for x in self.full_attn_layers))

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Width of one cached MLA token per layer: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def sm_scale(self) -> float:
        """MLA softmax scale: ``qk_head_dim ** -0.5`` (no YaRN: the MLA layers carry no rope)."""
        return self.qk_head_dim ** -0.5

    @property
    def kda_projection_size(self) -> int:
        """``linear_num_heads * linear_head_dim``: the width of each of q, k, v in a KDA layer."""
        return self.linear_num_heads * self.linear_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of a KDA layer's short convolution (q, k and v: ``3 * kda_projection_size``)."""
        return 3 * self.kda_projection_size

    @property
    def moe_hidden_size(self) -> int:
        """Width the routed experts work at: ``routed_expert_hidden_size`` or ``hidden_size``."""
        return self.routed_expert_hidden_size or self.hidden_size

    def cache_spec(self, kv_dtype=None, state_dtype_bytes: int = 4) -> CacheSpec:
        """What a model of this config caches per sequence: KV pages in its MLA layers (``[..,
        kv_cache_dim]`` rows in ``kv_dtype``, a torch dtype; None = bf16) and one KDA state of
        :meth:`state_bytes_per_sequence` (recurrent states at ``state_dtype_bytes``, conv windows in
        ``kv_dtype``, the compute dtype), checkpointed at page boundaries."""
        import torch

        from kvtier.model.cache_spec import CacheSpec

        kv_dtype = kv_dtype or torch.bfloat16
        return CacheSpec(len(self.full_attn_layers), self.kv_cache_dim, kv_dtype,
                         self.state_bytes_per_sequence(state_dtype_bytes, kv_dtype.itemsize))

    def kv_cache_bytes_per_token(self, dtype_bytes: float = 2) -> int:
        """Bytes of MLA KV per token over the MLA layers at ``dtype_bytes`` per value
        (:meth:`cache_spec`'s; 27,648 for K3 in bf16)."""
        return self.cache_spec().kv_bytes_per_token_at(dtype_bytes)

    def recurrent_bytes_per_sequence(self, state_dtype_bytes: int = 4) -> int:
        """Bytes of one sequence's KDA recurrent states: ``[heads, head_dim, head_dim]`` per KDA layer."""
        return self.linear_num_heads * self.linear_head_dim ** 2 * state_dtype_bytes * len(self.kda_layers)

    def conv_bytes_per_sequence(self, conv_dtype_bytes: int = 2) -> int:
        """Bytes of one sequence's conv windows: ``[conv_dim, short_conv_kernel_size - 1]`` per KDA layer."""
        return self.conv_dim * (self.short_conv_kernel_size - 1) * conv_dtype_bytes * len(self.kda_layers)

    def state_bytes_per_sequence(self, state_dtype_bytes: int = 4, conv_dtype_bytes: int = 2) -> int:
        """Bytes of one sequence's KDA state (one checkpoint): its recurrent states plus its conv
        windows (the one formula every size in kvtier reads, through
        :meth:`kvtier.model.kimi_linear.KimiLinearForCausalLM.cache_spec` where a model exists)."""
        return self.recurrent_bytes_per_sequence(state_dtype_bytes) + self.conv_bytes_per_sequence(conv_dtype_bytes)

    def check_tensor_parallel(self, tp_size: int) -> None:
        """Raise ValueError unless the KDA and MLA heads split evenly over ``tp_size`` ranks."""
        _positive_int("tp_size", tp_size)
        _check(self.linear_num_heads % tp_size == 0,
               f"linear_attn_config.num_heads ({self.linear_num_heads}) must be divisible by the tensor-parallel "
               f"size {tp_size}")
        _check(self.num_attention_heads % tp_size == 0,
               f"num_attention_heads ({self.num_attention_heads}) must be divisible by the tensor-parallel size "
               f"{tp_size}")

    # ---- (de)serialisation ----------------------------------------------------------------
    @staticmethod
    def from_hf_dict(d: dict[str, Any]) -> KimiLinearConfig:
        """Build from a ``config.json`` dict: ``kimi_linear``, or ``kimi_k3`` with the text model
        under ``text_config``.

        Raises:
            ValueError: unknown ``model_type``, a missing or malformed field, or an invalid value
                (the message names the field).
        """
        outer = d.get("model_type")
        if outer == "kimi_k3":
            text = d.get("text_config")
            if not isinstance(text, dict):
                raise ValueError("a kimi_k3 config.json needs its text model as a text_config object")
            d = text
        elif outer != "kimi_linear":
            raise ValueError(f"config.json model_type must be one of {HYBRID_MODEL_TYPES}, got {outer!r}")
        lin = d.get("linear_attn_config")
        if not isinstance(lin, dict):
            raise ValueError("config.json lacks linear_attn_config (the KDA layer plan and shapes)")
        missing = [k for k in _KDA_KEYS if lin.get(k) is None]
        if missing:
            raise ValueError(f"linear_attn_config lacks {missing}")
        for key in ("kda_layers", "full_attn_layers"):
            if not isinstance(lin[key], (list, tuple)):
                raise ValueError(f"linear_attn_config.{key} must be a list of 1-based layer numbers, got {lin[key]!r}")
        kwargs: dict[str, Any] = {
            "kda_layers": tuple(lin["kda_layers"]), "full_attn_layers": tuple(lin["full_attn_layers"]),
            "linear_num_heads": lin["num_heads"], "linear_head_dim": lin["head_dim"],
            "short_conv_kernel_size": lin["short_conv_kernel_size"],
            "gate_lower_bound": lin.get("gate_lower_bound"),
            "use_full_rank_gate": bool(lin.get("use_full_rank_gate", False)),
        }
        names = {f.name for f in dataclasses.fields(KimiLinearConfig)} - set(kwargs) - {"eos_token_id", "model_type"}
        for name in names:
            for key in _ALIASES.get(name, (name,)):
                if d.get(key) is not None or (name == "q_lora_rank" and key in d):  # null: no query compression
                    kwargs[name] = d[key]
                    break
        if d.get("use_grouped_topk") is False:
            kwargs["n_group"], kwargs["topk_group"] = 1, 1
        for flag in ("mla_use_nope", "mla_use_output_gate", "latent_moe_use_norm"):
            if flag in kwargs:
                kwargs[flag] = bool(kwargs[flag])
        eos = d.get("eos_token_id", (163586,))
        kwargs["eos_token_id"] = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,) if eos is not None else ()
        kwargs["model_type"] = outer
        required = {f.name for f in dataclasses.fields(KimiLinearConfig) if f.default is dataclasses.MISSING}
        missing = sorted(_ALIASES.get(n, (n,))[0] for n in required - kwargs.keys())
        if missing:
            raise ValueError(f"config.json lacks required field(s) {missing}")
        return KimiLinearConfig(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` dict readable by :meth:`from_hf_dict`: for ``kimi_linear`` the
        transformers ``KimiLinearConfig`` layout; for ``kimi_k3`` the ``KimiK3ForConditionalGeneration``
        wrapper with the text model under ``text_config``."""
        d = dataclasses.asdict(self)
        for key in ("kda_layers", "full_attn_layers", "linear_num_heads", "linear_head_dim", "short_conv_kernel_size",
                    "gate_lower_bound", "use_full_rank_gate"):
            del d[key]
        d["linear_attn_config"] = {
            "kda_layers": list(self.kda_layers), "full_attn_layers": list(self.full_attn_layers),
            "num_heads": self.linear_num_heads, "head_dim": self.linear_head_dim,
            "short_conv_kernel_size": self.short_conv_kernel_size, "gate_lower_bound": self.gate_lower_bound,
            "use_full_rank_gate": self.use_full_rank_gate,
        }
        for name, keys in _ALIASES.items():
            d[keys[0]] = d.pop(name)
        d["eos_token_id"] = list(self.eos_token_id)
        d["num_key_value_heads"] = self.num_attention_heads
        d["model_type"] = "kimi_linear"
        d["architectures"] = ["KimiLinearForCausalLM"]
        if self.model_type != "kimi_k3":
            return d
        return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "text_config": d}


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _every_fourth(num_layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(kda_layers, full_attn_layers), 1-based: MLA on every fourth layer and the last (K3, Kimi-Linear)."""
    full = tuple(sorted({*range(4, num_layers + 1, 4), num_layers}))
    return tuple(x for x in range(1, num_layers + 1) if x not in full), full


def kimi_k3() -> KimiLinearConfig:
    """Kimi K3's text model at its real sizes (docs/k3.md), for the plan and the simulator.

    ``intermediate_size`` (the dense first layer), ``rms_norm_eps`` and the expert grouping are not
    in the stored sources: K2's 18432, Kimi-Linear's 1e-5 and one group are assumed; re-check them
    against a real ``config.json``.
    """
    kda, full = _every_fourth(93)
    return KimiLinearConfig(
        hidden_size=7168, num_hidden_layers=93, kda_layers=kda, full_attn_layers=full, linear_num_heads=96,
        linear_head_dim=128, short_conv_kernel_size=4, gate_lower_bound=-5.0, use_full_rank_gate=True,
        num_attention_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, mla_use_nope=True, mla_use_output_gate=True, n_routed_experts=896, num_experts_per_tok=16,
        n_shared_experts=2, moe_intermediate_size=3072, intermediate_size=18432, first_k_dense_replace=1,
        routed_scaling_factor=1.0, routed_expert_hidden_size=3584, latent_moe_use_norm=True, hidden_act="situ",
        activation_situ_beta=4.0, activation_situ_linear_beta=25.0, attn_res_block_size=12,
        max_position_embeddings=1048576, vocab_size=163840, model_type="kimi_k3",
    )


def kimi_linear_48b() -> KimiLinearConfig:
    """Kimi-Linear-48B-A3B: the hybrid without K3's latent MoE, SiTU, attention residuals and
    output gate (transformers' ``KimiLinearConfig`` defaults, 27 layers with MLA every fourth and last)."""
    kda, full = _every_fourth(27)
    return KimiLinearConfig(
        hidden_size=2304, num_hidden_layers=27, kda_layers=kda, full_attn_layers=full, linear_num_heads=32,
        linear_head_dim=128, short_conv_kernel_size=4, num_attention_heads=32, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8,
        n_shared_experts=1, moe_intermediate_size=1024, intermediate_size=9216, first_k_dense_replace=1,
        routed_scaling_factor=2.446, max_position_embeddings=1048576, vocab_size=163840,
    )


def tiny_k3() -> KimiLinearConfig:
    """K3's structure at CPU size (random weights): 8 layers, MLA at layers 4 and 8 (1-based),
    full-rank KDA gate with its lower bound, MLA output gate, latent MoE with its norm, SiTU-GLU,
    attention residuals over blocks of 3 layers; the real 163,840-token vocabulary."""
    kda, full = _every_fourth(8)
    return dataclasses.replace(
        kimi_k3(), hidden_size=128, num_hidden_layers=8, kda_layers=kda, full_attn_layers=full, linear_num_heads=4,
        linear_head_dim=32, num_attention_heads=4, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=2,
        moe_intermediate_size=64, intermediate_size=256, routed_expert_hidden_size=64, attn_res_block_size=3,
        max_position_embeddings=131072,
    )


HYBRID_PRESETS = {"kimi-k3": kimi_k3, "kimi-linear-48b": kimi_linear_48b, "tiny-k3": tiny_k3}
