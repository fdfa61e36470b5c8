"""Page gather/scatter references: per-layer page pools <-> a page-first staging buffer.

Layout (the copy engine's, ``hip/runtime/copy_engine.h``): ``staging[i, l]`` is page
``pages[i]`` of layer ``l``; one block = that page of every layer, contiguous.

Bytes: ``2 * num_blocks * num_layers * page_size * row * element_size`` (each page read once and
written once); FLOPs: 0.
"""

import torch


def gather_pages(kv_pools, pages):
    """``[len(pages), num_layers, page_size, row]``: ``out[i, l] = kv_pools[l][pages[i]]``."""
    idx = pages.long()
    return torch.stack([pool[idx] for pool in kv_pools], dim=1)


def scatter_pages(staging, kv_pools, pages):
    """``kv_pools[l][pages[i]] = staging[i, l]`` in place (pages must be distinct); returns None."""
    idx = pages.long()
    for layer, pool in enumerate(kv_pools):
        pool[idx] = staging[:, layer]
