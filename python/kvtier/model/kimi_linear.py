"""The hybrid Kimi models (Kimi-Linear, Kimi K3): KDA and MLA layers over paged KV and state slots.

Shape legend: T tokens in the step, H hidden_size, NK KDA heads, D KDA head_dim, P = NK * D,
W conv kernel, E routed experts, L the latent MoE width.

A step's tokens are ordered as in :class:`kvtier.model.AttentionBatch` (extend tokens first,
then one per decoding sequence). The MLA layers run the K2 model's weight-absorbed paged MLA
(:class:`kvtier.model.kimi_k2.MLAttention` with ``rope=False``); the KDA layers read and write
each sequence's state slot (:class:`kvtier.model.state_slots.StateSlots`) through the KDA ops
(:mod:`kvtier.ops.kda`, or its reference :mod:`kvtier.reference.kda` where the ops are absent).

Sources of the formulas: transformers' ``KimiLinearForCausalLM`` (KDA layer, NoPE MLA, MoE; the
parity reference), and for the K3-only parts the vllm package's ``vllm/models/kimi_k3/amd/linear.py``
(latent MoE, attention residuals, MLA output gate), ``vllm/models/kimi_k3/amd/kda.py`` (full-rank
output gate, gate lower bound) and ``vllm/model_executor/layers/activation.py`` (SiTU-GLU).
"""

from __future__ import annotations

import importlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from kvtier import ops
from kvtier.model.batch import AttentionBatch
from kvtier.model.cache_spec import CacheSpec
from kvtier.model.kimi_k2 import FEW_ROWS, DenseMLP, MLAttention, _param, few_rows_linear
from kvtier.model.kimi_linear_config import KimiLinearConfig
from kvtier.model.state_slots import STATE_DTYPE, StateBatch, StateCheckpoints, StateSlots

SOFTPLUS_THRESHOLD = 20.0  # softplus(x) = x above it (transformers' and the KDA kernels' form)


def kda_ops():
    """``(module, takes_backend)``: :mod:`kvtier.ops.kda` when it exists, else the fp32 references."""
    try:
        return importlib.import_module("kvtier.ops.kda"), True
    except ImportError:
        return importlib.import_module("kvtier.reference.kda"), False


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32, or in its own dtype when that is wider (fp64 in tests)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


# ---- the K3-only pieces, as plain functions (tests check each against its formula) ------------------
def situ_and_mul(x: torch.Tensor, beta: float | None, linear_beta: float | None) -> torch.Tensor:
    """SiTU-GLU: ``beta * tanh(gate / beta) * sigmoid(gate) * up'`` with ``up' = linear_beta *
    tanh(up / linear_beta)`` (``up`` itself when ``linear_beta`` is None); ``beta`` None means 1.

    Source: vllm ``model_executor/layers/activation.py`` (``SituAndMul``), used by
    ``vllm/models/kimi_k3`` for ``hidden_act: situ``.

    Args:
        x: [..., 2I], gate half first. Returns [..., I] in x's dtype (fp32 math).
    """
    b = 1.0 if beta is None else float(beta)
    gate, up = _wide(x).chunk(2, dim=-1)
    gate = b * torch.tanh(gate / b) * torch.sigmoid(gate)
    if linear_beta is not None:
        up = float(linear_beta) * torch.tanh(up / float(linear_beta))
    return (gate * up).to(x.dtype)


