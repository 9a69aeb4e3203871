"""Hooks that SIGKILL their own training process, or one of its data-loading workers, at chosen iterations;
loaded by dotted path in a subprocess.

``tests/engine/test_kill_resume.py`` passes
``HOOKS.CUSTOM "[{'type': 'support.kill_plugins.KillAt', 'at': [k1, k2, k3]}]"`` to ``tools/train_net.py`` in
processes forked from the session's fork server; every process the suite starts has tests/ on its ``PYTHONPATH``
(tests/conftest.py), so ``support.kill_plugins`` imports there as in the test process.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Sequence
from typing import Any

import torch

from pet.engine.hooks import Priority, TestCallback, TrainHook


class KillAt(TrainHook):
    """SIGKILLs this process in ``after_step`` of each iteration in ``at`` (1-based: iterations completed), once each.

    It runs first (HIGHEST), so nothing of that step is persisted: neither its metrics nor its
    checkpoint. Before the kill it leaves ``killed_at_{k}`` in ``output_dir``, so the restarted run,
    given the same command, goes past ``k`` when it trains that iteration again and dies at the next point.
    """

    priority = Priority.HIGHEST

    def __init__(self, at: Sequence[int], output_dir: str) -> None:
        self.at = {int(k) for k in at}
        self.output_dir = output_dir

    def after_step(self, trainer: Any, **kwargs: Any) -> None:
        k = trainer.iter
        marker = os.path.join(self.output_dir, f"killed_at_{k}")
        if k in self.at and not os.path.exists(marker):
            with open(marker, "w", encoding="utf-8"):
                pass
            os.kill(os.getpid(), signal.SIGKILL)


class KillWorkerAt(TrainHook):
    """SIGKILLs one data-loading worker of the training loader in ``after_step`` of iteration ``at``, once.

    As the out-of-memory killer would: the worker dies, the training process lives on. ``rank``
    (when given) picks the process whose worker dies. It waits until the worker is a zombie (the
    SIGCHLD is sent) and leaves ``worker_killed`` in ``output_dir`` so the resumed run does not kill
    again. Which later fetch notices the death depends on when the signal reaches the main thread.
    """

    priority = Priority.HIGHEST

    def __init__(self, at: int, output_dir: str, rank: int | None = None) -> None:
        self.at = int(at)
        self.rank = rank
        self.marker = os.path.join(output_dir, "worker_killed")

    def after_step(self, trainer: Any, **kwargs: Any) -> None:
        if trainer.iter != self.at or os.path.exists(self.marker):
            return
        if self.rank is not None and torch.distributed.get_rank() != self.rank:
            return
        workers = [p for p in multiprocessing.active_children() if p.is_alive()]
        assert workers, "the loader should run worker processes (DATA.NUM_WORKERS > 0)"
        with open(self.marker, "w", encoding="utf-8") as f:
            f.write(str(workers[0].pid))
        os.kill(workers[0].pid, signal.SIGKILL)
        while _state(workers[0].pid) not in ("Z", "X", None):
            time.sleep(0.01)
        time.sleep(0.2)  # time for the SIGCHLD to reach the main thread, so the stop usually comes next step


def _state(pid: int) -> str | None:
    """The process state letter from /proc (Z: zombie), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


class KillTestWorker(TestCallback):
    """A test callback (``TEST.HOOKS``) that SIGKILLs one worker of the test loader after the first batch."""

    def __init__(self) -> None:
        self.done = False

    def after_test_iter(self, **kwargs: Any) -> None:
        if not self.done:
            self.done = True
            os.kill(multiprocessing.active_children()[0].pid, signal.SIGKILL)


class KillRankAt(TrainHook):
    """SIGKILLs global rank ``rank`` in ``after_step`` of iteration ``at``, once (a marker in ``output_dir``, which
    the restarted run sees): one worker of a distributed run lost, as a machine that crashes loses it."""

    priority = Priority.HIGHEST

    def __init__(self, at: int, rank: int, output_dir: str) -> None:
        self.at, self.rank = int(at), int(rank)
        self.marker = os.path.join(output_dir, f"killed_rank{rank}_at_{at}")

    def after_step(self, trainer: Any, **kwargs: Any) -> None:
        if trainer.iter == self.at and torch.distributed.get_rank() == self.rank and not os.path.exists(self.marker):
            with open(self.marker, "w", encoding="utf-8"):
                pass
            os.kill(os.getpid(), signal.SIGKILL)


class SleepAt(TrainHook):
    """Global rank ``rank`` sleeps ``seconds`` in ``before_step`` of iteration ``at``: a hung process (a deadlocked
    data worker, a stuck file system), while the others wait for it in the step's gradient all-reduce."""

    def __init__(self, at: int, rank: int, seconds: float) -> None:
        self.at, self.rank, self.seconds = int(at), int(rank), float(seconds)

    def before_step(self, trainer: Any, **kwargs: Any) -> None:
        if trainer.iter == self.at and torch.distributed.get_rank() == self.rank:
            time.sleep(self.seconds)
