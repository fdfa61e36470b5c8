"""How long one engine step takes: a roofline over Kimi K2's operators.

A step runs one :class:`kvtier.serve.step_plan.ScheduledBatch`: prefill chunks (``n`` new tokens
after ``p`` cached ones) and decodes (one token after ``c - 1`` cached ones). The simulator
replaces the model forward with ``timer.step_s(BatchShape.of(batch))``.

**Roofline** (:class:`RooflineTimer`), per step, each operator class timed as
``max(FLOPs / matrix rate, bytes / memory rate)`` and the classes summed (operators run one
after another). Shapes from :class:`kvtier.model.KimiK2Config`; ``T`` = tokens in the step, ``S``
= rows that need logits, ``P_*`` = parameter counts, ``tp`` = tensor-parallel devices (weights,
FLOPs and heads are split ``tp`` ways; the MLA latent cache is not, see :class:`Node`):

- attention projections per layer (``q_a``, ``q_b``, ``kv_a``, ``kv_b``, ``o``): FLOPs ``2*T*P_attn``,
  weight bytes ``P_attn * weight_dtype_bytes`` (all read every step);
- MoE layer: FLOPs ``2*T*(k + n_shared)*P_expert``; weight bytes of the experts hit:
  ``E * (1 - (1 - k/E)**T)`` routed experts (uniform routing, what the load-balanced router of
  DeepSeek-V3 aims at) plus the shared ones; the dense first layer ``2*T*P_mlp``;
- ``lm_head`` for the ``S`` sampled rows: ``2*S*vocab*hidden``;
- decode attention (weight-absorbed MLA, :mod:`kvtier.reference.mla`): per sequence and layer
  ``c * (kv_lora_rank + rope) * kv_bytes`` cache bytes and ``2*H*c*(D + kv_lora_rank)`` FLOPs;
- prefill-chunk attention: the cheaper of the absorbed form (FLOPs
  ``2*H*(D + kv_lora_rank)*V``, ``V = n*p + n*(n+1)/2`` visible query-key pairs) and the expanded
  (MHA) form engines use for prefill (FLOPs ``2*H*(qk_head_dim + v_head_dim)*V`` plus the
  up-projection of the ``p`` cached latents ``2*p*kv_lora_rank*H*(qk_nope + v)``), as an engine
  with both kernels would pick (DeepSeek-V3 technical report, section 2.1.1; FlashMLA);
- two all-reduces of ``T * hidden * 2`` bytes per layer when ``tp > 1`` (after attention and
  after the MLP), :meth:`Node.allreduce_s`;
- fixed costs: ``layer_overhead_s`` per layer and ``step_overhead_s`` per step.

Matrix rates: FP8 GEMMs (K2's released weights are FP8) at ``fp8_flops * efficiency.matrix``,
attention at ``bf16_flops * efficiency.matrix``; memory at ``hbm_Bps * efficiency.memory``.
:class:`KernelRates` read from ``perf/`` CSVs replace these with the rates the kernels reached.

Any object with ``step_s(BatchShape) -> seconds`` can time the simulator's steps; the agreement
check's CPU cost model is a linear one fitted on measured steps
(:class:`kvtier.sim.calibrate.LinearTimer`).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.sim.hardware import Efficiency, Node
from kvtier.model.config import KimiK2Config
from kvtier.serve.step_plan import ScheduledBatch

def ending(batch: ScheduledBatch) -> list:
    """The sequences whose last token ``batch`` computes (the rows that need logits): the prefill
    chunks that reach their sequence's end, then every decode."""
    return [s for s, n in batch.extends if s.num_computed_tokens + n >= s.num_tokens] + batch.decodes


@dataclass(frozen=True)
class BatchShape:
    """The sizes of one step that its duration depends on.

    Attributes:
        extends: ``(new_tokens, cached_tokens)`` per prefill chunk.
        num_decodes: decoding sequences (one token each).
        decode_context: sum over decodes of the tokens attended (cached + the new one).
        num_sampled: rows that need logits: decodes plus chunks that reach their sequence's end.
    """

    extends: tuple[tuple[int, int], ...] = ()
    num_decodes: int = 0
    decode_context: int = 0
    num_sampled: int = 0

    @staticmethod
    def of(batch: ScheduledBatch) -> BatchShape:
        """Shape of ``batch`` before it runs (its sequences' ``num_computed_tokens`` not yet advanced)."""
        extends = tuple((n, seq.num_computed_tokens) for seq, n in batch.extends)
        context = sum(seq.num_computed_tokens for seq in batch.decodes) + len(batch.decodes)
        return BatchShape(extends, len(batch.decodes), context, len(ending(batch)))

    @property
    def num_tokens(self) -> int:
        return sum(n for n, _ in self.extends) + self.num_decodes


