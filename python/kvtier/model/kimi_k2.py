"""Kimi K2 (DeepSeek-V3 architecture) forward pass over a paged MLA KV cache.

Shape legend: T tokens in the step, H hidden_size, NH attention heads, R kv_lora_rank,
P qk_rope_head_dim, N qk_nope_head_dim, V v_head_dim, E routed experts, I intermediate.

Attention always runs in the weight-absorbed form: ``q_nope @ W_UK`` maps queries into the
latent space so every head attends to the one shared cached row ``[c_kv | k_pe]`` (width R+P),
and ``W_UV`` is applied to the attention output (docs/kimi.md, "Decode with weight absorption").
All math outside plain GEMMs goes through :mod:`kvtier.ops`.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from kvtier import ops
from kvtier.ops import _cpu_linear
from kvtier.model.batch import AttentionBatch
from kvtier.model.cache_spec import CacheSpec
from kvtier.model.config import KimiK2Config
from kvtier.model.formats import DENSE, FP8, INT4, WeightFormats, cdiv
from kvtier.model.rope import build_cos_sin_cache

# The latent norms (q_a_layernorm, kv_a_layernorm) use a fixed eps of 1e-6 in DeepSeek-V3's
# reference code and in transformers, independent of config.rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


DEFAULT_FORMATS = WeightFormats()  # every weight dense in the model dtype
INT4_SCALE_DTYPE = torch.bfloat16  # the dtype Kimi's compressed-tensors weights store group scales in


def _weight(owner: nn.Module, name: str, shape: tuple[int, ...], fmt: str, formats: WeightFormats,
            dtype: torch.dtype) -> None:
    """Register weight ``name`` of ``shape = (*lead, N, K)`` on ``owner`` in ``fmt``:

    - dense: ``name`` [*lead, N, K] ``dtype``;
    - fp8: ``name`` [*lead, N, K] float8_e4m3fn and ``name_scale_inv`` [*lead, ceil(N/b0), ceil(K/b1)] fp32;
    - int4: ``name_packed`` [*lead, N, K/8] int32 and ``name_scale`` [*lead, N, K/group_size] bf16.
    """
    *lead, n, k = shape
    if fmt == DENSE:
        setattr(owner, name, _param(*shape, dtype=dtype))
    elif fmt == FP8:
        b0, b1 = formats.block_size
        setattr(owner, name, _param(*shape, dtype=torch.float8_e4m3fn))
        setattr(owner, f"{name}_scale_inv", _param(*lead, cdiv(n, b0), cdiv(k, b1), dtype=torch.float32))
    elif fmt == INT4:
        setattr(owner, f"{name}_packed", _param(*lead, n, k // 8, dtype=torch.int32))
        setattr(owner, f"{name}_scale", _param(*lead, n, k // formats.group_size, dtype=INT4_SCALE_DTYPE))
    else:
        raise ValueError(f"weight format must be one of {(DENSE, FP8, INT4)}, got {fmt!r}")


def _linear(owner: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` for ``owner``'s weight ``name`` in ``owner.fmt`` (dense: F.linear, or on the CPU
    in eager mode a bf16 weight's oneDNN-packed copy held in ``owner.derived``, the same result
    without a reorder per call (:mod:`kvtier.ops._cpu_linear`); fp8:
    :func:`kvtier.ops.linear_fp8_block`; int4: :func:`kvtier.ops.linear_w4a16`, on ``owner.backend``)."""
    fmt = owner.fmt
    if fmt == DENSE:
        weight = getattr(owner, name)
        if x.device.type == "cpu" and x.dtype == torch.bfloat16 and not torch.compiler.is_compiling():
            packed = owner.derived.get(name, weight, _cpu_linear.pack_weight)
            if packed is not None:
                return _cpu_linear.linear(x, packed)
        return F.linear(x, weight)
    if fmt == FP8:
        return ops.linear_fp8_block(x, getattr(owner, name), getattr(owner, f"{name}_scale_inv"),
                                    owner.formats.block_size, backend=owner.backend)
    return ops.linear_w4a16(x, getattr(owner, f"{name}_packed"), getattr(owner, f"{name}_scale"),
                            owner.formats.group_size, backend=owner.backend)


