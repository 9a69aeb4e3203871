"""Files the evaluation and prediction write: replaced atomically, so a reader never sees half a file.

Every output is staged under a hidden temporary name in its own folder (``.tmp-XXXX<ext>``, keeping the
final extension, which some writers such as opencv's VideoWriter choose the format by) and renamed over
the final name only once complete. A run killed half-way therefore leaves complete files and, at
worst, hidden temporary ones; never a truncated file under a final name.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from typing import IO, Any

__all__ = ["atomic_path", "atomic_open", "write_bytes_atomic", "write_json_atomic"]

# Temporary files are created 0600; the final file gets the permissions a plain open() would give.
_UMASK = os.umask(0)
os.umask(_UMASK)


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """A temporary path beside ``path``, with its extension, to write to; renamed over ``path`` when the block
    ends without an exception, removed when it raises."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.splitext(path)[1])
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "w", **kwargs: Any) -> Iterator[IO]:
    """``open(path, mode)`` on a temporary file that replaces ``path`` when the block completes (see
    :func:`atomic_path`); a file written over a long run (a CSV row per image) appears only whole."""
    with atomic_path(path) as tmp, open(tmp, mode, **kwargs) as f:
        yield f


def write_bytes_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    with atomic_open(path, "wb") as f:
        f.write(data)


def write_json_atomic(path: str, obj: Any) -> None:
    """Write JSON to a temporary file in the same folder, then rename it over ``path``."""
    with atomic_open(path, "w") as f:
        json.dump(obj, f)
