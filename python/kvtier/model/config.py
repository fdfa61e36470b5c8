"""Kimi K2 (DeepSeek-V3 architecture) configuration with Hugging Face field names.

Field meanings and the K2 values come from the public K2 ``config.json`` (see docs/kimi.md).
``KimiK2Config.from_hf_dict`` reads the ``config.json`` of a weights directory (``model_type`` ``kimi_k2``
or ``deepseek_v3``, optionally wrapped in ``text_config``; rope as ``rope_scaling`` +
``rope_theta`` or as transformers-5 ``rope_parameters``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.model.kimi_linear_config import HYBRID_PRESETS, KimiLinearConfig

if TYPE_CHECKING:
    from kvtier.model.cache_spec import CacheSpec

SUPPORTED_MODEL_TYPES = ("kimi_k2", "deepseek_v3")


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN magnitude scale ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``).

    Source: YaRN (Peng et al., 2023, arXiv:2309.00071) as used by DeepSeek-V2/V3.
    """
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rope scaling (``rope_scaling`` with ``type``/``rope_type`` = ``"yarn"``).

    Attributes:
        factor: context extension factor (K2-Instruct 32, later K2 models 64).
        original_max_position_embeddings: pre-training context length in tokens (4096 for K2).
        beta_fast, beta_slow: rotation counts bounding the interpolation ramp.
        mscale, mscale_all_dim: magnitude-scale coefficients (both 1 for K2).
        attention_factor: explicit cos/sin scale; None derives it from mscale/mscale_all_dim.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = 1.0
    mscale_all_dim: float | None = 0.0
    attention_factor: float | None = None

    def __post_init__(self) -> None:
        if not self.factor >= 1.0:
            raise ValueError(f"rope_scaling.factor must be >= 1, got {self.factor}")
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                "rope_scaling.original_max_position_embeddings must be > 0, "
                f"got {self.original_max_position_embeddings}"
            )

    @property
    def cos_sin_scale(self) -> float:
        """Scale applied to cos/sin (the transformers YaRN convention)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim)
        return yarn_get_mscale(self.factor)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> YarnScaling:
        kind = d.get("rope_type", d.get("type"))
        if kind != "yarn":
            raise ValueError(f"rope_scaling type must be 'yarn' (or rope_scaling absent), got {kind!r}")
        return YarnScaling(
            factor=float(d["factor"]),
            original_max_position_embeddings=int(d["original_max_position_embeddings"]),
            beta_fast=float(d.get("beta_fast") or 32.0),
            beta_slow=float(d.get("beta_slow") or 1.0),
            mscale=d.get("mscale", 1.0),
            mscale_all_dim=d.get("mscale_all_dim", 0.0),
            attention_factor=d.get("attention_factor"),
        )

    def to_dict(self) -> dict[str, Any]:
        d = {"type": "yarn", **dataclasses.asdict(self)}
        if d["attention_factor"] is None:
            del d["attention_factor"]
        return d


@dataclass(frozen=True)
class KimiK2Config:
    """Model shape and routing of a Kimi K2 / DeepSeek-V3 text model (HF field names).

    All sizes are element counts; ``max_position_embeddings`` is in tokens. ``q_lora_rank=None``
    means a plain ``q_proj`` (no query compression). Routing is ``noaux_tc`` with sigmoid scores:
    top-k over ``score + e_score_correction_bias`` restricted to the best ``topk_group`` of
    ``n_group`` groups (group score = sum of its top-2 biased scores); weights are the unbiased
    scores, renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``.

    Raises:
        ValueError: on any inconsistent field, naming the field and what was expected.
    """

    hidden_size: int
    num_hidden_layers: int
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
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    rope_theta: float = 50000.0
    rope_scaling: YarnScaling | None = None
    rms_norm_eps: float = 1e-6
    vocab_size: int = 163840
    max_position_embeddings: int = 131072
    rope_interleave: bool = True
    tie_word_embeddings: bool = False
    eos_token_id: tuple[int, ...] = (163585,)
    model_type: str = "kimi_k2"

    def __post_init__(self) -> None:
        positive = [
            "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok",
            "moe_intermediate_size", "intermediate_size", "n_group", "topk_group", "vocab_size",
            "max_position_embeddings",
        ]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        _check(self.q_lora_rank is None or (isinstance(self.q_lora_rank, int) and self.q_lora_rank > 0),
               f"q_lora_rank must be None or a positive int, got {self.q_lora_rank!r}")
        _check(self.n_shared_experts >= 0, f"n_shared_experts must be >= 0, got {self.n_shared_experts}")
        _check(0 <= self.first_k_dense_replace <= self.num_hidden_layers,
               f"first_k_dense_replace must be in [0, num_hidden_layers={self.num_hidden_layers}], "
               f"got {self.first_k_dense_replace}")
        _check(self.qk_rope_head_dim % 2 == 0, f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        _check(self.n_routed_experts % self.n_group == 0,
               f"n_routed_experts ({self.n_routed_experts}) must be divisible by n_group ({self.n_group})")
        _check(self.n_routed_experts // self.n_group >= 2,
               f"each of the n_group={self.n_group} groups needs >= 2 experts (group score = top-2 sum), "
               f"got {self.n_routed_experts // self.n_group}")
        _check(self.topk_group <= self.n_group, f"topk_group ({self.topk_group}) must be <= n_group ({self.n_group})")
        _check(self.num_experts_per_tok <= self.topk_group * (self.n_routed_experts // self.n_group),
               f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= the experts in topk_group groups "
               f"({self.topk_group * (self.n_routed_experts // self.n_group)})")
        _check(self.scoring_func == "sigmoid", f"scoring_func must be 'sigmoid', got {self.scoring_func!r}")
        _check(self.topk_method == "noaux_tc", f"topk_method must be 'noaux_tc', got {self.topk_method!r}")
        _check(self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta}")
        _check(self.rms_norm_eps > 0, f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        _check(self.routed_scaling_factor > 0, f"routed_scaling_factor must be > 0, got {self.routed_scaling_factor}")
        _check(self.rope_interleave, "rope_interleave must be True (DeepSeek-V3 weights interleave rope dims)")
        _check(self.rope_scaling is None or isinstance(self.rope_scaling, YarnScaling),
               f"rope_scaling must be a YarnScaling or None, got {type(self.rope_scaling).__name__}")

    # ---- derived quantities -------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width of the expanded form: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Width of one cached token per layer: ``kv_lora_rank + qk_rope_head_dim`` (576 for K2)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def sm_scale(self) -> float:
        """Attention softmax scale ``qk_head_dim ** -0.5 * mscale ** 2`` (docs/kimi.md, "The attention scale").

        ``mscale = yarn_get_mscale(factor, mscale_all_dim)`` when YaRN with ``mscale_all_dim`` is
        configured, else 1. Weight absorption does not change it (0.130861 for factor 32).
        """
        scale = self.qk_head_dim ** -0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim:
            m = yarn_get_mscale(rs.factor, rs.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace

    def cache_spec(self, kv_dtype=None) -> CacheSpec:
        """What a model of this config caches per sequence: KV pages in every layer, ``[..,
        kv_cache_dim]`` rows in ``kv_dtype`` (a torch dtype; None = bf16), no recurrent state."""
        import torch

        from kvtier.model.cache_spec import CacheSpec

        return CacheSpec(self.num_hidden_layers, self.kv_cache_dim, kv_dtype or torch.bfloat16)

    def kv_cache_bytes_per_token(self, dtype_bytes: float = 2) -> int:
        """Bytes of MLA KV cache per token over all layers at ``dtype_bytes`` per value
        (:meth:`cache_spec`'s; 70,272 for K2 in bf16)."""
        return self.cache_spec().kv_bytes_per_token_at(dtype_bytes)

    # ---- (de)serialisation ----------------------------------------------------------------
    @staticmethod
    def from_hf_dict(d: dict[str, Any]) -> KimiK2Config:
        """Build from a Hugging Face ``config.json`` dict.

        Raises:
            ValueError: unknown ``model_type``, a missing required field, or an invalid value.
        """
        model_type = d.get("model_type")
        if "text_config" in d and model_type not in SUPPORTED_MODEL_TYPES:
            d = d["text_config"]
            model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.json model_type must be one of {SUPPORTED_MODEL_TYPES}, got {model_type!r}")
        names = {f.name for f in dataclasses.fields(KimiK2Config)}
        kwargs: dict[str, Any] = {k: v for k, v in d.items() if k in names}
        rope = d.get("rope_parameters") or {}
        if "rope_theta" not in kwargs and "rope_theta" in rope:
            kwargs["rope_theta"] = rope["rope_theta"]
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        kwargs["rope_scaling"] = YarnScaling.from_dict(scaling) if scaling else None
        eos = d.get("eos_token_id", (163585,))
        kwargs["eos_token_id"] = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,) if eos is not None else ()
        kwargs["model_type"] = model_type
        required = {f.name for f in dataclasses.fields(KimiK2Config)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        missing = sorted(required - kwargs.keys())
        if missing:
            raise ValueError(f"config.json lacks required field(s) {missing}")
        return KimiK2Config(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` dict readable by ``from_hf_dict`` and by transformers."""
        d = dataclasses.asdict(self)
        d["rope_scaling"] = self.rope_scaling.to_dict() if self.rope_scaling else None
        d["eos_token_id"] = list(self.eos_token_id)
        d["num_key_value_heads"] = self.num_attention_heads
        d["hidden_act"] = "silu"
        d["attention_bias"] = False
        d["architectures"] = ["DeepseekV3ForCausalLM"]
        return d


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _k2() -> KimiK2Config:
    # Values of the public Kimi-K2-Instruct config.json (docs/kimi.md).
    return KimiK2Config(
        hidden_size=7168, num_hidden_layers=61, num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=384, num_experts_per_tok=8,
        n_shared_experts=1, moe_intermediate_size=2048, intermediate_size=18432, first_k_dense_replace=1,
        n_group=1, topk_group=1, routed_scaling_factor=2.827, rope_theta=50000.0,
        rope_scaling=YarnScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0,
                                 mscale=1.0, mscale_all_dim=1.0),
        max_position_embeddings=131072, vocab_size=163840,
    )


def _tiny() -> KimiK2Config:
    # K2's structure (dense first layer, shared expert, YaRN, sigmoid routing) at CPU size;
    # vocab stays 163840 so real Kimi token ids are valid.
    return KimiK2Config(
        hidden_size=128, num_hidden_layers=3, num_attention_heads=4, q_lora_rank=96, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16, num_experts_per_tok=4,
        n_shared_experts=1, moe_intermediate_size=64, intermediate_size=256, first_k_dense_replace=1,
        n_group=4, topk_group=2, routed_scaling_factor=2.827, rope_theta=50000.0,
        rope_scaling=YarnScaling(factor=32.0, original_max_position_embeddings=256, beta_fast=1.0, beta_slow=1.0,
                                 mscale=1.0, mscale_all_dim=1.0),
        max_position_embeddings=8192, vocab_size=163840,
    )


def _k2_gpu() -> KimiK2Config:
    """K2's structure at one-GPU size, so that load-vs-recompute on a GPU is the real trade-off.

    Every layer is a K2 layer in width (hidden 7168, 64 heads, MLA with q_lora_rank 1536,
    kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128; dense first
    layer with intermediate 18432; MoE experts of 2048 with one shared expert, sigmoid routing,
    YaRN as K2), with 4 layers, 8 routed experts (top-4) and a 32768-token vocabulary: 2.46e9
    parameters, 4.9 GB in bf16 (random weights are built in seconds and fit beside the KV cache).

    Arithmetic for a 32K-token prompt (bf16):

    * its KV: 576 values x 2 bytes x 4 layers = 4,608 bytes per token, 151 MB in all; over
      PCIe Gen5 x16 from pinned memory (~50 GB/s on an H200 or MI355X host) that is ~3 ms;
    * its prefill: per token, the attention projections 2 x 101e6 x 4 layers = 0.8 GFLOP, the MLPs
      2 x 396e6 (dense layer) + 3 x 2 x 5 x 44e6 (4 routed + 1 shared expert) = 2.1 GFLOP, and the
      causal attention over on average 16K earlier tokens 2 x 64 heads x (576 + 512) x 16384 x 4
      layers = 9.1 GFLOP (absorbed MLA; the expanded form is about a third of it): ~12 GFLOP per
      token, 3.9e14 FLOP for the prompt: >= 0.40 s on an H200 (989 TFLOP/s dense bf16 peak),
      >= 0.17 s on an MI355X (2.3 PFLOP/s), more at a realistic utilisation.

    So recomputing such a prompt costs 50-130x (at peak FLOP/s) what loading its KV costs, as
    for the full model (whose ratio does not depend on the layer count: both scale with it).
    K2's end-of-turn id (163585) is outside this vocabulary: random-weight runs always generate
    ``max_tokens`` tokens.
    """
    return dataclasses.replace(_k2(), num_hidden_layers=4, n_routed_experts=8, num_experts_per_tok=4,
                               vocab_size=32768)


PRESETS = {"kimi-k2": _k2, "k2-gpu": _k2_gpu, "tiny": _tiny, **HYBRID_PRESETS}


def did_you_mean(name) -> str:
    """``"; did you mean 'tiny-k3'?"`` naming the preset closest to ``name`` (difflib's
    similarity ratio >= 0.6), or ``""`` when none is that close (a path, an unrelated word)."""
    close = difflib.get_close_matches(str(name), PRESETS, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def preset(name: str) -> KimiK2Config | KimiLinearConfig:
    """A named configuration: ``kimi-k2`` (full size, for sizing/simulation), ``k2-gpu`` (K2's
    layers at one-GPU size, random weights; see :func:`_k2_gpu`) or ``tiny`` (CPU); the hybrid
    KDA + MLA models ``kimi-k3``, ``kimi-linear-48b`` (real sizes) and ``tiny-k3`` (CPU) are
    :class:`kvtier.model.kimi_linear_config.KimiLinearConfig`.

    Raises:
        ValueError: unknown preset name.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}{did_you_mean(name)}")
    return PRESETS[name]()
