"""Public ops: check -> allocate -> dispatch(backend) -> launch.

Every op takes ``backend="auto"|"torch"|"triton"|"hip"|"aiter"``; ``torch`` is the fp32
reference in :mod:`kvtier.reference` and the CPU path.
"""

from kvtier.ops.attention import concat_and_cache_mla, mla_decode, mla_extend
from kvtier.ops.dispatch import (
    BACKENDS,
    BackendUnavailableError,
    is_backend_supported,
    resolve_backend,
)
from kvtier.ops.elementwise import rms_norm, rope_interleaved, silu_and_mul
from kvtier.ops.moe import fused_moe, moe_align_block_size, moe_route
from kvtier.ops.pages import gather_pages, scatter_pages
from kvtier.ops.sampling import sample

__all__ = [
    "BACKENDS", "BackendUnavailableError", "concat_and_cache_mla", "fused_moe", "gather_pages", "is_backend_supported",
    "mla_decode", "mla_extend", "moe_align_block_size", "moe_route", "resolve_backend", "rms_norm", "rope_interleaved",
    "sample", "scatter_pages", "silu_and_mul",
]
