"""Small MLA and vLLM K/V page pools in each block layout the tiers store."""

import torch

from kvtier.cache.block_layout import BlockLayout


NUM_LAYERS, NUM_BLOCKS, PAGE = 2, 6, 4


def mla_caches(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUM_BLOCKS, PAGE, 48, generator=g).to(dtype) for _ in range(NUM_LAYERS)]


def kv_caches(seed=0, dtype=torch.float32):
    """vLLM's standard-attention layout: [2 (K, V), num_blocks, block_size, num_kv_heads, head_size]."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, NUM_BLOCKS, PAGE, 2, 12, generator=g).to(dtype) for _ in range(NUM_LAYERS)]


def kv_caches_lbhnc(seed=0, dtype=torch.float32):
    """vLLM 0.32's per-layer view [num_blocks, num_kv_heads, block_size, K|V channels] (LBHNC), as
    a strided view of a [num_blocks, block_size, num_kv_heads, channels] allocation."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUM_BLOCKS, PAGE, 2, 24, generator=g).to(dtype).transpose(1, 2) for _ in range(NUM_LAYERS)]


# (caches, block_dim, token_dim): an MLA page of 48 values per token and a K/V page of 2 x 2 x 12,
# the same bytes per token, so only the layout code tells them apart.
LAYOUTS = {"mla": (mla_caches, 0, 0), "kv": (kv_caches, 1, 1), "lbhnc": (kv_caches_lbhnc, 0, 1)}


def layout_of(name):
    make, block_dim, token_dim = LAYOUTS[name]
    return BlockLayout.of_caches(make(), block_dim, token_dim)
