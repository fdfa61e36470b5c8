"""fp32 torch references of every op in :mod:`kvtier.ops`, with the same signatures.

Each reference computes in fp32 and casts its main output to the input dtype; the module of
each op states its DRAM bytes and FLOPs so tests and ``perf/`` share one formula.
"""

from kvtier.reference.activation import gated_act, silu_and_mul, situ_and_mul
from kvtier.reference.mla import concat_and_cache_mla, mla_decode, mla_extend
from kvtier.reference.moe import fused_moe, moe_align_block_size, moe_route
from kvtier.reference.mxfp4 import dequantize_mxfp4, fused_moe_mxfp4, linear_mxfp4
from kvtier.reference.norm import rms_norm
from kvtier.reference.pages import gather_pages, scatter_pages
from kvtier.reference.quant import (
    dequantize_fp8_block,
    dequantize_int4_group,
    fused_moe_fp8_block,
    fused_moe_w4a16,
    linear_fp8_block,
    linear_w4a16,
)
from kvtier.reference.rope import rope_interleaved
from kvtier.reference.sampling import sample, sample_from_uniforms

__all__ = [
    "concat_and_cache_mla", "dequantize_fp8_block", "dequantize_int4_group", "dequantize_mxfp4", "fused_moe",
    "fused_moe_fp8_block", "fused_moe_mxfp4", "fused_moe_w4a16", "gather_pages", "gated_act", "linear_fp8_block",
    "linear_mxfp4", "linear_w4a16", "mla_decode", "mla_extend", "moe_align_block_size", "moe_route", "rms_norm",
    "rope_interleaved", "sample", "sample_from_uniforms", "scatter_pages", "silu_and_mul", "situ_and_mul",
]