@dataclass(frozen=True)
class KernelRates:
    """Rates kernels reached on a GPU, replacing ``peak x efficiency`` for their class.

    Attributes:
        gemm_flops: FLOP/s of the MoE GEMMs when compute-bound (best ``fused_moe`` row).
        attention_flops: FLOP/s of prefill attention (best ``mla_extend`` row).
        attention_Bps: bytes/s of decode attention (best ``mla_decode`` row).
        source: the CSV files and device they came from.
    """

    gemm_flops: float | None = None
    attention_flops: float | None = None
    attention_Bps: float | None = None
    source: str = ""

    @staticmethod
    def from_csv(paths: list[str | Path], device: str) -> KernelRates:
        """Best achieved rate per class from ``perf/bench_mla.py`` / ``perf/bench_moe.py`` CSVs.

        Args:
            paths: CSV files with the columns ``op, device, tflop_s, gb_s`` (others ignored).
            device: substring of the ``device`` column to keep (e.g. ``"MI355X"``, ``"H200"``).

        Raises:
            ValueError: a file lacks those columns, or no row matches ``device``.
            OSError: a file cannot be read.
        """
        best: dict[tuple[str, str], float] = {}
        for path in paths:
            with open(path, newline="") as f:
                reader = csv.DictReader(f)
                missing = {"op", "device", "tflop_s", "gb_s"} - set(reader.fieldnames or ())
                if missing:
                    raise ValueError(f"{path}: kernel-timing CSV lacks column(s) {sorted(missing)}")
                for row in reader:
                    if device not in row["device"]:
                        continue
                    for col in ("tflop_s", "gb_s"):
                        try:
                            v = float(row[col])
                        except ValueError:
                            continue
                        if math.isfinite(v) and v > best.get((row["op"], col), 0.0):
                            best[(row["op"], col)] = v
        if not best:
            raise ValueError(f"no row of {[str(p) for p in paths]} has a device matching {device!r}")
        get = lambda op, col, unit: (best[(op, col)] * unit if (op, col) in best else None)
        return KernelRates(get("fused_moe", "tflop_s", 1e12), get("mla_extend", "tflop_s", 1e12),
                           get("mla_decode", "gb_s", 1e9), f"{', '.join(str(p) for p in paths)} [{device}]")


@dataclass(frozen=True)
class _Params:
    """Parameter counts of a K2-class model (elements): one layer's attention (router included),
    one expert, the dense MLP, ``lm_head``; and how many layers are MoE."""

    attn: float
    expert: float
    mlp: float
    lm_head: float
    moe_layers: int

    @staticmethod
    def of(c: KimiK2Config) -> _Params:
        h, heads = c.hidden_size, c.num_attention_heads
        q = h * heads * c.qk_head_dim
        if c.q_lora_rank is not None:
            q = h * c.q_lora_rank + c.q_lora_rank * heads * c.qk_head_dim
        kv_b = c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)
        attn = q + h * c.kv_cache_dim + kv_b + heads * c.v_head_dim * h
        return _Params(attn + h * c.n_routed_experts, 3 * h * c.moe_intermediate_size, 3 * h * c.intermediate_size,
                       c.vocab_size * h, c.num_hidden_layers - c.first_k_dense_replace)


def prefill_tok_s(timer, chunk_tokens: int) -> float:
    """Tokens/s of prefilling ``chunk_tokens``-token chunks with nothing cached under ``timer``
    (anything with ``step_s(BatchShape)``): a first estimate for the pool's cost model, which
    then learns from steps."""
    return chunk_tokens / timer.step_s(BatchShape(((chunk_tokens, 0),), 0, 0, 1))


def own_prefill_s(timer, new_tokens: int, cached_tokens: int) -> float:
    """Seconds of a step that only prefills ``new_tokens`` tokens after ``cached_tokens`` cached
    ones and samples its first token, under ``timer``: what a resume needs however it is served
    (the resume target's ``prefill`` reason, :func:`kvtier.bench.resume.resume_misses`)."""
    return timer.step_s(BatchShape(((new_tokens, cached_tokens),), 0, 0, 1))


