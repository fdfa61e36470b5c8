"""What a tier block holds: any engine's per-layer KV page, described by its shape and dtype.

A tier block (host slot, disk file, remote value) is the bytes of one page of every layer,
layer after layer: ``[num_layers, *page_shape]`` of ``dtype``, C order. The page is what one
block id selects in a layer's KV cache tensor, whatever else that tensor holds:

* kvtier's MLA pools and vLLM's MLA caches, ``[num_blocks, block_size, 576]`` per layer (block
  dim 0): page ``[block_size, 576]``, tokens on page dim 0. This is the page-first layout the
  pool always had, and its :class:`BlockMeta` is unchanged (layout code 0).
* vLLM's standard-attention K/V caches, ``[2, num_blocks, block_size, num_kv_heads, head_size]``
  per layer (block dim 1, K then V): page ``[2, block_size, num_kv_heads, head_size]``, tokens on
  page dim 1.

:meth:`BlockLayout.meta` turns a layout into the :class:`BlockMeta` every tier stores in its
header and checks on every read. Its ``dtype`` field is a format code: the dtype's code
(:data:`DTYPE_CODES`) in the low 8 bits and a 24-bit layout code in the high 24 bits, 0 for the
page-first ``[page_size, row]`` page and a digest of ``(page_shape, token_dim)`` for any other
page (:func:`layout_code`). So two layouts with equal byte counts (say an MLA page of 576 values
per token and a K/V page of ``2 * 2 * 144``) never read each other's blocks: a read with
another layout's meta is refused as CORRUPT on disk and in the remote tier, the disk
subdirectory (:func:`kvtier.cache.tiers.disk_budget.namespace_dir`) and the remote key prefix
(:func:`kvtier.cache.remote.block_format.key_prefix`) differ, and a pool only indexes recovered
blocks of its own meta. The model is bound by the block-hash salt, as before.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.cache.disk_tier import DTYPE_CODES, BlockMeta

LAYOUT_SHIFT = 8
"""The layout code sits above the dtype code's 8 bits in ``BlockMeta.dtype``."""


def layout_code(page_shape: Sequence[int], token_dim: int) -> int:
    """24-bit code of a page shape: 0 for the page-first ``[page_size, row]`` page
    (``token_dim == 0``, rank 2), else ``1 + (first 8 bytes of SHA-256 of the shape) mod (2^24 - 1)``
    (never 0). Two different shapes share a code with probability 2^-24, and then only matter if
    their layer count, page size, row bytes and dtype agree too.

    Example:
        >>> layout_code((16, 576), 0), layout_code((2, 16, 8, 64), 1) != 0
        (0, True)
    """
    shape = tuple(int(s) for s in page_shape)
    if len(shape) == 2 and token_dim == 0:
        return 0
    text = f"{'x'.join(map(str, shape))}t{token_dim}".encode()
    return 1 + int.from_bytes(hashlib.sha256(text).digest()[:8], "little") % ((1 << 24) - 1)


def layout_name(meta: BlockMeta) -> str:
    """``kv-<num_layers>l-<page_size>p-<row_bytes>r-<dtype code>d``, then ``-<layout code, 6 hex
    digits>s`` for a page other than page-first ``[page_size, row]``
    (:mod:`kvtier.cache.block_layout`): the name of one block layout in a directory or key.

    Example:
        >>> layout_name(BlockMeta(2, 16, 1152, 1 | 0xabcdef << 8, 36864))
        'kv-2l-16p-1152r-1d-abcdefs'
    """
    name = f"kv-{meta.num_layers}l-{meta.page_size}p-{meta.row_bytes}r-{meta.dtype & 0xFF}d"
    code = meta.dtype >> 8
    return name if code == 0 else f"{name}-{code:06x}s"


