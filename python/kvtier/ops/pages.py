"""Page gather/scatter between per-layer KV page pools and a page-first staging buffer.

The device side of the copy engine (:mod:`kvtier.transfer.copy_engine`): the staging buffer
uses its page-first block layout, so ``staging.view(torch.uint8)`` holds exactly the bytes that
``CopyEngine.gather`` writes for the same pools and pages.

Byte layout of ``staging`` (contiguous ``[num_blocks, num_layers, page_size, row]``)::

    block i (num_layers * page_bytes bytes) = pool_0[pages[i]] | pool_1[pages[i]] | ... | pool_{L-1}[pages[i]]
    page_bytes = page_size * row * element_size
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier import reference
from kvtier.ops.checks import check_tensor
from kvtier.ops.dispatch import device_backend, register_backend, resolve_backend

register_backend("gather_pages", "triton", "hip")
register_backend("scatter_pages", "triton", "hip")

_BLOCK = 1024  # words per program


def _check_pools(kv_pools) -> tuple[int, int, int]:
    if not isinstance(kv_pools, (list, tuple)) or not kv_pools:
        raise TypeError(f"kv_pools must be a non-empty list of tensors, got {type(kv_pools).__name__}")
    first = kv_pools[0]
    check_tensor(first, "kv_pools[0]", ndim=3)
    for i, p in enumerate(kv_pools):
        check_tensor(p, f"kv_pools[{i}]", shape=list(first.shape), dtypes=[first.dtype], device=first.device)
        if p.stride() != first.stride() or not p[0].is_contiguous():
            raise ValueError(f"kv_pools[{i}] must have contiguous pages and the strides of kv_pools[0] "
                             f"{first.stride()}, got strides {p.stride()}")
    return tuple(first.shape)


def _check_pages(pages, num_pages: int, device, *, distinct: bool) -> None:
    check_tensor(pages, "pages", ndim=1, dtypes=[torch.int32, torch.int64], device=device)
    if pages.numel():
        lo, hi = int(pages.min()), int(pages.max())
        if lo < 0 or hi >= num_pages:
            raise ValueError(f"pages must be in [0, num_pages={num_pages}), got range [{lo}, {hi}]")
        if distinct and torch.unique(pages).numel() != pages.numel():
            raise ValueError("pages must be distinct for scatter_pages (a page written twice is ambiguous)")


def _check_staging(staging, name: str, kv_pools, num_blocks: int) -> None:
    first = kv_pools[0]
    check_tensor(staging, name, shape=[num_blocks, len(kv_pools), *first.shape[1:]], dtypes=[first.dtype],
                 device=first.device)
    if not staging.is_contiguous():
        raise ValueError(f"{name} must be contiguous (page-first blocks back to back)")


def _word_layout(kv_pools, staging):
    """Widest word (4, 2 or 1 bytes) that divides the page, the page stride and every address."""
    first = kv_pools[0]
    es = first.element_size()
    page_bytes = first.shape[1] * first.shape[2] * es
    stride_bytes = first.stride(0) * es
    ptrs = [p.data_ptr() for p in kv_pools] + [staging.data_ptr()]
    for word, dtype in ((4, torch.int32), (2, torch.int16), (1, torch.int8)):
        if page_bytes % word == 0 and stride_bytes % word == 0 and all(a % word == 0 for a in ptrs):
            return dtype, page_bytes // word, stride_bytes // word


def _pages_triton(kernel, kv_pools: list[torch.Tensor], pages: torch.Tensor, staging: torch.Tensor) -> None:
    if pages.numel() == 0 or staging.numel() == 0:
        return
    word, page_words, stride_words = _word_layout(kv_pools, staging)
    layer_ptrs = torch.tensor([p.data_ptr() for p in kv_pools], dtype=torch.int64, device=staging.device)
    words = staging.reshape(-1).view(torch.uint8).view(word)
    grid = (pages.numel(), len(kv_pools), -(-page_words // _BLOCK))
    _launch(kernel, grid, layer_ptrs, pages, words, len(kv_pools), page_words, stride_words, BLOCK=_BLOCK,
           num_warps=4)


def _launch(kernel, grid, *args, **kwargs) -> None:
    from kvtier.ops._triton import launchable

    launchable(kernel, args[0].device)[grid](*args, **kwargs)


def _pages_native(kv_pools: list[torch.Tensor], pages: torch.Tensor, staging: torch.Tensor, gather: bool) -> None:
    from kvtier.ops import _native

    _native.page_copy(_native.gpu_kernels(), kv_pools, pages, staging, gather=gather)


def _pages_impl(backend: str, kv_pools: list[torch.Tensor], pages: torch.Tensor, staging: torch.Tensor,
                gather: bool) -> None:
    if backend == "hip":
        _pages_native(kv_pools, pages, staging, gather=gather)
    elif backend == "triton":
        from kvtier.triton_kernels.pages import gather_pages_kernel, scatter_pages_kernel

        _pages_triton(gather_pages_kernel if gather else scatter_pages_kernel, kv_pools, pages, staging)
    elif gather:
        staging.copy_(reference.gather_pages(kv_pools, pages))
    else:
        reference.scatter_pages(staging, kv_pools, pages)


@torch.library.custom_op("kvtier::gather_pages", mutates_args=("staging",), device_types="cpu")
def _gather_pages_cpu(kv_pools: list[torch.Tensor], pages: torch.Tensor, staging: torch.Tensor) -> None:
    _pages_impl("torch", kv_pools, pages, staging, gather=True)


@_gather_pages_cpu.register_kernel("cuda")
def _(kv_pools, pages, staging):
    _pages_impl(device_backend("gather_pages", staging.device), kv_pools, pages, staging, gather=True)


@_gather_pages_cpu.register_fake
def _(kv_pools, pages, staging):
    return None


@torch.library.custom_op("kvtier::scatter_pages", mutates_args=("kv_pools",), device_types="cpu")
def _scatter_pages_cpu(staging: torch.Tensor, kv_pools: list[torch.Tensor], pages: torch.Tensor) -> None:
    _pages_impl("torch", kv_pools, pages, staging, gather=False)


@_scatter_pages_cpu.register_kernel("cuda")
def _(staging, kv_pools, pages):
    _pages_impl(device_backend("scatter_pages", staging.device), kv_pools, pages, staging, gather=False)


@_scatter_pages_cpu.register_fake
def _(staging, kv_pools, pages):
    return None


def gather_pages(kv_pools: Sequence[torch.Tensor], pages: torch.Tensor, *, out: torch.Tensor | None = None,
                 backend: str = "auto") -> torch.Tensor:
    """Copy page ``pages[i]`` of every layer pool into block ``i`` of a page-first staging buffer.

    Args:
        kv_pools: ``num_layers`` tensors ``[num_pages, page_size, row]`` of one dtype, device, shape
            and strides (e.g. ``row = kv_lora_rank + qk_rope_head_dim = 576``); each page contiguous,
            pages any stride apart. Any dtype (bits are copied, NaN payloads included).
        pages: [num_blocks] int32/int64 page ids in ``[0, num_pages)``; repeats allowed.
        out: optional [num_blocks, num_layers, page_size, row] contiguous, pools' dtype and device.
        backend: "auto" | "torch" | "triton" | "hip" (see :mod:`kvtier.ops.dispatch`; "hip" moves
            16-byte words when the pools' addresses, page size and page stride allow it).

    Returns:
        staging [num_blocks, num_layers, page_size, row]: ``staging[i, l] = kv_pools[l][pages[i]]``
        (the copy engine's byte layout).

    Raises:
        ValueError / TypeError: mismatched pools, a page id out of range, a misshaped ``out``.

    Example:
        >>> pools = [torch.arange(24.).view(3, 2, 4) + 100 * l for l in range(2)]
        >>> gather_pages(pools, torch.tensor([2, 0]))[0, 1, 0].tolist()
        [116.0, 117.0, 118.0, 119.0]
    """
    with torch.profiler.record_function("kvtier::gather_pages"):
        num_pages = _check_pools(kv_pools)[0]
        dev = kv_pools[0].device
        _check_pages(pages, num_pages, dev, distinct=False)
        if out is None:
            out = torch.empty(pages.numel(), len(kv_pools), *kv_pools[0].shape[1:], dtype=kv_pools[0].dtype,
                              device=dev)
        else:
            _check_staging(out, "out", kv_pools, pages.numel())
        resolved = resolve_backend("gather_pages", backend, dev, kv_pools[0].dtype)
        if resolved == device_backend("gather_pages", dev):
            torch.ops.kvtier.gather_pages(list(kv_pools), pages, out)
        else:
            _pages_impl(resolved, list(kv_pools), pages, out, gather=True)
        return out


def scatter_pages(staging: torch.Tensor, kv_pools: Sequence[torch.Tensor], pages: torch.Tensor, *,
                  backend: str = "auto") -> None:
    """Copy block ``i`` of a page-first staging buffer into page ``pages[i]`` of every layer pool.

    The inverse of :func:`gather_pages`; writes ``kv_pools`` in place, touching no other page.

    Args:
        staging: [num_blocks, num_layers, page_size, row] contiguous, the pools' dtype and device.
        kv_pools: as in :func:`gather_pages`.
        pages: [num_blocks] int32/int64 distinct page ids in ``[0, num_pages)``.
        backend: "auto" | "torch" | "triton" | "hip".

    Raises:
        ValueError / TypeError: mismatched pools or staging, a page id out of range or repeated.
    """
    with torch.profiler.record_function("kvtier::scatter_pages"):
        num_pages = _check_pools(kv_pools)[0]
        dev = kv_pools[0].device
        _check_pages(pages, num_pages, dev, distinct=True)
        _check_staging(staging, "staging", kv_pools, pages.numel())
        resolved = resolve_backend("scatter_pages", backend, dev, kv_pools[0].dtype)
        if resolved == device_backend("scatter_pages", dev):
            torch.ops.kvtier.scatter_pages(staging, list(kv_pools), pages)
        else:
            _pages_impl(resolved, list(kv_pools), pages, staging, gather=False)