@dataclass
class RooflineTimer:
    """Step time of a K2-class model on a :class:`Node` (module docstring has the formulas).

    Args:
        model: the model shape.
        node: devices, interconnect and tensor-parallel size.
        efficiency: fractions of peak reached and fixed costs.
        kv_dtype_bytes: bytes per cached value (2 = bf16 KV, as docs/workload.md sizes the published run; 1 = FP8).
        weight_dtype_bytes: bytes per linear-layer weight (1 = FP8).
        rates: measured kernel rates; a class without one uses ``peak x efficiency``.
    """

    model: KimiK2Config
    node: Node
    efficiency: Efficiency = field(default_factory=Efficiency)
    kv_dtype_bytes: float = 1.0
    weight_dtype_bytes: float = 1.0
    rates: KernelRates = field(default_factory=KernelRates)

    def __post_init__(self) -> None:
        acc, eff, tp = self.node.accelerator, self.efficiency, self.node.num_devices
        self._s = _Params.of(self.model)
        self._gemm_flops = self.rates.gemm_flops or acc.fp8_flops * eff.matrix
        self._attn_flops = self.rates.attention_flops or acc.bf16_flops * eff.matrix
        self._mem_Bps = acc.hbm_Bps * eff.memory
        self._attn_Bps = self.rates.attention_Bps or self._mem_Bps
        self._heads = self.model.num_attention_heads / tp
        self._tp = tp

    def _gemm_s(self, flops: float, nbytes: float) -> float:
        return max(flops / self._tp / self._gemm_flops, nbytes / self._tp / self._mem_Bps)

    def _linear_s(self, tokens: int, sampled: int) -> float:
        s, c, wb = self._s, self.model, self.weight_dtype_bytes
        e, k, layers = c.n_routed_experts, c.num_experts_per_tok, c.num_hidden_layers
        hit = e * (1.0 - (1.0 - k / e) ** tokens) + c.n_shared_experts
        t = layers * self._gemm_s(2 * tokens * s.attn, s.attn * wb)
        t += s.moe_layers * self._gemm_s(2 * tokens * (k + c.n_shared_experts) * s.expert, hit * s.expert * wb)
        t += (layers - s.moe_layers) * self._gemm_s(2 * tokens * s.mlp, s.mlp * wb)
        if sampled:
            t += self._gemm_s(2 * sampled * s.lm_head, s.lm_head * 2)
        return t

    def _extend_s(self, new: int, cached: int) -> float:
        """Seconds of one prefill chunk's attention in one layer (the cheaper form)."""
        c, kvb, h = self.model, self.kv_dtype_bytes, self._heads
        kv, rank, vo = c.kv_cache_dim, c.kv_lora_rank, c.qk_nope_head_dim + c.v_head_dim  # vo: kv_b rows per head
        pairs = new * cached + new * (new + 1) / 2
        latent_bytes = (cached + new) * kv * kvb
        absorbed = max(2 * h * (kv + rank) * pairs / self._attn_flops, latent_bytes / self._attn_Bps)
        expand_flops = 2 * cached * rank * h * vo
        expanded_bytes = latent_bytes + 2 * cached * h * vo * 2
        mha_flops = 2 * h * (c.qk_head_dim + c.v_head_dim) * pairs + expand_flops
        mha = max(mha_flops / self._attn_flops, expanded_bytes / self._attn_Bps)
        return min(absorbed, mha)

    def _decode_s(self, num_decodes: int, context: int) -> float:
        """Seconds of the decodes' attention in one layer."""
        kv, h = self.model.kv_cache_dim, self._heads
        flops = 2 * h * context * (kv + self.model.kv_lora_rank)
        nbytes = context * kv * self.kv_dtype_bytes + num_decodes * h * (kv + self.model.kv_lora_rank) * 2
        return max(flops / self._attn_flops, nbytes / self._attn_Bps)

    def step_s(self, shape: BatchShape) -> float:
        """Seconds of one step of ``shape``; 0 for an empty step."""
        tokens = shape.num_tokens
        if tokens == 0:
            return 0.0
        layers, eff = self.model.num_hidden_layers, self.efficiency
        t = self._linear_s(tokens, shape.num_sampled)
        attn = sum(self._extend_s(n, p) for n, p in shape.extends)
        if shape.num_decodes:
            attn += self._decode_s(shape.num_decodes, shape.decode_context)
        t += layers * attn
        t += 2 * layers * self.node.allreduce_s(tokens * self.model.hidden_size * 2)
        return t + layers * eff.layer_overhead_s + eff.step_overhead_s


