"""Checkpoint files on disk: atomic writes and the ``last_checkpoint`` pointer.

A checkpoint is written to a temporary file in the same directory (:func:`pet.utils.files.write_bytes_atomic`),
flushed to disk and renamed over the target, so a crash or a full disk never leaves a half-written file
under the final name; ``last_checkpoint`` is replaced the same way, only after its checkpoint is complete.
A write that fails says what to do (:func:`explain_write_failure`).
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

from pet.utils import comm
from pet.utils.errors import TrainingError
from pet.utils.files import is_temporary_name, write_bytes_atomic, write_failure_remedy

__all__ = ["LAST_CHECKPOINT", "atomic_save", "explain_write_failure", "write_last_checkpoint",
           "read_last_checkpoint"]

logger = logging.getLogger(__name__)

LAST_CHECKPOINT = "last_checkpoint"


def atomic_save(obj: Any, path: str) -> None:
    """``torch.save(obj, path)`` that never leaves a partial file at ``path``.

    The checkpoint is serialised in memory first: torch's zip writer turns a failed
    disk write into an opaque RuntimeError, a plain file write reports the real cause
    (no space left, permission denied, file too large).
    """
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    with explain_write_failure(path):
        write_bytes_atomic(path, buffer.getbuffer(), fsync=True)


@contextlib.contextmanager
def explain_write_failure(path: str) -> Iterator[None]:
    """An OSError writing the checkpoint file ``path`` in the block becomes a TrainingError that says the
    previous checkpoint is intact and what to do (by cause: permissions, space, size limit)."""
    try:
        yield
    except OSError as exc:
        raise TrainingError(
            f"Could not write {path}: {exc.strerror or exc}. The previous checkpoint is intact; "
            f"{write_failure_remedy(exc, os.path.dirname(os.path.abspath(path)))}, then resume with the same command."
        ) from exc


def write_last_checkpoint(save_dir: str, filename: str) -> None:
    """Point ``save_dir/last_checkpoint`` at ``filename`` (a complete checkpoint)."""
    pointer = os.path.join(save_dir, LAST_CHECKPOINT)
    with explain_write_failure(pointer):
        write_bytes_atomic(pointer, filename.encode(), fsync=True)


def read_last_checkpoint(save_dir: str) -> str | None:
    """Path of the newest complete checkpoint in ``save_dir``, or None.

    The main process also removes temporary files an interrupted write left (see
    :func:`pet.utils.files.temporary_path`) in ``save_dir`` and in the named checkpoint's directory;
    they are never read. Other processes leave them alone: all would race to delete
    the same files.
    """
    pointer = os.path.join(save_dir, LAST_CHECKPOINT)
    path = None
    if os.path.isfile(pointer):
        with open(pointer, encoding="utf-8") as f:
            name = f.read().strip()
        path = os.path.join(save_dir, name)
    if comm.is_main_process():
        checkpoint_dir = os.path.dirname(os.path.abspath(path or pointer))
        for directory in dict.fromkeys((os.path.abspath(save_dir), checkpoint_dir)):
            _remove_leftover_temporary_files(directory)
    if path is not None and not os.path.isfile(path):
        raise TrainingError(
            f"{pointer} names {name}, which does not exist. Restore the file or delete {pointer} to start over."
        )
    return path


def _remove_leftover_temporary_files(directory: str) -> None:
    if not os.path.isdir(directory):
        return
    for entry in sorted(os.listdir(directory)):
        leftover = os.path.join(directory, entry)
        if is_temporary_name(entry) and os.path.isfile(leftover):
            logger.warning(f"Removing {leftover}, left by an interrupted checkpoint write")
            os.remove(leftover)