ABSORB_FP32_MAX_TOKENS = 32
"""Tokens up to which :class:`MLAttention` computes ``q_nope @ W_UK`` and ``latent @ W_UV.T`` in
fp32 on the CPU (bf16 inputs upcast exactly, fp32 accumulation as oneDNN's bf16 product, one
rounding of the result): at 8 tokens x 4 heads x 128 x 512 the fp32 batched products take 55 µs
each where the bf16 ones take 110-360 µs; at 384 tokens bf16 is 4x faster (torch 2.13, one core)."""


class MLAttention(nn.Module):
    """Weight-absorbed MLA over the paged cache; its paged attention runs on the step's plans
    (:meth:`KimiK2ForCausalLM.plan`), which carry the model's backend. The projections are held
    in ``formats.attention`` (see :func:`_weight`), ``kv_b_proj`` always in ``dtype``.

    The hybrid Kimi models (:mod:`kvtier.model.kimi_linear`) reuse it with ``rope=False`` (the
    ``qk_rope_head_dim`` dims of q and of the cached key are used unrotated; ``cos_sin_cache`` is
    then ignored) and ``output_gate=True`` (``g_proj`` [NH*V, H]: the attention output is
    multiplied by ``sigmoid(g_proj(x))`` before ``o_proj``). ``config`` needs only the MLA fields
    and ``sm_scale``."""

    def __init__(self, config: KimiK2Config, dtype: torch.dtype, formats: WeightFormats = DEFAULT_FORMATS,
                 backend: str = "auto", *, rope: bool = True, output_gate: bool = False):
        super().__init__()
        c = config
        self.config = c
        self.rope, self.output_gate = rope, output_gate
        self.formats, self.fmt, self.backend = formats, formats.attention, backend
        self.derived = _cpu_linear.DerivedWeights()  # CPU copies of the weights (see _linear, _absorb)
        nh, qk = c.num_attention_heads, c.qk_head_dim
        w = lambda name, *shape: _weight(self, name, shape, self.fmt, formats, dtype)
        if c.q_lora_rank is None:
            w("q_proj", nh * qk, c.hidden_size)
        else:
            w("q_a_proj", c.q_lora_rank, c.hidden_size)
            self.q_a_layernorm = _param(c.q_lora_rank, dtype=dtype)
            w("q_b_proj", nh * qk, c.q_lora_rank)
        w("kv_a_proj_with_mqa", c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size)
        self.kv_a_layernorm = _param(c.kv_lora_rank, dtype=dtype)
        self.kv_b_proj = _param(nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank, dtype=dtype)
        w("o_proj", c.hidden_size, nh * c.v_head_dim)
        if output_gate:
            w("g_proj", nh * c.v_head_dim, c.hidden_size)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [NH, N, R], W_UV [NH, V, R]) views of kv_b_proj."""
        c = self.config
        w = self.kv_b_proj.view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :]

    def _fp32_absorption(self, x: torch.Tensor) -> bool:
        """Whether the absorption products of these tokens run in fp32 on held fp32 copies of
        W_UK and W_UV: a few bf16/fp16 tokens on the CPU in eager mode (see
        :data:`ABSORB_FP32_MAX_TOKENS`)."""
        return (x.device.type == "cpu" and x.dtype != torch.float32 and x.shape[0] <= ABSORB_FP32_MAX_TOKENS
                and not torch.compiler.is_compiling())

    def _absorb_q(self, q_nope: torch.Tensor) -> torch.Tensor:
        """[T, NH, N] -> ``q_nope @ W_UK`` [T, NH, R] in q_nope's dtype (fp32 accumulation either way)."""
        w_uk, _ = self.absorbed_weights()
        if self._fp32_absorption(q_nope):
            w = self.derived.get("w_uk_fp32", self.kv_b_proj, lambda _: w_uk.float().contiguous())  # [NH, N, R]
            return torch.bmm(q_nope.transpose(0, 1).float(), w).transpose(0, 1).to(q_nope.dtype)
        return torch.einsum("thn,hnr->thr", q_nope, w_uk)

    def _absorb_out(self, latent: torch.Tensor) -> torch.Tensor:
        """[T, NH, R] -> ``latent @ W_UV.T`` [T, NH, V] in latent's dtype."""
        _, w_uv = self.absorbed_weights()
        if self._fp32_absorption(latent):
            w = self.derived.get("w_uv_t_fp32", self.kv_b_proj,
                                 lambda _: w_uv.float().transpose(1, 2).contiguous())  # [NH, R, V]
            return torch.bmm(latent.transpose(0, 1).float(), w).transpose(0, 1).to(latent.dtype)
        return torch.einsum("thr,hvr->thv", latent, w_uv)

    def forward(self, x, positions, batch: AttentionBatch, kv_cache, cos_sin_cache):
        c = self.config
        num_tokens = x.shape[0]
        if c.q_lora_rank is None:
            q = _linear(self, "q_proj", x)
        else:
            q = _linear(self, "q_b_proj", ops.rms_norm(_linear(self, "q_a_proj", x), self.q_a_layernorm,
                                                       LATENT_NORM_EPS))
        q = q.view(num_tokens, c.num_attention_heads, c.qk_head_dim)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        kv_c, k_pe = _linear(self, "kv_a_proj_with_mqa", x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        kv_c = ops.rms_norm(kv_c, self.kv_a_layernorm, LATENT_NORM_EPS)
        # values (positions, slots, lengths) were checked once per step by KimiK2ForCausalLM.plan
        if self.rope:
            q_pe = ops.rope_interleaved(q_pe, positions, cos_sin_cache, validate=False)
            k_pe = ops.rope_interleaved(k_pe, positions, cos_sin_cache, validate=False)
        ops.concat_and_cache_mla(kv_c, k_pe, kv_cache, batch.slot_mapping, validate=False)

        q_abs = torch.cat([self._absorb_q(q_nope), q_pe], dim=-1)
        latent = q_abs.new_empty(num_tokens, c.num_attention_heads, c.kv_lora_rank)
        npf = batch.num_prefill_tokens
        if npf:
            ops.mla_extend_run(q_abs[:npf], kv_cache, batch.extend_plan, c.sm_scale, out=latent[:npf])
        if batch.num_decode_tokens:
            ops.mla_decode_run(q_abs[npf:], kv_cache, batch.decode_plan, c.sm_scale, out=latent[npf:])
        attn = self._absorb_out(latent).reshape(num_tokens, -1)
        if self.output_gate:
            attn = attn * torch.sigmoid(_linear(self, "g_proj", x))
        return _linear(self, "o_proj", attn)


class DenseMLP(nn.Module):
    """SiLU-gated MLP with fused ``gate_up_proj`` [2I, H] (gate rows first) and ``down_proj`` [H, I],
    held in ``fmt`` (see :func:`_weight`). ``activation`` ([T, 2I] -> [T, I]) replaces
    :func:`kvtier.ops.silu_and_mul` (the hybrid models' SiTU-GLU)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, fmt: str = DENSE,
                 formats: WeightFormats = DEFAULT_FORMATS, backend: str = "auto", activation=None):
        super().__init__()
        self.formats, self.fmt, self.backend = formats, fmt, backend
        self.derived = _cpu_linear.DerivedWeights()  # CPU copies of the weights (see _linear)
        self.activation = activation or ops.silu_and_mul
        _weight(self, "gate_up_proj", (2 * intermediate_size, hidden_size), fmt, formats, dtype)
        _weight(self, "down_proj", (hidden_size, intermediate_size), fmt, formats, dtype)

    def forward(self, x):
        return _linear(self, "down_proj", self.activation(_linear(self, "gate_up_proj", x)))


class MoE(nn.Module):
    """noaux_tc-routed experts (w13 [E, 2I, H], w2 [E, H, I], held in ``formats.routed_experts``:
    see :func:`_weight`) plus shared experts (``formats.shared_experts``)."""

    def __init__(self, config: KimiK2Config, dtype: torch.dtype, backend: str = "auto",
                 formats: WeightFormats = DEFAULT_FORMATS):
        super().__init__()
        c = config
        self.config = c
        self.backend = backend  # of moe_route and fused_moe
        self.formats, self.fmt = formats, formats.routed_experts
        self.derived = _cpu_linear.DerivedWeights()  # fp32 copies of the experts for the CPU kernel (experts)
        self.gate_weight = _param(c.n_routed_experts, c.hidden_size, dtype=torch.float32)
        self.e_score_correction_bias = _param(c.n_routed_experts, dtype=torch.float32)
        e, i, h = c.n_routed_experts, c.moe_intermediate_size, c.hidden_size
        _weight(self, "w13", (e, 2 * i, h), self.fmt, formats, dtype)
        _weight(self, "w2", (e, h, i), self.fmt, formats, dtype)
        self.shared_experts = (
            DenseMLP(h, i * c.n_shared_experts, dtype, formats.shared_experts, formats, backend)
            if c.n_shared_experts else None
        )

    def experts(self, x, weights, ids):
        """The routed experts' mixture on the format's fused-MoE op."""
        if self.fmt == DENSE:
            w13, w2 = self.w13, self.w2
            if x.device.type == "cpu" and w13.dtype != torch.float32 and not torch.compiler.is_compiling():
                # the CPU kernel computes in fp32: upcast once here, not per call (kvtier.ops._cpu_moe)
                w13 = self.derived.get("w13_fp32", w13, lambda w: w.float())
                w2 = self.derived.get("w2_fp32", w2, lambda w: w.float())
            return ops.fused_moe(x, w13, w2, weights, ids, validate=False, backend=self.backend)
        if self.fmt == FP8:
            return ops.fused_moe_fp8_block(x, self.w13, self.w13_scale_inv, self.w2, self.w2_scale_inv, weights, ids,
                                           self.formats.block_size, validate=False, backend=self.backend)
        return ops.fused_moe_w4a16(x, self.w13_packed, self.w13_scale, self.w2_packed, self.w2_scale, weights, ids,
                                   self.formats.group_size, validate=False, backend=self.backend)

    def forward(self, x):
        c = self.config
        router_logits = F.linear(x.float(), self.gate_weight)
        weights, ids = ops.moe_route(router_logits, self.e_score_correction_bias, c.num_experts_per_tok,
                                     c.n_group, c.topk_group, c.routed_scaling_factor, c.norm_topk_prob,
                                     backend=self.backend)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: KimiK2Config, layer_idx: int, dtype: torch.dtype,
                 formats: WeightFormats = DEFAULT_FORMATS):
        super().__init__()
        self.eps = config.rms_norm_eps
        self.input_layernorm = _param(config.hidden_size, dtype=dtype)
        self.post_attention_layernorm = _param(config.hidden_size, dtype=dtype)
        self.self_attn = MLAttention(config, dtype, formats)
        self.mlp = (MoE(config, dtype, formats=formats) if config.is_moe_layer(layer_idx)
                    else DenseMLP(config.hidden_size, config.intermediate_size, dtype, formats.dense_mlp, formats))

    def forward(self, x, positions, batch, kv_cache, cos_sin_cache):
        h = self.self_attn(ops.rms_norm(x, self.input_layernorm, self.eps), positions, batch, kv_cache, cos_sin_cache)
        x = x + h
        return x + self.mlp(ops.rms_norm(x, self.post_attention_layernorm, self.eps))


class KimiK2ForCausalLM(nn.Module):
    """The whole model. Parameters are allocated empty; fill them with :mod:`kvtier.model.loader`.

    ``backend`` (``"auto"|"torch"|"triton"|...``, see :mod:`kvtier.ops`) selects the kernels of the
    paged attention ops (mla_extend, mla_decode), of the routed experts (moe_route, fused_moe and
    its quantized variants) and of the quantized linear layers; the engine samples on it too.
    :meth:`set_backend` changes it on a built model.

    ``formats`` says which weight classes are held FP8 block-scaled or INT4 group-scaled
    (:class:`kvtier.model.formats.WeightFormats`; default: all dense in ``dtype``). ``dtype`` is
    the compute (activation) dtype and that of every dense weight.

    Raises:
        ValueError: ``config``'s shapes cannot be held in ``formats`` (see WeightFormats.check).
    """

    def __init__(self, config: KimiK2Config, dtype: torch.dtype = torch.float32, backend: str = "auto",
                 formats: WeightFormats | None = None):
        super().__init__()
        formats = formats or WeightFormats()
        formats.check(config)
        self.config = config
        self.dtype = dtype
        self.formats = formats
        self.embed_tokens = _param(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype, formats) for i in range(config.num_hidden_layers))
        self.norm = _param(config.hidden_size, dtype=dtype)
        self.lm_head = _param(config.vocab_size, config.hidden_size, dtype=dtype)
        self.register_buffer("cos_sin_cache", build_cos_sin_cache(config), persistent=False)
        self.set_backend(backend)

    def set_backend(self, backend: str) -> None:
        """Run the paged attention, MoE and quantized linear ops of every layer on ``backend``
        (checked at the next forward)."""
        self.backend = backend
        for module in self.modules():  # attention: the step's plans carry the backend
            if module is not self and hasattr(module, "backend"):
                module.backend = backend

    def cache_spec(self) -> CacheSpec:
        """What this model caches per sequence: KV pages in every layer (``[.., kv_cache_dim]`` rows
        in the compute dtype), no recurrent state."""
        return self.config.cache_spec(self.dtype)

    def plan(self, positions: torch.Tensor, batch: AttentionBatch, kv_caches: list[torch.Tensor], *,
             decode_max_seq_len: int | None = None) -> AttentionBatch:
        """Check one step's metadata and plan its attention, once for all layers (one host read of
        positions, slot_mapping and the lengths each).

        Args:
            positions: [T] int64 positions of the step's tokens.
            batch: the step's metadata (unplanned).
            kv_caches: the per-layer caches the step runs on (one shape).
            decode_max_seq_len: plan the decode split for this many tokens instead of the step's
                longest sequence (a captured CUDA graph replays any lengths up to it).

        Returns:
            A copy of ``batch`` with ``decode_plan``/``extend_plan`` set and ``planned`` True;
            :meth:`forward` on it reads no device value on the host.

        Raises:
            ValueError: a position past the rope table, a slot outside the caches, lengths beyond a
                block_table's capacity, or caches of different shapes.
        """
        c = self.config
        cache = kv_caches[0]
        for i, other in enumerate(kv_caches):
            if other.shape != cache.shape:
                raise ValueError(f"kv_caches[{i}] must have kv_caches[0]'s shape {tuple(cache.shape)}, "
                                 f"got {tuple(other.shape)}")
        ops.check_positions(positions, self.cos_sin_cache.shape[0])
        ops.check_slot_mapping(batch.slot_mapping, cache.shape[0] * cache.shape[1])
        return batch.with_plans(cache, c.num_attention_heads, c.kv_lora_rank, self.backend, decode_max_seq_len)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Run every layer; returns the final-normed hidden states [T, H].

        Args:
            input_ids: [T] int64 token ids (< vocab_size).
            positions: [T] int64 positions (< max_position_embeddings).
            batch: slot mapping, page tables and lengths of this step; planned by :meth:`plan`
                here when it is not yet (a planned batch makes the forward free of host reads,
                so ``torch.compile(fullgraph=True)`` and CUDA graphs take it whole).
            kv_caches: num_hidden_layers tensors [num_pages, page_size, R + P].
        """
        if not batch.planned:
            batch = self.plan(positions, batch, kv_caches)
        x = F.embedding(input_ids, self.embed_tokens)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, positions, batch, kv_cache, self.cos_sin_cache)
        return ops.rms_norm(x, self.norm, self.config.rms_norm_eps)

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
             kv_caches: list[torch.Tensor], state: None = None, state_batch: None = None) -> tuple[torch.Tensor, None]:
        """``(hidden [T, H], None)``: :meth:`forward` in the step signature of every model
        (:class:`kvtier.model.step.StepModel`); K2 keeps no recurrent state, so it takes
        ``state`` and ``state_batch`` as None and yields no checkpoints.

        Raises:
            ValueError: ``state`` or ``state_batch`` given.
        """
        if state is not None or state_batch is not None:
            raise ValueError("state and state_batch must be None for an attention-only model (no recurrent state)")
        return self(input_ids, positions, batch, kv_caches), None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, H] hidden states -> [n, vocab_size] fp32 logits (few fp32 rows on the CPU: see
        :func:`few_rows_linear`; 2 to ``FEW_ROWS`` bf16 rows on the CPU: the tall-skinny product
        ``lm_head @ hidden.T``, which streams the weight once, 1.4-1.7x faster than ``F.linear``
        for 2-8 rows of K2's vocabulary at hidden 256, measured with torch 2.13 on 2 cores; one
        bf16 row: ``torch.mv``, 6.9 against 12.6 ms on one core, equal to ``F.linear``'s)."""
        if (hidden.device.type == "cpu" and hidden.dtype == self.lm_head.dtype and 0 < hidden.shape[0] <= FEW_ROWS
                and not torch.compiler.is_compiling()):
            if hidden.dtype == torch.float32:
                return few_rows_linear(hidden, self.lm_head)
            if hidden.dtype == torch.bfloat16 and hidden.shape[0] > 1:
                return torch.mm(self.lm_head, hidden.T).T.to(torch.float32, memory_format=torch.contiguous_format)
            if hidden.dtype == torch.bfloat16:  # one row: the matrix-vector product, 1.8x faster than F.linear
                return torch.mv(self.lm_head, hidden[0]).float()[None]
        return F.linear(hidden, self.lm_head).float()


FEW_ROWS = 16
"""Rows up to which :meth:`KimiK2ForCausalLM.compute_logits` takes :func:`few_rows_linear` on
the CPU (above it ``F.linear`` is as fast)."""
VOCAB_CHUNK = 16384
"""Weight rows per GEMM in :func:`few_rows_linear`: a chunk's ``[VOCAB_CHUNK, n]`` result stays
in the core's cache for the transposed copy."""


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for a few rows on the CPU: the LM head of a decode step.

    For ``n`` rows of ``x`` against a tall ``weight`` (the vocabulary), the CPU BLAS that
    ``F.linear`` reaches runs the ``[n, K] x [K, V]`` product far below the memory bandwidth
    (measured with torch 2.13 on 2 cores, K=128, V=163840: 7.5-11 ms for 1-8 rows), while the
    transposed product ``weight @ x.T``, a tall-skinny GEMM, streams the weight once (2-4 ms,
    with a single row padded to two: a matrix-vector product takes the slow path again). This
    computes it in ``VOCAB_CHUNK`` slices of ``weight``, each transposed into the output while
    it is in cache. Same result as ``F.linear(x, weight)`` up to fp32 rounding (another
    summation order; ``F.linear`` itself varies as much with ``n``).

    Args:
        x: [n, K] with n >= 1.
        weight: [V, K], same dtype and device as ``x``.

    Returns:
        [n, V] contiguous, ``x``'s dtype.

    Raises:
        ValueError: ``x`` or ``weight`` is not 2-D, ``x`` has no row, the K dims differ, or
            the dtypes or devices differ.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[0] < 1 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"few_rows_linear: expected x [n >= 1, K] and weight [V, K], got x {tuple(x.shape)} "
                         f"and weight {tuple(weight.shape)}")
    if x.dtype != weight.dtype or x.device != weight.device:
        raise ValueError(f"few_rows_linear: x ({x.dtype}, {x.device}) and weight ({weight.dtype}, {weight.device}) "
                         "must share dtype and device")
    n, vocab = x.shape[0], weight.shape[0]
    x_t = (x if n > 1 else x.repeat(2, 1)).t()  # two real columns: a GEMM, not a GEMV
    out = torch.empty(n, vocab, dtype=x.dtype, device=x.device)
    for start in range(0, vocab, VOCAB_CHUNK):
        end = min(vocab, start + VOCAB_CHUNK)
        out[:, start:end].copy_(torch.mm(weight[start:end], x_t)[:, :n].t())
    return out
