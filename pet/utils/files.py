"""Files written atomically: staged beside their target and renamed over it only once complete.

Every file Pet writes that a reader (a resume, a test, a user's script) may find half-done goes
through :func:`atomic_path` or one of the helpers on top of it: checkpoints and
``last_checkpoint``, ``metrics.json`` when a resume rewrites it, evaluation results, everything
tools/predict.py writes, the demo dataset's folder. A crash, a kill or a full disk therefore
leaves complete files and, at worst, a staged one; never a truncated file under a final name.

The staged name is ``{path}.tmp{pid}`` (:func:`temporary_path`), or ``{stem}.tmp{pid}{ext}``
with ``keep_extension`` for writers that choose the format by the extension (opencv's
VideoWriter: ``clip.tmp4242.mp4``). :func:`is_temporary_name` recognises exactly the first form,
so a run can remove what a killed one left (:func:`pet.checkpoint.read_last_checkpoint` does
in the checkpoint folder) without touching a user's ``notes.tmp``.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from typing import IO, Any

__all__ = [
    "temporary_path",
    "is_temporary_name",
    "atomic_path",
    "atomic_open",
    "write_bytes_atomic",
    "write_json_atomic",
    "write_failure_remedy",
    "file_sha256",
    "file_lock",
]

# Exactly the names temporary_path() makes without keep_extension; "notes.tmp" or "x.tmp.json" never match.
_TEMPORARY_NAME = re.compile(r".+\.tmp\d+")


def temporary_path(path: str, *, keep_extension: bool = False) -> str:
    """Where a write to ``path`` is staged: ``{path}.tmp{pid}`` (``{stem}.tmp{pid}{ext}`` with ``keep_extension``)."""
    if keep_extension:
        stem, ext = os.path.splitext(path)
        return f"{stem}.tmp{os.getpid()}{ext}"
    return f"{path}.tmp{os.getpid()}"


def is_temporary_name(name: str) -> bool:
    """``name`` (a file name, no folder) is one :func:`temporary_path` makes without ``keep_extension``."""
    return _TEMPORARY_NAME.fullmatch(name) is not None


@contextlib.contextmanager
def atomic_path(path: str, *, keep_extension: bool = False) -> Iterator[str]:
    """The staged path of ``path`` (see :func:`temporary_path`) to write a file, or fill a folder, at.

    When the block ends without an exception it is renamed over ``path`` (a folder replaces the old
    folder, which is removed first); when it raises, it is removed and the exception goes on. A
    stale staged file of this process is removed on entry.
    """
    tmp = temporary_path(path, keep_extension=keep_extension)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    _remove(tmp)
    try:
        yield tmp
        if os.path.isdir(tmp):
            if os.path.isdir(path):
                shutil.rmtree(path)
            os.rename(tmp, path)
        else:
            os.replace(tmp, path)
            if os.path.lexists(tmp):  # a hard link renamed onto the file it already names: rename() does nothing
                os.remove(tmp)
    except BaseException:
        with contextlib.suppress(OSError):
            _remove(tmp)
        raise


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "w", *, fsync: bool = False, **kwargs: Any) -> Iterator[IO]:
    """``open(path, mode)`` on the staged file, which replaces ``path`` when the block completes; a file
    written over a long run (a CSV row per image) appears only whole. ``fsync``: flush it to the disk
    before the rename (checkpoints: the rename must not reach the disk before the data)."""
    with atomic_path(path) as tmp, open(tmp, mode, **kwargs) as f:
        yield f
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def write_bytes_atomic(path: str, data: bytes | memoryview, *, fsync: bool = False) -> None:
    """Write ``data`` to ``path`` through the staged file and a rename."""
    with atomic_open(path, "wb", fsync=fsync) as f:
        f.write(data)


def write_json_atomic(path: str, obj: Any) -> None:
    """``json.dump(obj)`` to ``path`` through the staged file and a rename."""
    with atomic_open(path, "w") as f:
        json.dump(obj, f)


def write_failure_remedy(exc: OSError, directory: str) -> str:
    """What to do about the failed write ``exc`` into ``directory``, by cause (permissions, space, size limit)."""
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (f"make {directory} writable for this user, or point CKPT (or HOOKS.CHECKPOINT.OUT_DIR) "
                "at a writable directory")
    if exc.errno == errno.EFBIG:
        return "raise the file-size limit (ulimit -f), or point CKPT at a file system that allows larger files"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"free space on the disk holding {directory}"
    return f"check that {directory} is writable and has free space"


def file_sha256(path: str) -> str:
    """The hex sha256 of the file ``path``, read in 1 MiB blocks (weights files run to hundreds of MB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


@contextlib.contextmanager
def file_lock(path: str) -> Iterator[None]:
    """Hold an exclusive lock on the file ``path`` (created if missing) for the block: one process at a time, e.g.
    one writes a shared set or measures while the others wait and then read what it wrote. POSIX only; elsewhere
    the block runs unlocked."""
    try:
        import fcntl  # POSIX only
    except ImportError:  # not POSIX: no cross-process lock (callers keep their files whole by renames)
        yield
        return
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
