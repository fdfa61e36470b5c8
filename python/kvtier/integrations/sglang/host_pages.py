"""Pages of one SGLang host pool as bytes: what the backend reads from and writes into.

A page's object is its flat data page (``host_pool.get_data_page(start, flat=True)`` as bytes),
the object SGLang's generic storage path moves. For page-first layouts (``page_first``,
``page_first_direct``) the same bytes are the pool's zero-copy segments
(``host_pool.get_page_buffer_meta``: per page, the K part of every layer then the V part, or one
MLA part) back to back, so :class:`HostPages` copies them straight between the pool's memory and
the tiers' buffers (no flat page is built); for other layouts (``layer_first``, whose segments
interleave layers) it goes through the pool's flat-page methods. Either way a page is stored as
the same bytes, and the generic and zero-copy paths read each other's pages.

This module calls only the host pool's public page API; it imports nothing of SGLang.
"""

from __future__ import annotations

import torch

ZERO_COPY_LAYOUTS = ("page_first", "page_first_direct")


class HostPages:
    """One SGLang host pool (``HostKVCache``: MHA, MLA, a state pool, ...) page by page.

    Args:
        pool: the host pool (``page_size``, ``layout``, ``get_dummy_flat_data_page``,
            ``get_data_page``, ``set_from_flat_data_page``; ``get_page_buffer_meta`` for the
            zero-copy layouts).

    Attributes:
        page_size: tokens per page.
        layout: the pool's layout name (``"layer_first"``, ``"page_first"``, ...; ``"flat"`` when
            it has none).
        dtype: the flat page's dtype.
        page_bytes: bytes of one page's object.
    """

    def __init__(self, pool):
        self.pool = pool
        self.page_size = int(getattr(pool, "page_size", 1) or 1)
        self.layout = str(getattr(pool, "layout", "flat"))
        page = pool.get_dummy_flat_data_page()
        self.dtype = page.dtype
        self.page_bytes = page.numel() * page.element_size()
        self._zero_copy = self.layout in ZERO_COPY_LAYOUTS and hasattr(pool, "get_page_buffer_meta")
        self._buffers = _buffers(pool) if self._zero_copy else []

    def dummy_page(self) -> torch.Tensor:
        """A new flat data page (what the generic path reads into)."""
        return self.pool.get_dummy_flat_data_page()

    def check_flat(self, page, name: str) -> None:
        """Raise ValueError (naming ``name``) unless ``page`` is a CPU tensor of one page's bytes."""
        if not isinstance(page, torch.Tensor) or page.device.type != "cpu":
            raise ValueError(f"{name} must hold CPU tensors (flat data pages), got {type(page).__name__}")
        got = page.numel() * page.element_size()
        if got != self.page_bytes:
            raise ValueError(f"{name}: a page of this host pool is {self.page_bytes} bytes, got a tensor of {got}")

    def page_starts(self, host_indices, num_pages: int) -> list[int]:
        """The first token slot of each page in ``host_indices``.

        Args:
            host_indices: ``[num_pages * page_size]`` integer tensor of token slots.
            num_pages: pages (keys) the call moves.

        Raises:
            ValueError: ``host_indices`` is not a 1-D integer tensor of ``num_pages * page_size``.
        """
        need = num_pages * self.page_size
        if not isinstance(host_indices, torch.Tensor) or host_indices.dim() != 1 \
                or host_indices.dtype.is_floating_point or host_indices.numel() != need:
            got = tuple(host_indices.shape) if isinstance(host_indices, torch.Tensor) else type(host_indices).__name__
            raise ValueError(f"host_indices must be a 1-D integer tensor of {num_pages} pages x {self.page_size} "
                             f"tokens = {need} slots, got {got}")
        return host_indices[::self.page_size].tolist() if need else []

    def load_page(self, start: int, out: torch.Tensor) -> None:
        """Copy the object of the page starting at token slot ``start`` into ``out``
        (``[page_bytes]`` uint8)."""
        if self._zero_copy:
            at = 0
            for seg in self._segments(start):
                out[at:at + seg.numel()].copy_(seg)
                at += seg.numel()
            return
        out.copy_(self.pool.get_data_page(start, flat=True).contiguous().reshape(-1).view(torch.uint8))

    def store_page(self, start: int, data: torch.Tensor) -> None:
        """Write object ``data`` (``[page_bytes]`` uint8) into the page starting at ``start``."""
        if self._zero_copy:
            at = 0
            for seg in self._segments(start):
                seg.copy_(data[at:at + seg.numel()])
                at += seg.numel()
            return
        self.pool.set_from_flat_data_page(start, data.view(self.dtype))

    def _segments(self, start: int) -> list[torch.Tensor]:
        """uint8 views of the pool's memory that make up one page, in object order."""
        ptrs, sizes = self.pool.get_page_buffer_meta(torch.arange(start, start + self.page_size, dtype=torch.int64))
        views = []
        for ptr, size in zip(ptrs, sizes):
            for base, flat in self._buffers:
                if base <= ptr and ptr + size <= base + flat.numel():
                    views.append(flat[ptr - base:ptr - base + size])
                    break
            else:
                raise ValueError(f"host pool segment at {ptr:#x} (+{size} bytes) lies in none of its buffers")
        if sum(v.numel() for v in views) != self.page_bytes:
            raise ValueError(f"host pool segments of one page hold {sum(v.numel() for v in views)} bytes, "
                             f"its flat page {self.page_bytes}")
        return views


def _buffers(pool) -> list[tuple[int, torch.Tensor]]:
    """``(data_ptr, flat uint8 view)`` of every contiguous CPU tensor the pool holds."""
    found = []
    for value in vars(pool).values():
        items = value if isinstance(value, (list, tuple)) else [value]
        for t in items:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous() and t.numel():
                found.append((t.data_ptr(), t.reshape(-1).view(torch.uint8)))
    return found