@dataclass(frozen=True)
class BlockLayout:
    """The layout of one engine's tier blocks.

    Attributes:
        num_layers: layers in a block (>= 1).
        page_shape: shape of one layer's page, e.g. ``(16, 576)`` (MLA) or ``(2, 16, 8, 64)``
            (K/V: K and V, block_size, num_kv_heads, head_size). Dims of size 1 other than the
            token dim are dropped (the bytes are the same): vLLM's MLA page ``(1, 16, 576)`` is
            kvtier's ``(16, 576)``.
        token_dim: the dim of ``page_shape`` that counts tokens (its size is the page size).
        dtype: element dtype, one of :data:`kvtier.cache.disk_tier.DTYPE_CODES`.

    Raises:
        ValueError: a field out of range or a dtype the tiers cannot store, naming it.
    """

    num_layers: int
    page_shape: tuple[int, ...]
    token_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ValueError(f"num_layers must be an int >= 1, got {self.num_layers!r}")
        shape = tuple(self.page_shape)
        if not shape or any(not isinstance(s, int) or s < 1 for s in shape):
            raise ValueError(f"page_shape must be a non-empty tuple of ints >= 1, got {self.page_shape!r}")
        if not isinstance(self.token_dim, int) or not 0 <= self.token_dim < len(shape):
            raise ValueError(f"token_dim must be a dim of page_shape {shape} (0..{len(shape) - 1}), "
                             f"got {self.token_dim!r}")
        # dims of size 1 (other than the tokens) do not change the bytes: (1, N, 576) is (N, 576)
        keep = [d for d, s in enumerate(shape) if s != 1 or d == self.token_dim]
        object.__setattr__(self, "page_shape", tuple(shape[d] for d in keep))
        object.__setattr__(self, "token_dim", keep.index(self.token_dim))
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"dtype must be one of {sorted(map(str, DTYPE_CODES))}, got {self.dtype!r}")

    @property
    def page_size(self) -> int:
        """Tokens per block."""
        return self.page_shape[self.token_dim]

    @property
    def page_bytes(self) -> int:
        """Bytes of one layer's page."""
        n = self.dtype.itemsize
        for s in self.page_shape:
            n *= s
        return n

    @property
    def block_bytes(self) -> int:
        """Bytes of one tier block: ``num_layers * page_bytes``."""
        return self.num_layers * self.page_bytes

    @property
    def code(self) -> int:
        """:func:`layout_code` of the page shape."""
        return layout_code(self.page_shape, self.token_dim)

    def meta(self) -> BlockMeta:
        """The :class:`BlockMeta` the tiers store and check: ``dtype`` is the dtype code plus
        ``code << 8``; ``row_bytes`` the bytes per token per layer."""
        return BlockMeta(self.num_layers, self.page_size, self.page_bytes // self.page_size,
                         DTYPE_CODES[self.dtype] | self.code << LAYOUT_SHIFT, self.block_bytes)

    @staticmethod
    def of_caches(caches: Sequence[torch.Tensor], block_dim: int, token_dim: int) -> BlockLayout:
        """The layout of per-layer caches whose ``block_dim`` indexes blocks.

        Args:
            caches: one tensor per layer, all of one shape and dtype.
            block_dim: the dim of each cache that block ids index (0 for ``[num_blocks, ...]``,
                1 for vLLM's ``[2, num_blocks, ...]``).
            token_dim: the dim of the page (the cache without ``block_dim``) that counts tokens.

        Raises:
            ValueError: no caches, caches of different shapes or dtypes, or a dim out of range.

        Example:
            >>> kv = [torch.zeros(2, 10, 16, 4, 8, dtype=torch.bfloat16)] * 3
            >>> BlockLayout.of_caches(kv, block_dim=1, token_dim=1).page_shape
            (2, 16, 4, 8)
        """
        if not caches:
            raise ValueError("caches must hold one tensor per layer, got none")
        first = caches[0]
        for i, c in enumerate(caches):
            if c.shape != first.shape or c.dtype != first.dtype:
                raise ValueError(f"caches[{i}] is {tuple(c.shape)} {c.dtype}, expected {tuple(first.shape)} "
                                 f"{first.dtype} like caches[0]")
        if not 0 <= block_dim < first.dim():
            raise ValueError(f"block_dim must be a dim of the caches' shape {tuple(first.shape)}, got {block_dim}")
        page = tuple(s for d, s in enumerate(first.shape) if d != block_dim)
        return BlockLayout(len(caches), page, token_dim, first.dtype)


def gather_blocks(caches: Sequence[torch.Tensor], block_dim: int, block_ids: Sequence[int],
                  out: torch.Tensor) -> None:
    """Copy blocks ``block_ids`` of every layer into ``out`` as tier blocks, synchronously.

    Args:
        caches: per-layer caches (:meth:`BlockLayout.of_caches`), on any device.
        block_dim: the dim of each cache that block ids index.
        block_ids: block ids in the caches.
        out: contiguous CPU uint8 buffer of at least ``len(block_ids) * block_bytes`` bytes:
            block ``i`` (``[num_layers, *page_shape]``) goes to bytes ``[i * block_bytes, ...)``.

    Raises:
        ValueError: a buffer too small or not contiguous.
    """
    n, first = len(block_ids), caches[0]
    dst = _block_view(caches, block_dim, n, out)
    if n == 0:
        return
    ids = torch.tensor(list(block_ids), dtype=torch.long, device=first.device)
    for layer, cache in enumerate(caches):
        dst[:, layer].copy_(torch.index_select(cache, block_dim, ids).movedim(block_dim, 0))


def scatter_blocks(src: torch.Tensor, caches: Sequence[torch.Tensor], block_dim: int,
                   block_ids: Sequence[int], layers: Sequence[int] | None = None) -> None:
    """Copy tier blocks from ``src`` into blocks ``block_ids`` of every layer (or of ``layers``,
    indices into ``caches``), synchronously (the inverse of :func:`gather_blocks`; same
    arguments, ``block_ids`` distinct).

    Raises:
        ValueError: a buffer too small or not contiguous, or repeated block ids.
    """
    n, first = len(block_ids), caches[0]
    if len(set(block_ids)) != n:
        raise ValueError(f"block_ids must be distinct for a scatter, got {list(block_ids)}")
    blocks = _block_view(caches, block_dim, n, src)
    if n == 0:
        return
    ids = torch.tensor(list(block_ids), dtype=torch.long, device=first.device)
    for layer in (range(len(caches)) if layers is None else layers):
        caches[layer].index_copy_(block_dim, ids, blocks[:, layer].to(first.device).movedim(0, block_dim))


def _block_view(caches: Sequence[torch.Tensor], block_dim: int, n: int, buf: torch.Tensor) -> torch.Tensor:
    """``buf``'s first ``n`` blocks as ``[n, num_layers, *page_shape]`` of the caches' dtype."""
    first = caches[0]
    page = [s for d, s in enumerate(first.shape) if d != block_dim]
    need = n * len(caches) * first.element_size()
    for s in page:
        need *= s
    have = buf.numel() * buf.element_size()
    if buf.device.type != "cpu" or not buf.is_contiguous() or have < need:
        raise ValueError(f"buffer must be a contiguous CPU tensor of at least {need} bytes ({n} blocks), got "
                         f"{have} bytes on {buf.device}{'' if buf.is_contiguous() else ', not contiguous'}")
    return buf.reshape(-1).view(torch.uint8)[:need].view(first.dtype).view(n, len(caches), *page)
