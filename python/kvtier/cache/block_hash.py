"""The chained block hash of docs/architecture.md's contract.

``h_i = SHA-256(h_{i-1} || le_u32(len(salt)) || salt || le_u32(t) for t in block_i)[0:16]``
with ``h_{-1}`` = 16 zero bytes. Only full blocks are hashed. 128 bits wide: at 1e9 distinct
blocks the birthday bound puts the collision probability near ``n**2 / 2**129`` ~ 1.5e-21.

``block_hashes`` is the native implementation (``kvtier._C``, OpenSSL SHA-256, GIL released);
``block_hashes_py`` is its pure-Python twin (``hashlib``), kept for tests and as the spec.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

from kvtier import _C

BLOCK_HASH_BYTES: int = _C.BLOCK_HASH_BYTES
ROOT_HASH = bytes(BLOCK_HASH_BYTES)


def block_hashes(
    token_ids: Sequence[int] | np.ndarray, page_size: int, parent: bytes | None = None, salt: bytes = b""
) -> list[bytes]:
    """Hashes of every full ``page_size`` block of ``token_ids``, chained from ``parent``.

    Args:
        token_ids: [num_tokens] token ids (list or integer array), each in [0, 2**32).
        page_size: tokens per block (> 0); a trailing partial block is not hashed.
        parent: 16-byte hash of the block before ``token_ids[0]``; None at a sequence start.
        salt: tenant salt; different salts never produce the same chain.

    Returns:
        ``len(token_ids) // page_size`` hashes, each 16 ``bytes``.

    Raises:
        ValueError: a token id out of range, ``page_size <= 0`` or a malformed ``parent``.
    """
    arr = np.asarray(token_ids, dtype=np.int64)
    return _C.block_hashes(arr, page_size, parent, salt)


def compose_salt(*parts: bytes) -> bytes:
    """One salt from several parts (model id, compute dtype, tenant salt), each prefixed with its
    length as a little-endian u32, so that two different lists of parts never give the same salt
    (plain concatenation would let ``("ab", "c")`` and ``("a", "bc")`` share blocks).

    Args:
        parts: ``bytes`` each.

    Raises:
        ValueError: a part that is not ``bytes``.

    Example:
        >>> compose_salt(b"ab", b"c") != compose_salt(b"a", b"bc")
        True
    """
    for i, p in enumerate(parts):
        if not isinstance(p, bytes):
            raise ValueError(f"salt part {i} must be bytes, got {p!r} ({type(p).__name__})")
    return b"".join(struct.pack("<I", len(p)) + p for p in parts)


def block_hashes_py(
    token_ids: Sequence[int], page_size: int, parent: bytes | None = None, salt: bytes = b""
) -> list[bytes]:
    """Pure-Python twin of :func:`block_hashes` (same arguments, results and errors)."""
    if page_size <= 0:
        raise ValueError(f"page_size must be > 0, got {page_size}")
    prev = ROOT_HASH if parent is None else parent
    if len(prev) != BLOCK_HASH_BYTES:
        raise ValueError(f"parent must be bytes of length {BLOCK_HASH_BYTES}, got length {len(prev)}")
    for i, t in enumerate(token_ids):
        if not 0 <= int(t) < 2**32:
            raise ValueError(f"token_ids[{i}] must be in [0, 2**32), got {int(t)}")
    head = struct.pack("<I", len(salt)) + salt
    out = []
    for b in range(len(token_ids) // page_size):
        block = token_ids[b * page_size : (b + 1) * page_size]
        body = struct.pack(f"<{page_size}I", *(int(t) for t in block))
        prev = hashlib.sha256(prev + head + body).digest()[:BLOCK_HASH_BYTES]
        out.append(prev)
    return out
