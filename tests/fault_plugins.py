"""A hook and a writer that leave marker files, loaded by dotted path in the fault-injection subprocesses.

``tests/toy_train.py`` puts this folder on ``sys.path``, so a test passes
``HOOKS.CUSTOM "[{'type': 'fault_plugins.AfterTrainMarker'}]"`` or
``TRAIN.WRITERS "[{'type': 'fault_plugins.CloseMarker'}]"`` and then reads the files
to see that ``after_train`` ran and writers were closed in a run that was stopped.
"""
from __future__ import annotations

import os
from typing import Any

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
