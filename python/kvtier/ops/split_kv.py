"""Split-KV planning for paged decode, shared by the Triton and HIP launchers.

A decode step has ``batch * cdiv(num_heads, heads_per_block)`` programs before splitting; long
contexts leave most compute units idle unless each sequence's keys are cut into slices that run
in parallel and are merged by their log-sum-exp afterwards (FlashDecoding).
"""

from __future__ import annotations

import torch

MAX_KV_SPLITS = 64
MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost (q load, merge traffic) dominates


def decode_num_splits(batch: int, num_heads: int, max_kv_tokens: int, num_units: int, heads_per_block: int) -> int:
    """Key slices per sequence: enough programs for ~2 waves over ``num_units`` SMs/CUs, but no slice
    shorter than :data:`MIN_TOKENS_PER_SPLIT` tokens of the capacity ``max_kv_tokens`` and at most
    :data:`MAX_KV_SPLITS`. A pure function of shapes (no device sync, CUDA-graph safe).

    Args:
        batch: sequences in the step; num_heads: query heads per sequence.
        max_kv_tokens: cache capacity per sequence in tokens (``max_pages * page_size``).
        num_units: SMs (NVIDIA) or CUs (AMD) of the device.
        heads_per_block: query heads one program (block) of the kernel handles.
    """
    head_blocks = -(-max(num_heads, 1) // max(heads_per_block, 1))
    want = -(-2 * num_units // max(batch * head_blocks, 1))
    cap = max(1, min(MAX_KV_SPLITS, max_kv_tokens // MIN_TOKENS_PER_SPLIT))
    return max(1, min(want, cap))


def num_compute_units(device: torch.device) -> int:
    """SMs / CUs of the device (1 on CPU)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
