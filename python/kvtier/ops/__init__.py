"""Public ops: check -> allocate -> dispatch(backend) -> launch.

Every op takes ``backend="auto"|"torch"|"triton"|"hip"|"aiter"``; ``torch`` is the fp32
reference in :mod:`kvtier.reference` and the CPU path.

Importing this package (``import kvtier`` does) registers the kernels as ``torch.library`` ops,
``torch.ops.kvtier.<name>``, with one kernel per device type and a fake implementation each, no
backend in their schemas: mla_decode, mla_extend, concat_and_cache_mla, moe_route, fused_moe,
moe_align_block_size, gather_pages, scatter_pages, sample, the KDA and short-conv ops
kda_chunk_prefill, kda_recurrent_decode, causal_conv1d_prefill, causal_conv1d_update
(:mod:`kvtier.ops.kda`), and the quantized-weight ops
dequantize_int4_group, dequantize_fp8_block, linear_w4a16, linear_fp8_block, fused_moe_w4a16,
fused_moe_fp8_block (:mod:`kvtier.ops.quant`), the MXFP4 ops dequantize_mxfp4, linear_mxfp4,
fused_moe_mxfp4 (:mod:`kvtier.ops.mxfp4`) (schemas in :mod:`kvtier.ops._mla_library` and
beside each op). The functions here call them when the
resolved backend is the device's own (:func:`kvtier.ops.dispatch.device_backend`).
"""

from kvtier.ops.attention import (
    MLADecodePlan,
    MLAExtendPlan,
    check_slot_mapping,
    concat_and_cache_mla,
    mla_decode,
    mla_decode_run,
    mla_extend,
    mla_extend_run,
    plan_mla_decode,
    plan_mla_extend,
)
from kvtier.ops.dispatch import (
    BACKENDS,
    BackendUnavailableError,
    is_backend_supported,
    resolve_backend,
)
from kvtier.ops.elementwise import check_positions, rms_norm, rope_interleaved, silu_and_mul
from kvtier.ops.kda import causal_conv1d_prefill, causal_conv1d_update, kda_chunk_prefill, kda_recurrent_decode
from kvtier.ops.moe import check_expert_ids, fused_moe, moe_align_block_size, moe_route
from kvtier.ops.mxfp4 import dequantize_mxfp4, fused_moe_mxfp4, linear_mxfp4
from kvtier.ops.pages import gather_pages, scatter_pages
from kvtier.ops.quant import (
    dequantize_fp8_block,
    dequantize_int4_group,
    fp8_e4m3_dtype,
    fp8_e4m3fn_to_fnuz,
    fused_moe_fp8_block,
    fused_moe_w4a16,
    linear_fp8_block,
    linear_w4a16,
)
from kvtier.ops.sampling import sample

__all__ = [
    "BACKENDS", "BackendUnavailableError", "MLADecodePlan", "MLAExtendPlan", "causal_conv1d_prefill",
    "causal_conv1d_update", "check_expert_ids", "check_positions", "check_slot_mapping", "concat_and_cache_mla",
    "dequantize_fp8_block", "dequantize_int4_group", "dequantize_mxfp4", "fp8_e4m3_dtype", "fp8_e4m3fn_to_fnuz", "fused_moe",
    "fused_moe_fp8_block", "fused_moe_mxfp4", "fused_moe_w4a16", "gather_pages", "is_backend_supported", "kda_chunk_prefill",
    "kda_recurrent_decode", "linear_fp8_block", "linear_mxfp4", "linear_w4a16", "mla_decode", "mla_decode_run", "mla_extend",
    "mla_extend_run", "moe_align_block_size", "moe_route", "plan_mla_decode", "plan_mla_extend", "resolve_backend",
    "rms_norm", "rope_interleaved", "sample", "scatter_pages", "silu_and_mul",
]
