"""Hooks and a writer loaded by dotted path in the fault-injection runs of ``tests/support/toy_train.py``.

tests/ is on ``sys.path`` wherever toy_train runs (pytest.ini's ``pythonpath`` in the test process, the
``PYTHONPATH`` tests/conftest.py gives every process the suite starts), so a test passes
``HOOKS.CUSTOM "[{'type': 'support.fault_plugins.AfterTrainMarker'}]"`` or
``TRAIN.WRITERS "[{'type': 'support.fault_plugins.CloseMarker'}]"`` and then reads the files
to see that ``after_train`` ran and writers were closed in a run that was stopped, or
``HOOKS.CUSTOM "[{'type': 'support.fault_plugins.StallWrite', 'name': ..., 'fd': ...}]"`` to
freeze a checkpoint write half-way, where a test kills the process, or ``PauseForSignal``
to signal a run at a known iteration. Both report on a pipe the test waits on.
``FullDisk`` fills the disk under a directory, for any user.
"""
from __future__ import annotations

import builtins
import errno
import os
import re
import signal
import threading
from typing import Any

import pet.utils.files
from pet.engine.events import EventStorage, EventWriter
from pet.engine.hooks import TrainHook


class AfterTrainMarker(TrainHook):
    """Writes ``after_train.txt``: the iterations completed when ``after_train`` ran."""

    def __init__(self, output_dir: str) -> None:
        self.path = os.path.join(output_dir, "after_train.txt")

    def after_train(self, trainer: Any, **kwargs: Any) -> None:
        with open(self.path, "w", encoding="utf-8") as f:
            f.write(str(trainer.iter))


class CloseMarker(EventWriter):
    """Writes ``writer_closed.txt`` on ``close()``: the last iteration it was asked to write."""

    def __init__(self, output_dir: str) -> None:
        self.path = os.path.join(output_dir, "writer_closed.txt")
        self.last_written = -1

    def write(self, storage: EventStorage, **kwargs: Any) -> None:
        self.last_written = storage.iter

    def close(self) -> None:
        with open(self.path, "w", encoding="utf-8") as f:
            f.write(str(self.last_written))


class StallWrite(TrainHook):
    """Freezes the ``occurrence``-th write of the file ``name`` half-way, for a test to SIGKILL the process there.

    Every file :mod:`pet.utils.files` opens for writing is watched, under its final
    name or a temporary one (``name.tmp<pid>``), so the stall lands mid-write whichever
    name the code writes to. The frozen write puts the first half of its data on disk
    (flushed and fsynced), writes the file's path and a newline to the file descriptor ``fd``
    (a pipe the test waits on: no timing assumption) and blocks until the process is killed.
    """

    def __init__(self, name: str, fd: int, occurrence: int = 1) -> None:
        self.name = name
        self.fd = fd
        self.occurrence = occurrence
        self.seen = 0

    def before_train(self, **kwargs: Any) -> None:
        pet.utils.files.open = self._open  # shadows the builtin for that module only

    def after_train(self, **kwargs: Any) -> None:
        del pet.utils.files.open

    def _open(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = builtins.open(file, mode, *args, **kwargs)
        if "w" in mode and re.sub(r"\.tmp\d+$", "", os.path.basename(file)) == self.name:
            self.seen += 1
            if self.seen == self.occurrence:
                return _HalfThenStall(f, self.fd)
        return f


class _HalfThenStall:
    """A file whose first ``write`` writes half its data, signals on ``fd`` and never returns."""

    def __init__(self, f: Any, fd: int) -> None:
        self._f = f
        self._fd = fd

    def write(self, data: Any) -> None:
        self._f.write(data[: len(data) // 2])
        self._f.flush()
        os.fsync(self._f.fileno())
        os.write(self._fd, f"{self._f.name}\n".encode())
        threading.Event().wait()  # until SIGKILL

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._f, attr)

    def __enter__(self) -> _HalfThenStall:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()


class PauseForSignal(TrainHook):
    """After iteration ``at``, reports ``at`` on the file descriptor ``fd`` and waits for SIGTERM or SIGINT.

    The test sends the signal once it reads the report, so it reaches the run at a known
    iteration with no sleep on either side. The signal is held (blocked, then taken with
    ``sigwait``) so it cannot slip in before the wait, then raised again: the trainer's own
    handler gets it as if it had arrived during the step.
    """

    def __init__(self, at: int, fd: int) -> None:
        self.at = at
        self.fd = fd

    def after_step(self, trainer: Any, **kwargs: Any) -> None:
        if trainer.iter != self.at:
            return
        signals = {signal.SIGTERM, signal.SIGINT}
        signal.pthread_sigmask(signal.SIG_BLOCK, signals)
        try:
            os.write(self.fd, f"{self.at}\n".encode())
            signum = signal.sigwait(signals)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
        signal.raise_signal(signum)


class FullDisk(TrainHook):
    """From ``before_train`` on, the file system holding ``directory`` is full, as far as this process can tell.

    Every file opened for writing under ``directory`` (by any code: ``builtins.open`` is wrapped)
    takes the first half of its first write and then fails with ENOSPC, as a write to a file
    system that fills up half-way does. A real full file system needs root to mount; this works
    for any user. Files opened before ``before_train`` (the log, ``metrics.json``) are untouched.
    """

    def __init__(self, directory: str) -> None:
        self.directory = os.path.abspath(directory)
        self._open = builtins.open

    def before_train(self, **kwargs: Any) -> None:
        builtins.open = self._full_open

    def after_train(self, **kwargs: Any) -> None:
        builtins.open = self._open

    def _full_open(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = self._open(file, mode, *args, **kwargs)
        inside = isinstance(file, (str, os.PathLike)) and os.path.abspath(file).startswith(self.directory + os.sep)
        return _NoSpaceLeft(f) if inside and any(m in mode for m in "wax+") else f


class _NoSpaceLeft:
    """A file whose first ``write`` puts down half its data and fails with ENOSPC, as do all after it."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self._full = False

    def write(self, data: Any) -> None:
        if not self._full:
            self._full = True
            self._f.write(data[: len(data) // 2])
            self._f.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._f.name)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._f, attr)

    def __enter__(self) -> _NoSpaceLeft:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()
