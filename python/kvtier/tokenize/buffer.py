"""Fused per-session token buffer: ids plus the block-hash chain of their full pages.

A session's ids live in one growable C++ array of uint32 (``kvtier._C.TokenBuffer``) that
keeps the chain of block hashes (:func:`kvtier.cache.block_hashes`, the prefix index's hash)
of every full ``page_size`` page up to date as ids are appended or rolled back. A new turn
then costs O(new tokens): appending ``n`` ids hashes only the pages they complete, and
``block_hashes(start)`` returns only the hashes from block ``start`` on.

It fits :class:`kvtier.tokenize.IdStore` (``append``, ``truncate``, ``ids()``, ``len``), so a
:class:`~kvtier.tokenize.SessionEncoder` can keep its ids in it.

Views of the ids (``ids()``, ``numpy.asarray(buf)``, ``memoryview(buf)``) are read-only and
never copy. While any view is alive the storage cannot move: an ``append`` that needs more
than ``capacity`` ids raises ``BufferError`` (drop the views, or ``reserve`` beforehand).
``truncate`` and appends within ``capacity`` are allowed; a live view keeps its length and
sees the new contents of the positions it covers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtier import _C


class TokenBuffer:
    """A session's token ids and the hashes of their full pages.

    Args:
        page_size: tokens per KV page (> 0); one hash per full page.
        salt: tenant salt (bytes, may be empty); different salts never share a chain.

    Raises:
        ValueError: ``page_size <= 0``.

    Example:
        >>> from kvtier.cache import block_hashes
        >>> buf = TokenBuffer(page_size=4)
        >>> buf.append([1, 2, 3, 4, 5])
        >>> len(buf), buf.num_blocks
        (5, 1)
        >>> buf.block_hashes() == block_hashes([1, 2, 3, 4, 5], 4)
        True
        >>> buf.truncate(3); buf.num_blocks
        0
    """

    def __init__(self, page_size: int, salt: bytes = b"") -> None:
        self._buf = _C.TokenBuffer(page_size, salt)

    def append(self, ids: Sequence[int] | np.ndarray) -> None:
        """Append ids and hash every page they complete (O(len(ids))).

        Args:
            ids: [n] token ids: a list of ints or a 1-D integer numpy array / CPU torch tensor,
                each in [0, 2**32). A C-contiguous uint32 array is read without conversion.
                Above 1024 ids the work runs without the GIL.

        Raises:
            ValueError: an id outside [0, 2**32) (the message names its index) or ``ids`` not 1-D.
            TypeError: ids that are not integers (float, bool or object dtype).
            BufferError: the storage must grow while a view of the ids is alive.

        On error nothing is appended.
        """
        self._buf.append(ids)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` ids; drop the hashes of pages no longer full (O(1) in the ids).

        Raises:
            ValueError: ``n < 0`` or ``n > len(self)``.
        """
        self._buf.truncate(n)

    def reserve(self, capacity: int) -> None:
        """Make room for ``capacity`` ids (tokens) so appends up to it never move the storage.

        Raises:
            ValueError: ``capacity < 0``.
            BufferError: the storage must grow while a view of the ids is alive.
        """
        self._buf.reserve(capacity)

    def ids(self) -> np.ndarray:
        """[len(self)] uint32, a read-only view of the ids (no copy; see the module notes)."""
        return self._buf.ids

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        if copy:
            return np.array(self._buf.ids, dtype=dtype)
        return self._buf.ids if dtype is None else self._buf.ids.astype(dtype, copy=False)

    def __len__(self) -> int:
        """Number of ids (tokens)."""
        return len(self._buf)

    def block_hashes(self, start: int = 0) -> list[bytes]:
        """Hashes of full pages ``start .. num_blocks - 1``, each 16 bytes.

        Equal to ``kvtier.cache.block_hashes(self.ids(), page_size, salt=salt)[start:]``; hash ``i``
        covers ids ``[i * page_size, (i + 1) * page_size)``. Costs O(num_blocks - start).

        Raises:
            ValueError: ``start`` outside [0, num_blocks].
        """
        return self._buf.block_hashes(start)

    def chain_for(self, ids: Sequence[int] | np.ndarray, page_size: int, salt: bytes) -> list[bytes]:
        """The hashes of every full page of ``ids``, read from this buffer without hashing, once
        it is checked to hold exactly ``ids`` hashed with ``page_size`` and ``salt``.

        What a consumer (the engine's admission) calls instead of hashing ``ids`` again: the
        hashes were computed by the native buffer from its own ids as they were appended, so
        they are ``kvtier.cache.block_hashes(ids, page_size, salt=salt)`` by construction.
        Costs one compare of the ids (O(len(ids)), no hashing) and O(num_blocks).

        Args:
            ids: [num_tokens] the token ids the hashes are wanted for.
            page_size: tokens per page the consumer's hashes use.
            salt: the salt the consumer's hashes use (all its parts, e.g. the pool's salt plus
                the request's).

        Returns:
            ``len(ids) // page_size`` hashes, 16 bytes each.

        Raises:
            ValueError: the page size, the salt or the ids differ from the buffer's (the
                message says which), or this is not a native buffer.
        """
        native = self._buf
        if type(native) is not _C.TokenBuffer:
            raise ValueError(f"the buffer is not a native kvtier._C.TokenBuffer (got {type(native).__name__})")
        if native.page_size != page_size:
            raise ValueError(f"its page_size={native.page_size}, expected page_size={page_size}")
        if native.salt != salt:
            raise ValueError("its salt differs from the expected salt")
        view = native.ids
        try:
            same = len(view) == len(ids) and np.array_equal(view, np.asarray(ids))
        finally:
            del view  # a live view pins the storage
        if not same:
            raise ValueError(f"its {len(self)} ids are not the {len(ids)} ids given")
        return native.block_hashes(0)

    @property
    def num_blocks(self) -> int:
        """Number of full pages, ``len(self) // page_size``."""
        return self._buf.num_blocks

    @property
    def last_hash(self) -> bytes:
        """Hash of the last full page (16 bytes); 16 zero bytes when there is none."""
        return self._buf.last_hash

    @property
    def capacity(self) -> int:
        """Ids the storage holds before it must move."""
        return self._buf.capacity

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self._buf.page_size

    @property
    def salt(self) -> bytes:
        """The tenant salt."""
        return self._buf.salt

    @property
    def num_views(self) -> int:
        """Live buffer-protocol views of the ids (each pins the storage)."""
        return self._buf.num_views

    def __repr__(self) -> str:
        return f"TokenBuffer(len={len(self)}, page_size={self.page_size}, num_blocks={self.num_blocks})"
