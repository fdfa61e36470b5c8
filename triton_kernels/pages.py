"""Page gather/scatter between per-layer KV page pools and a page-first staging buffer.

Layout (the C++ copy engine's, ``hip/runtime/copy_engine.h``): block ``i`` of the staging
buffer holds page ``pages[i]`` of layer 0, then of layer 1, ... back to back, i.e. staging is
``[num_blocks, num_layers, page_words]``. Pools are addressed through a table of per-layer
base pointers, so the pools need not share one allocation. Data moves as opaque words
(int32/int16/int8, chosen by the wrapper from the page's byte alignment): bits are copied
exactly, NaN payloads included.

Grid: ``(num_blocks, num_layers, cdiv(page_words, BLOCK))``; each program moves ``BLOCK``
words of one page of one layer. Bytes: ``2 * num_blocks * num_layers * page_bytes``.
"""

import triton
import triton.language as tl

from kvtier.triton_kernels import CompileCase, register_kernel


@triton.jit
def gather_pages_kernel(layer_ptrs, pages, staging, num_layers, page_words, page_stride_words,
                        BLOCK: tl.constexpr):
    """staging[i, l, :] = pool_l[pages[i], :].

    layer_ptrs: [num_layers] int64 base addresses of the pools (element type = staging's).
    pages: [num_blocks] int32/int64 page ids (checked by the wrapper).
    staging: [num_blocks, num_layers, page_words] contiguous words.
    """
    i = tl.program_id(0)
    layer = tl.program_id(1)
    chunk = tl.program_id(2)
    page = tl.load(pages + i).to(tl.int64)
    base = tl.load(layer_ptrs + layer).to(tl.pointer_type(staging.dtype.element_ty))
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < page_words
    words = tl.load(base + page * page_stride_words + offs, mask=mask)
    dst = staging + (i.to(tl.int64) * num_layers + layer) * page_words
    tl.store(dst + offs, words, mask=mask)


@triton.jit
def scatter_pages_kernel(layer_ptrs, pages, staging, num_layers, page_words, page_stride_words,
                         BLOCK: tl.constexpr):
    """pool_l[pages[i], :] = staging[i, l, :] (the inverse of :func:`gather_pages_kernel`)."""
    i = tl.program_id(0)
    layer = tl.program_id(1)
    chunk = tl.program_id(2)
    page = tl.load(pages + i).to(tl.int64)
    base = tl.load(layer_ptrs + layer).to(tl.pointer_type(staging.dtype.element_ty))
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < page_words
    src = staging + (i.to(tl.int64) * num_layers + layer) * page_words
    words = tl.load(src + offs, mask=mask)
    tl.store(base + page * page_stride_words + offs, words, mask=mask)


def _page_cases(arch: str) -> list[CompileCase]:
    # K2 bf16 KV: page 64 x 576 values = 73,728 B = 18,432 int32 words per page.
    sig = {"layer_ptrs": "*i64", "pages": "*i64", "staging": "*i32", "num_layers": "i32", "page_words": "i32",
           "page_stride_words": "i32", "BLOCK": "constexpr"}
    return [CompileCase("k2-p64-i32", sig, {"BLOCK": 1024}, 4, 1)]


register_kernel("gather_pages", gather_pages_kernel, _page_cases)
register_kernel("scatter_pages", scatter_pages_kernel, _page_cases)
