"""Result files written so that a reader never sees half of one: :func:`write_json` (temp file,
fsync, rename) and :func:`check_writable` (fail before a long run, not after it)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path


def check_writable(path: str | os.PathLike) -> None:
    """Fail early when ``write_json(path, ...)`` could not write ``path``.

    Creates and removes a temporary file beside ``path`` (the same operation ``write_json``
    performs); an existing ``path`` is not opened or modified, and no file is left behind.

    Raises:
        ValueError: naming ``path``, when it is a directory or another non-regular file, its
            parent directory does not exist, or a file cannot be created in that directory.
    """
    p = Path(path)
    if p.exists() and not p.is_file():
        raise ValueError(f"output path {str(p)!r} exists and is not a regular file")
    parent = p.parent
    if not parent.is_dir():
        raise ValueError(f"output path {str(p)!r}: directory {str(parent)!r} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{p.name}.", suffix=".tmp")
    except OSError as e:
        raise ValueError(f"output path {str(p)!r} is not writable: {e.strerror}") from e
    os.close(fd)
    os.unlink(tmp)


def _new_file_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_json(path: str | os.PathLike, data: dict) -> Path:
    """Write ``data`` to ``path`` as JSON (indent 2) atomically: temp file, fsync, rename.

    A reader sees either the old file or the complete new one. An existing file's permission
    bits are kept; a new file gets the usual ``0o666 & ~umask``.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        ValueError: ``data`` holds NaN or infinity (not valid JSON); nothing is written.
        TypeError: ``data`` holds a value JSON cannot encode; nothing is written.
        OSError: the directory is missing or not writable (``check_writable`` reports it early).
    """
    p = Path(path)
    mode = p.stat().st_mode & 0o7777 if p.is_file() else _new_file_mode()
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, allow_nan=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return p