def attn_res_mix(sources: list[torch.Tensor], norm_weight: torch.Tensor, proj_weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """Attention residuals: a softmax over the block sources with one learned query per layer.

    ``logit_s = proj_weight . rms_norm(v_s, norm_weight)``, ``out = sum_s softmax(logit)_s * v_s``
    (the values are the unnormalised sources). Source: vllm ``vllm/models/kimi_k3/amd/ops/attn_res.py``
    and ``amd/linear.py`` (``_apply_attn_res``); Kimi K3 report (arXiv 2607.24653).

    Args:
        sources: S tensors [T, H] (the committed blocks, then the running partial block).
        norm_weight, proj_weight: [H].
    Returns:
        [T, H] in the sources' dtype (fp32 math).
    """
    v = torch.stack([_wide(s) for s in sources])  # [S, T, H]
    normed = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.to(v.dtype)
    weights = torch.softmax(normed @ proj_weight.to(v.dtype), dim=0)  # [S, T]
    return (weights[..., None] * v).sum(0).to(sources[0].dtype)


def kda_gate(f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """Per-channel log decay ``g <= 0`` of a KDA layer, fp32 [T, NK, D].

    ``lower_bound * sigmoid(exp(A_log) * (f + dt_bias))`` with a lower bound (K3; vllm
    ``vllm/models/kimi_k3/amd/ops/third_party/kda/fused_recurrent.py``), else
    ``-exp(A_log) * softplus(f + dt_bias)`` (transformers' ``KimiLinearForgetGate``).

    Args:
        f: [T, NK * D] the gate projection; a_log: [NK]; dt_bias: [NK * D].
    """
    num_heads = a_log.numel()
    x = (f.float() + dt_bias.float()).view(f.shape[0], num_heads, -1)
    a = a_log.float().exp().view(1, num_heads, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * x)
    return -a * F.softplus(x, threshold=SOFTPLUS_THRESHOLD)


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm(x) * weight * sigmoid(gate)`` over the last dim, in fp32; returns x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * torch.sigmoid(gate.float())).to(x.dtype)


# ---- layers -----------------------------------------------------------------------------------------
class KDAttention(nn.Module):
    """One Kimi Delta Attention layer: q/k/v projections, causal short conv (SiLU) over them, l2-normed
    q/k, per-channel gated delta rule with beta, gated RMSNorm on the output, ``o_proj``.

    Parameters (dense, ``dtype``): q_proj/k_proj/v_proj [P, H], conv_weight [3P, W] (q, k, v rows),
    f_a_proj [D, H], f_b_proj [P, D], dt_bias [P] fp32, A_log [NK] fp32, b_proj [NK, H], the output
    gate g_proj [P, H] (full rank) or g_a_proj [D, H] + g_b_proj [P, D], o_norm [D], o_proj [H, P].
    """

    def __init__(self, config: KimiLinearConfig, dtype: torch.dtype, backend: str = "auto"):
        super().__init__()
        c = config
        self.config, self.backend = c, backend
        h, p, d, nk = c.hidden_size, c.kda_projection_size, c.linear_head_dim, c.linear_num_heads
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(self, name, _param(p, h, dtype=dtype))
        self.conv_weight = _param(3 * p, c.short_conv_kernel_size, dtype=dtype)
        self.f_a_proj, self.f_b_proj = _param(d, h, dtype=dtype), _param(p, d, dtype=dtype)
        self.dt_bias, self.A_log = _param(p, dtype=torch.float32), _param(nk, dtype=torch.float32)
        self.b_proj = _param(nk, h, dtype=dtype)
        if c.use_full_rank_gate:
            self.g_proj = _param(p, h, dtype=dtype)
        else:
            self.g_a_proj, self.g_b_proj = _param(d, h, dtype=dtype), _param(p, d, dtype=dtype)
        self.o_norm = _param(d, dtype=dtype)
        self.o_proj = _param(h, p, dtype=dtype)

    def _call(self, fn: str, *args, **kwargs):
        module, takes_backend = kda_ops()
        return getattr(module, fn)(*args, **kwargs, **({"backend": self.backend} if takes_backend else {}))

    def forward(self, x: torch.Tensor, batch: AttentionBatch, sb: StateBatch, recurrent: torch.Tensor,
                conv_state: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """x [T, H] -> ([T, H], checkpoints or None); ``recurrent`` [slots, NK, D, D] and
        ``conv_state`` [slots, 3P, W-1] are this layer's slot tensors, updated at the step's slots.
        Checkpoints: (recurrent [n, NK, D, D] fp32, conv windows [n, 3P, W-1])."""
        c = self.config
        t, npf = x.shape[0], batch.num_prefill_tokens
        nk, d = c.linear_num_heads, c.linear_head_dim
        mixed = torch.cat([F.linear(x, self.q_proj), F.linear(x, self.k_proj), F.linear(x, self.v_proj)], dim=-1)
        y = torch.empty_like(mixed)
        ckpt_conv = None
        if npf:
            slots, cu = sb.prefill_slots.long(), batch.prefill_cu_seqlens_q
            start_conv = conv_state[slots]
            y[:npf], final_conv = self._call("causal_conv1d_prefill", mixed[:npf].contiguous(), self.conv_weight,
                                             None, start_conv, cu, activation="silu")
            conv_state[slots] = final_conv.to(conv_state.dtype)
            if sb.num_checkpoints:
                ckpt_conv = _conv_windows(mixed[:npf], start_conv, cu, sb, c.short_conv_kernel_size)
        if npf < t:
            y[npf:] = self._call("causal_conv1d_update", mixed[npf:].contiguous(), self.conv_weight, None,
                                 conv_state, sb.decode_slots, activation="silu")
        q, k, v = (z.reshape(t, nk, d) for z in y.split(c.kda_projection_size, dim=-1))
        g = kda_gate(F.linear(F.linear(x, self.f_a_proj), self.f_b_proj), self.A_log, self.dt_bias,
                     c.gate_lower_bound)
        beta = torch.sigmoid(F.linear(x, self.b_proj).float())
        o = x.new_empty(t, nk, d)
        ckpts = None
        if npf:
            out, final, states = self._call(
                "kda_chunk_prefill", q[:npf], k[:npf], v[:npf], g[:npf], beta[:npf], recurrent[slots].float(), cu,
                use_qk_l2norm=True, checkpoint_seq=sb.checkpoint_seq, checkpoint_len=sb.checkpoint_len)
            o[:npf] = out
            recurrent[slots] = final.to(recurrent.dtype)
            if sb.num_checkpoints:
                ckpts = (states, ckpt_conv)
        if npf < t:
            o[npf:] = self._call("kda_recurrent_decode", q[npf:], k[npf:], v[npf:], g[npf:], beta[npf:], recurrent,
                                 sb.decode_slots, use_qk_l2norm=True)
        gate = (F.linear(x, self.g_proj) if c.use_full_rank_gate
                else F.linear(F.linear(x, self.g_a_proj), self.g_b_proj))
        o = gated_rms_norm(o, self.o_norm, gate.view(t, nk, d), c.rms_norm_eps)
        return F.linear(o.reshape(t, -1), self.o_proj), ckpts


def _conv_windows(x: torch.Tensor, start: torch.Tensor, cu: torch.Tensor, sb: StateBatch, width: int) -> torch.Tensor:
    """The conv window (last W - 1 inputs, oldest first) of each checkpoint row: [n, dim, W-1]."""
    bounds = cu.tolist()
    rows = []
    for seq, length in zip(sb.checkpoint_seq.tolist(), sb.checkpoint_len.tolist(), strict=True):
        seen = torch.cat([start[seq].to(x.dtype), x[bounds[seq]: bounds[seq] + length].transpose(0, 1)], dim=1)
        rows.append(seen[:, seen.shape[1] - (width - 1):])
    return torch.stack(rows).to(start.dtype)


class HybridMoE(nn.Module):
    """noaux_tc-routed experts plus shared experts; with ``routed_expert_hidden_size`` (latent MoE) the
    routed experts run at width L: ``up(norm?(experts(down(x))))`` (vllm
    ``vllm/models/kimi_k3/amd/linear.py``, ``KimiMoE``; the router and shared experts see x).

    Parameters: gate_weight [E, H] fp32, e_score_correction_bias [E] fp32, w13 [E, 2I, L], w2 [E, L, I],
    and for the latent MoE routed_expert_down_proj [L, H], routed_expert_norm [L], routed_expert_up_proj [H, L].
    """

    def __init__(self, config: KimiLinearConfig, dtype: torch.dtype, activation, backend: str = "auto"):
        super().__init__()
        c = config
        self.config, self.backend, self.activation = c, backend, activation
        e, i, h, lat = c.n_routed_experts, c.moe_intermediate_size, c.hidden_size, c.moe_hidden_size
        self.gate_weight = _param(e, h, dtype=torch.float32)
        self.e_score_correction_bias = _param(e, dtype=torch.float32)
        self.w13, self.w2 = _param(e, 2 * i, lat, dtype=dtype), _param(e, lat, i, dtype=dtype)
        if c.routed_expert_hidden_size is not None:
            self.routed_expert_down_proj = _param(lat, h, dtype=dtype)
            self.routed_expert_up_proj = _param(h, lat, dtype=dtype)
            if c.latent_moe_use_norm:
                self.routed_expert_norm = _param(lat, dtype=dtype)
        self.shared_experts = (DenseMLP(h, i * c.n_shared_experts, dtype, backend=backend, activation=activation)
                               if c.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        weights, ids = ops.moe_route(F.linear(x.float(), self.gate_weight), self.e_score_correction_bias,
                                     c.num_experts_per_tok, c.n_group, c.topk_group, c.routed_scaling_factor,
                                     c.norm_topk_prob, backend=self.backend)
        latent = c.routed_expert_hidden_size is not None
        xr = F.linear(x, self.routed_expert_down_proj) if latent else x
        act = {} if c.hidden_act == "silu" else {"activation": c.hidden_act, "situ_beta": c.activation_situ_beta or 1.0,
                                                  "situ_linear_beta": c.activation_situ_linear_beta}
        if getattr(self, "w13_packed", None) is not None:  # MXFP4 experts kept packed (kimi_linear_loader)
            out = ops.fused_moe_mxfp4(xr, self.w13_packed, self.w13_scale, self.w2_packed, self.w2_scale, weights, ids,
                                      validate=False, backend=self.backend, **act)
        else:
            out = ops.fused_moe(xr, self.w13, self.w2, weights, ids, validate=False, backend=self.backend, **act)
        if latent:
            if c.latent_moe_use_norm:
                out = ops.rms_norm(out, self.routed_expert_norm, c.rms_norm_eps)
            out = F.linear(out, self.routed_expert_up_proj)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class HybridDecoderLayer(nn.Module):
    """Norms, a KDA or NoPE-MLA attention, a dense MLP or MoE, and (K3) the attention-residual
    queries ``self_attention_res_{norm,proj}`` and ``mlp_res_{norm,proj}`` ([H] each)."""

    def __init__(self, config: KimiLinearConfig, layer_idx: int, dtype: torch.dtype, backend: str = "auto"):
        super().__init__()
        c = config
        self.is_kda = c.is_kda_layer(layer_idx)
        act = (lambda x: situ_and_mul(x, c.activation_situ_beta, c.activation_situ_linear_beta)) \
            if c.hidden_act == "situ" else None
        self.input_layernorm = _param(c.hidden_size, dtype=dtype)
        self.post_attention_layernorm = _param(c.hidden_size, dtype=dtype)
        self.self_attn = (KDAttention(c, dtype, backend) if self.is_kda
                          else MLAttention(c, dtype, backend=backend, rope=False, output_gate=c.mla_use_output_gate))
        self.mlp = (HybridMoE(c, dtype, act or ops.silu_and_mul, backend) if c.is_moe_layer(layer_idx)
                    else DenseMLP(c.hidden_size, c.intermediate_size, dtype, backend=backend, activation=act))
        if c.attn_res_block_size is not None:
            for name in ("self_attention_res_norm", "self_attention_res_proj", "mlp_res_norm", "mlp_res_proj"):
                setattr(self, name, _param(c.hidden_size, dtype=dtype))


class KimiLinearForCausalLM(nn.Module):
    """The hybrid model (``kimi_linear`` / ``kimi_k3`` text). Parameters are allocated empty; fill
    them with :func:`kvtier.model.kimi_linear_loader.load_hybrid_model` or a loader of your own.

    The step interface, for an engine:

    1. Own a page pool for the MLA layers (``len(config.full_attn_layers)`` caches
       ``[num_pages, page_size, kv_lora_rank + qk_rope_head_dim]``, addressed as for K2) and a
       :class:`StateSlots` pool beside it; allocate a slot when a sequence starts, free it when it ends.
    2. Per step build the :class:`AttentionBatch` (as for K2) and a :class:`StateBatch` with each
       sequence's slot (and, optionally, the token boundaries whose states to hand back).
    3. ``hidden, checkpoints = model.step(input_ids, positions, batch, kv_caches, state, state_batch)``
       (the step signature of every model, :class:`kvtier.model.step.StepModel`: the states at the
       boundaries ``state_batch`` names come back beside the hidden states), then :meth:`compute_logits`.

    Positions are not used by the layers (no rope) but are checked like K2's.
    """

    def __init__(self, config: KimiLinearConfig, dtype: torch.dtype = torch.float32, backend: str = "auto"):
        super().__init__()
        c = config
        self.config, self.dtype, self.backend = c, dtype, backend
        self.embed_tokens = _param(c.vocab_size, c.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(HybridDecoderLayer(c, i, dtype, backend) for i in range(c.num_hidden_layers))
        self.norm = _param(c.hidden_size, dtype=dtype)
        self.lm_head = _param(c.vocab_size, c.hidden_size, dtype=dtype)
        if c.attn_res_block_size is not None:
            self.output_attn_res_norm = _param(c.hidden_size, dtype=dtype)
            self.output_attn_res_proj = _param(c.hidden_size, dtype=dtype)

    def set_backend(self, backend: str) -> None:
        """Run the MoE, paged attention and KDA ops of every layer on ``backend``."""
        self.backend = backend
        for module in self.modules():
            if module is not self and hasattr(module, "backend"):
                module.backend = backend

    def cache_spec(self) -> CacheSpec:
        """What this model caches per sequence: KV pages in its MLA layers (``[.., kv_cache_dim]``
        rows in the compute dtype) and one KDA state (fp32 recurrent states, conv windows in the
        compute dtype: :class:`StateSlots`' layout), checkpointed at page boundaries."""
        return self.config.cache_spec(self.dtype, STATE_DTYPE.itemsize)

    def plan(self, positions: torch.Tensor, batch: AttentionBatch, kv_caches: list[torch.Tensor], *,
             decode_max_seq_len: int | None = None) -> AttentionBatch:
        """Check the step's positions and slot mapping and plan the MLA layers' paged attention once
        for all of them (as :meth:`kvtier.model.KimiK2ForCausalLM.plan`, same arguments). Raises
        ValueError as that does, or when ``kv_caches`` is not one cache per MLA layer."""
        c = self.config
        if len(kv_caches) != len(c.full_attn_layers):
            raise ValueError(f"kv_caches must hold one cache per MLA layer ({len(c.full_attn_layers)}), "
                             f"got {len(kv_caches)}")
        cache = kv_caches[0]
        ops.check_positions(positions, c.max_position_embeddings)
        ops.check_slot_mapping(batch.slot_mapping, cache.shape[0] * cache.shape[1])
        return batch.with_plans(cache, c.num_attention_heads, c.kv_lora_rank, self.backend, decode_max_seq_len)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv_caches: list[torch.Tensor], state: StateSlots, state_batch: StateBatch) -> torch.Tensor:
        """:meth:`step`'s hidden states [T, H] alone."""
        return self.step(input_ids, positions, batch, kv_caches, state, state_batch)[0]

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
             kv_caches: list[torch.Tensor], state: StateSlots | None = None, state_batch: StateBatch | None = None
             ) -> tuple[torch.Tensor, StateCheckpoints | None]:
        """Run every layer; returns ``(hidden, checkpoints)``: the final-normed hidden states [T, H]
        and the KDA states at ``state_batch``'s checkpoint boundaries (:class:`StateCheckpoints`,
        None when it names none). The step signature of every model (:class:`kvtier.model.step.StepModel`).

        Args:
            input_ids: [T] int64 token ids. positions: [T] int64 (unused by the layers).
            batch: the step's paged-attention metadata (planned here if not yet).
            kv_caches: one [num_pages, page_size, R + P] cache per MLA layer, in layer order.
            state: the slot pool; the step's slots are read and updated in place.
            state_batch: each sequence's slot and the boundaries whose states to hand back.

        Raises:
            ValueError: ``state`` or ``state_batch`` is None (a hybrid model needs its slots).
        """
        if state is None or state_batch is None:
            raise ValueError("state and state_batch are required for a hybrid model (its KDA state slots), got None")
        c = self.config
        if not batch.planned:
            batch = self.plan(positions, batch, kv_caches)
        x = F.embedding(input_ids, self.embed_tokens)
        kv = iter(kv_caches)
        kda_i = 0
        ckpts: list[tuple[torch.Tensor, torch.Tensor]] = []

        def attend(layer, h):
            nonlocal kda_i
            if not layer.is_kda:
                return layer.self_attn(h, positions, batch, next(kv), None)
            out, ck = layer.self_attn(h, batch, state_batch, state.recurrent[kda_i], state.conv[kda_i])
            kda_i += 1
            if ck is not None:
                ckpts.append(ck)
            return out

        eps = c.rms_norm_eps
        if c.attn_res_block_size is None:
            for layer in self.layers:
                x = x + attend(layer, ops.rms_norm(x, layer.input_layernorm, eps))
                x = x + layer.mlp(ops.rms_norm(x, layer.post_attention_layernorm, eps))
        else:
            x = self._attn_res_layers(x, attend)
        hidden = ops.rms_norm(x, self.norm, eps)
        if not ckpts:
            return hidden, None
        return hidden, StateCheckpoints(torch.stack([r for r, _ in ckpts]), torch.stack([w for _, w in ckpts]))

    def _attn_res_layers(self, x: torch.Tensor, attend) -> torch.Tensor:
        """The layers with attention residuals (K3): every ``attn_res_block_size`` layers the running
        block sum is committed as a source; each attention and MLP input is the softmax mix
        (:func:`attn_res_mix`) of the committed blocks and the running block, normed; each output is
        added to the running block; the model's output is the mix over all of them."""
        c = self.config
        eps, size = c.rms_norm_eps, c.attn_res_block_size
        blocks: list[torch.Tensor] = []
        partial: torch.Tensor | None = x  # the embeddings open the first block
        for i, layer in enumerate(self.layers):
            if i % size == 0:
                blocks.append(partial)
                partial = None
            sources = blocks if partial is None else [*blocks, partial]
            h = attn_res_mix(sources, layer.self_attention_res_norm, layer.self_attention_res_proj, eps)
            a = attend(layer, ops.rms_norm(h, layer.input_layernorm, eps))
            partial = a if partial is None else partial + a
            h = attn_res_mix([*blocks, partial], layer.mlp_res_norm, layer.mlp_res_proj, eps)
            partial = partial + layer.mlp(ops.rms_norm(h, layer.post_attention_layernorm, eps))
        return attn_res_mix([*blocks, partial], self.output_attn_res_norm, self.output_attn_res_proj, eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, H] hidden states -> [n, vocab_size] fp32 logits."""
        if (hidden.device.type == "cpu" and hidden.dtype == torch.float32 and self.lm_head.dtype == torch.float32
                and 0 < hidden.shape[0] <= FEW_ROWS):
            return few_rows_linear(hidden, self.lm_head)
        return F.linear(hidden, self.lm_head).float()


def random_hybrid_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """fp32 values for random weights: norms near 1, routing bias near 0, ``A_log`` = log of
    U(1, 16), ``dt_bias`` the inverse softplus of U(1e-3, 1e-1) (the FLA initialisation), linear and
    conv weights ~ N(0, 1/fan_in)."""
    if name.endswith("A_log"):
        return (1.0 + 15.0 * torch.rand(shape, generator=gen)).log()
    if name.endswith("dt_bias"):
        dt = (math.log(1e-3) + (math.log(1e-1) - math.log(1e-3)) * torch.rand(shape, generator=gen)).exp()
        return dt + torch.log(-torch.expm1(-dt))
    if name.endswith("e_score_correction_bias"):
        return 0.1 * torch.randn(shape, generator=gen)
    if len(shape) == 1:
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name == "model.embed_tokens.weight":
        return torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen) / math.sqrt(math.prod(shape[1:]))
