"""Checks of public options (``LLM``, ``EngineConfig``, ``PoolConfig``, ``KVPool.tool_wait``).

Each check raises ``ValueError`` naming the option, the value (with its type) and what was
expected, and returns the value unchanged. ``bool`` is never taken as an int or a number
(``True`` is not ``1`` page), and a string is never taken as a size.

Example:
    >>> check_int("max_num_seqs", 8, min_value=1)
    8
    >>> check_int("max_num_seqs", True, min_value=1)
    Traceback (most recent call last):
    ...
    ValueError: max_num_seqs must be an int >= 1, got True (bool)
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterable
from collections.abc import Sequence as Seq

import numpy as np


def _got(value) -> str:
    return f"got {value!r} ({type(value).__name__})"


def flag(name: str) -> str:
    """The command-line option of field ``name`` (``state_host_bytes`` -> ``--state-host-bytes``)."""
    return "--" + name.replace("_", "-")


def is_int(value) -> bool:
    """An integer that is not a bool (Python, numpy or any ``numbers.Integral``)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value, *, min_value: int | None = None, max_value: int | None = None) -> int:
    """``value`` if it is an int (not a bool) in ``[min_value, max_value]``.

    Raises:
        ValueError: another type, or out of range; the message names ``name``.
    """
    bounds = []
    if min_value is not None:
        bounds.append(f">= {min_value}")
    if max_value is not None:
        bounds.append(f"<= {max_value}")
    expected = "an int" + (" " + " and ".join(bounds) if bounds else "")
    if not is_int(value) or (min_value is not None and value < min_value) or (
            max_value is not None and value > max_value):
        raise ValueError(f"{name} must be {expected}, {_got(value)}")
    return value


def check_real(name: str, value, *, min_value: float = -math.inf, min_open: bool = False,
               max_value: float = math.inf) -> float:
    """``value`` if it is a finite real number (not a bool) ``>= min_value`` (``>`` when ``min_open``)
    and ``<= max_value``.

    Raises:
        ValueError: another type, NaN, infinite or out of range; the message names ``name``.
    """
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < min_value or (min_open and value == min_value) or value > max_value:
        upper = f" and <= {max_value}" if max_value < math.inf else ""
        raise ValueError(f"{name} must be a finite number {'>' if min_open else '>='} {min_value}{upper}, "
                         f"{_got(value)}")
    return value


def check_bool(name: str, value) -> bool:
    """``value`` if it is a bool (``"no"``, ``0`` and ``None`` are not).

    Raises:
        ValueError: another type; the message names ``name``.
    """
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, {_got(value)}")
    return value


def check_choice(name: str, value, choices: Iterable[str]) -> str:
    """``value`` if it is one of the strings ``choices``.

    Raises:
        ValueError: another value or type; the message names ``name`` and the choices.
    """
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, {_got(value)}")
    return value


def check_str(name: str, value) -> str:
    """``value`` if it is a ``str`` (bytes, ints and None are not).

    Raises:
        ValueError: another type; the message names ``name``.
    """
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a str, {_got(value)}")
    return value


def check_path(name: str, value, *, optional: bool = True):
    """``value`` if it is a non-empty ``str`` or ``os.PathLike`` (or None when ``optional``).

    An int is never taken as a directory name (it would create ``./123``).

    Raises:
        ValueError: another type or an empty path; the message names ``name``.
    """
    if value is None and optional:
        return value
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value) or isinstance(os.fspath(value), bytes):
        expected = "a non-empty str or os.PathLike" + (" or None" if optional else "")
        raise ValueError(f"{name} must be {expected}, {_got(value)}")
    return value


def checked_token_ids(name: str, token_ids) -> np.ndarray:
    """``token_ids`` as a ``[num_tokens]`` int64 array, after checking it is a 1-D integer array
    or a sequence of ints (a bool, a float or a str is not a token id). Ranges are the caller's.

    Raises:
        ValueError: another type; names ``name`` and the first bad entry.
    """
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1 or token_ids.dtype.kind not in "iu":
            raise ValueError(f"{name} must be a 1-D integer array, got {token_ids.dtype} with shape {token_ids.shape}")
        return token_ids.astype(np.int64, copy=False)
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Seq):
        raise ValueError(f"{name} must be a list of ints or a 1-D integer array, {_got(token_ids)}")
    for i, t in enumerate(token_ids):
        if not is_int(t):
            raise ValueError(f"{name}[{i}] must be an int, {_got(t)}")
    try:
        return np.asarray(token_ids, dtype=np.int64)
    except OverflowError:
        raise ValueError(f"{name} holds an int outside the int64 range") from None


def check_hashable(name: str, value):
    """``value`` if it can key a dict.

    Raises:
        ValueError: an unhashable value (a list, a dict); the message names ``name``.
    """
    try:
        hash(value)
    except TypeError:
        raise ValueError(f"{name} must be hashable, {_got(value)}") from None
    return value


def checked_block_hashes(name: str, hashes, nbytes: int = 16) -> list[bytes]:
    """``hashes`` as a list, after checking each is ``nbytes`` (16) bytes.

    Raises:
        ValueError: not an iterable of such ``bytes``; the message names ``name``.
    """
    if isinstance(hashes, (bytes, str)) or not isinstance(hashes, Iterable):
        raise ValueError(f"{name} must be a list of {nbytes}-byte bytes, {_got(hashes)}")
    hashes = list(hashes)
    for i, h in enumerate(hashes):
        if not isinstance(h, bytes) or len(h) != nbytes:
            raise ValueError(f"{name}[{i}] must be {nbytes} bytes, {_got(h)}")
    return hashes