@dataclass
class HybridRooflineTimer(RooflineTimer):
    """Step time of a hybrid KDA + MLA model (Kimi K3: :class:`kvtier.model.kimi_linear_config.KimiLinearConfig`)
    on a :class:`Node`: the roofline of :class:`RooflineTimer` with K3's parts.

    Parameter counts and weight bytes per part come from
    :func:`kvtier.model.hybrid_plan.hybrid_parameter_bytes` in ``weight_format`` (``mxfp4``: routed
    experts MXFP4, the rest bf16); ``weight_dtype_bytes`` is not used. Per step:

    - dense GEMMs (KDA and MLA projections, shared experts, the latent expert projections, router,
      dense first layer): FLOPs ``2*T*P``, all their bytes read, at ``bf16_flops * matrix``;
    - routed experts: ``E * (1 - (1 - k/E)**T)`` experts hit per MoE layer, FLOPs ``2*T*k*P_expert``,
      at ``fp8_flops * matrix`` (no FP4 rate is modelled: conservative for MXFP4 weights);
    - ``lm_head`` for the sampled rows;
    - MLA attention as :class:`RooflineTimer` over the ``len(full_attn_layers)`` MLA layers only;
    - KDA (chunked delta rule, 64-token chunks) per KDA layer: ``heads * (4*d*d + 4*64*d)`` FLOPs per
      token, and each sequence of the step reads and writes its ``[heads, d, d]`` fp32 state once
      (a decode per step, a prefill chunk once per chunk), split over the ``tp`` devices;
    - two all-reduces per layer and the fixed costs, over all ``num_hidden_layers``.

    Args:
        weight_format: :data:`kvtier.model.hybrid_plan.HYBRID_FORMATS` (``mxfp4`` as K3 ships).
        state_dtype_bytes: bytes per recurrent-state value (4 = fp32).
        Other arguments as :class:`RooflineTimer`.
    """

    weight_format: str = "mxfp4"
    state_dtype_bytes: int = 4

    def __post_init__(self) -> None:
        from kvtier.model.hybrid_plan import hybrid_parameter_bytes

        acc, eff, c = self.node.accelerator, self.efficiency, self.model
        self._tp = self.node.num_devices
        parts = hybrid_parameter_bytes(c, self.weight_format)
        dense = ("kda_attention", "mla_attention", "shared_experts", "latent_proj", "router", "dense_mlp")
        self._dense_params = sum(parts[p][0] for p in dense)
        self._dense_bytes = sum(parts[p][1] for p in dense)
        self._moe_layers = sum(1 for i in range(c.num_hidden_layers) if c.is_moe_layer(i))
        routed_params, routed_bytes = parts["routed_experts"]
        per = self._moe_layers * c.n_routed_experts
        self._expert_params, self._expert_bytes = routed_params / per, routed_bytes / per
        self._lm_params, self._lm_bytes = parts["lm_head"]
        self._gemm_flops = self.rates.gemm_flops or acc.fp8_flops * eff.matrix
        self._dense_flops = acc.bf16_flops * eff.matrix
        self._attn_flops = self.rates.attention_flops or acc.bf16_flops * eff.matrix
        self._mem_Bps = acc.hbm_Bps * eff.memory
        self._attn_Bps = self.rates.attention_Bps or self._mem_Bps
        self._heads = c.num_attention_heads / self._tp
        d = c.linear_head_dim
        self._kda_flops_per_token = c.linear_num_heads * (4 * d * d + 4 * 64 * d)
        self._kda_state_bytes = c.linear_num_heads * d * d * self.state_dtype_bytes

    def _dense_s(self, flops: float, nbytes: float) -> float:
        return max(flops / self._tp / self._dense_flops, nbytes / self._tp / self._mem_Bps)

    def _linear_s(self, tokens: int, sampled: int) -> float:
        c = self.model
        e, k = c.n_routed_experts, c.num_experts_per_tok
        hit = e * (1.0 - (1.0 - k / e) ** tokens)
        t = self._dense_s(2 * tokens * self._dense_params, self._dense_bytes)
        t += self._moe_layers * self._gemm_s(2 * tokens * k * self._expert_params, hit * self._expert_bytes)
        if sampled:
            t += self._dense_s(2 * sampled * self._lm_params, self._lm_bytes)
        return t

    def _kda_s(self, tokens: int, num_seqs: int) -> float:
        """Seconds of one KDA layer's recurrence for ``tokens`` tokens of ``num_seqs`` sequences."""
        flops = tokens * self._kda_flops_per_token
        nbytes = 2 * num_seqs * self._kda_state_bytes
        return max(flops / self._tp / self._dense_flops, nbytes / self._tp / self._mem_Bps)

    def step_s(self, shape: BatchShape) -> float:
        """Seconds of one step of ``shape``; 0 for an empty step."""
        tokens = shape.num_tokens
        if tokens == 0:
            return 0.0
        c, eff = self.model, self.efficiency
        t = self._linear_s(tokens, shape.num_sampled)
        attn = sum(self._extend_s(n, p) for n, p in shape.extends)
        if shape.num_decodes:
            attn += self._decode_s(shape.num_decodes, shape.decode_context)
        t += len(c.full_attn_layers) * attn
        t += len(c.kda_layers) * self._kda_s(tokens, len(shape.extends) + shape.num_decodes)
        t += 2 * c.num_hidden_layers * self.node.allreduce_s(tokens * c.hidden_size * 2)
        return t + c.num_hidden_layers * eff.layer_overhead_s + eff.step_overhead_s
