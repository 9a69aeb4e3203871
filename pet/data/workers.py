"""Data-loading worker processes that die (the out-of-memory killer's SIGKILL, a crash).

When a DataLoader worker dies, torch raises ``RuntimeError: DataLoader worker (pid N) is killed
by signal: Killed`` from its SIGCHLD handler, that is wherever the main thread happens to be: in
the middle of a backward pass, an optimizer step or a checkpoint write. Or the main process,
halfway through receiving a batch from that worker, fails with ``ConnectionResetError``.

Here a death is acted on at one point only, the batch fetch (:func:`fetch`): there everything up to
the last completed iteration is consistent, so the trainer can save it and stop, and the test loop can
stop with one line. A process-wide watch wraps torch's SIGCHLD handler so that its error becomes a
note read at the next fetch instead of an exception raised mid-step.
"""
from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from pet.utils.errors import PetError

__all__ = ["WorkerDied", "WORKER_DIED_EXIT_CODE", "fetch", "watched", "worker_death", "remedy"]

# EX_TEMPFAIL (sysexits.h): a temporary failure; the same command, run again, resumes.
WORKER_DIED_EXIT_CODE = 75
# How long a failed fetch waits for the SIGCHLD that says a worker died (it can lag the error it caused).
_DEATH_WAIT_SECONDS = 2.0

# torch's two wordings: from the SIGCHLD handler, and from a fetch that found a worker gone.
_KILLED = re.compile(r"DataLoader worker \(pid (\d+)\) is killed by signal: (.+?)\.?\s*$", re.M)
_EXITED = re.compile(r"DataLoader worker \(pid\(?s?\)? ([\d, ]+)\) exited unexpectedly(?: with exit code (-?\d+))?")


class WorkerDied(PetError):
    """A data-loading worker process died; the tools exit with :data:`WORKER_DIED_EXIT_CODE`."""

    exit_code = WORKER_DIED_EXIT_CODE


def worker_death(exc: BaseException) -> str | None:
    """What died, if ``exc`` is torch's worker-death error: "data-loading worker (pid N) was killed by ..."."""
    if not isinstance(exc, RuntimeError):
        return None
    text = str(exc)
    killed = _KILLED.search(text)
    if killed:
        name = _signal_name(killed.group(2))
        cause = ", most likely by the out-of-memory killer" if name.startswith("SIGKILL") else ""
        return f"data-loading worker (pid {killed.group(1)}) was killed by signal {name}{cause}"
    exited = _EXITED.search(text)
    if exited:
        code = f" with exit code {exited.group(2)}" if exited.group(2) else ""
        return (f"data-loading worker (pid {exited.group(1).strip()}) exited unexpectedly{code} (killed for memory, "
                "or crashed in native code)")
    return None


def remedy(num_workers: int | None) -> str:
    """What to try, for the one-line message: each worker holds its own prefetched batches and record copies."""
    workers = f" (now {num_workers})" if num_workers is not None else ""
    return f"lower DATA.NUM_WORKERS{workers} or SOLVER.IMS_PER_BATCH, or free memory"


def fetch(iterator: Iterator[Any]) -> tuple[Any, str | None]:
    """``(next(iterator), None)``, or ``(None, what died)`` when a data-loading worker has died.

    A death shows as torch's error, as any other error of a fetch that coincides with a death (waiting
    up to two seconds for its SIGCHLD), or as a death signalled since the last fetch. StopIteration
    and Pet's own errors (a corrupt image) pass through. Each death is reported once.
    """
    _WATCH.follow(iterator)
    try:
        batch = next(iterator)
    except (StopIteration, PetError):
        raise
    except Exception as exc:  # noqa: BLE001 - a dying worker breaks a fetch in many ways
        # The signal, when it comes, says more (which signal) than torch's "exited unexpectedly".
        death = _WATCH.wait_for_death(_DEATH_WAIT_SECONDS) or worker_death(exc)
        if death is None:
            raise
        _WATCH.death = None
        return None, death
    _WATCH.arm()  # torch installs its handler when a loader first starts workers: wrap it from then on
    death, _WATCH.death = _WATCH.death, None
    return (None, death) if death else (batch, None)


def watched(loader: Iterable[Any], what: str = "Stopped") -> Iterator[Any]:
    """Iterate ``loader``; a worker that dies stops the iteration with one :class:`WorkerDied` line."""
    iterator = iter(loader)
    while True:
        try:
            batch, death = fetch(iterator)
        except StopIteration:
            return
        if death is not None:
            raise WorkerDied(f"{what}: a {death}. Run the same command again (training resumes from its last "
                             f"checkpoint); if it happens again, {remedy(getattr(loader, 'num_workers', None))}.")
        yield batch


class _SigchldWatch:
    """Wraps whatever SIGCHLD handler is installed (torch's) so that its error becomes :attr:`death`.

    One per process, since a signal handler is per process. Only the main thread can set handlers;
    elsewhere it does nothing and torch's handler stays as it is.
    """

    def __init__(self) -> None:
        self.death: str | None = None
        self._wrapped: Callable[..., Any] | None = None
        self._inside = False
        self._iterator_id: int | None = None  # an id, not the iterator: a reference would keep its workers alive

    def follow(self, iterator: Iterator[Any]) -> None:
        """Fetches now come from ``iterator``: a death noted before its first fetch belonged to an earlier
        iteration (another run in this process, a loader already finished) and is forgotten."""
        if self._iterator_id != id(iterator):
            self._iterator_id = id(iterator)
            self.death = None

    def arm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        current = signal.getsignal(signal.SIGCHLD)
        if current == self._on_sigchld:
            return
        self._wrapped = current if callable(current) else None
        signal.signal(signal.SIGCHLD, self._on_sigchld)

    def wait_for_death(self, seconds: float) -> str | None:
        """The noted death, waiting up to ``seconds`` for the signal (a sleep lets the handler run)."""
        deadline = time.monotonic() + seconds
        while self.death is None and self._wrapped is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.death

    def _on_sigchld(self, signum: int, frame: Any) -> None:
        # torch's handler calls the one it replaced, which may be this one (armed before torch installed its
        # own): the guard ends that loop.
        if self._wrapped is None or self._inside:
            return
        self._inside = True
        try:
            self._wrapped(signum, frame)
        except RuntimeError as exc:
            self.death = self.death or worker_death(exc) or str(exc)
        finally:
            self._inside = False


_WATCH = _SigchldWatch()


def _signal_name(text: str) -> str:
    """``Killed`` (strsignal's wording, as torch reports it) -> ``SIGKILL (Killed)``."""
    for sig in signal.Signals:
        if signal.strsignal(sig) == text:
            return f"{sig.name} ({text})"
    return text
