"""A hook that SIGKILLs its own training process at chosen iterations, loaded by dotted path in a subprocess.

``tests/test_kill_resume.py`` puts this folder on the child's ``PYTHONPATH`` and passes
``HOOKS.CUSTOM "[{'type': 'kill_plugins.KillAt', 'at': [k1, k2, k3]}]"`` to ``tools/train_net.py``.
"""
from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from typing import Any

from pet.engine.hooks import Priority, TrainHook


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
