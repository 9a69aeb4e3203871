"""CheckpointHook: periodic, last and best checkpoints, written atomically."""
from __future__ import annotations

import logging
from typing import Any

from pet.engine.hooks.base import HOOKS, Priority, TrainHook

__all__ = ["CheckpointHook"]

logger = logging.getLogger(__name__)


@HOOKS.register()
class CheckpointHook(TrainHook):
    """Saves ``model_iter{N}.pth`` every ``interval`` iterations and ``model_final.pth`` at the end.

    Runs last (VERY_LOW) so a checkpoint holds the state every other hook reached in
    that step. ``last_checkpoint`` always names the newest complete regular checkpoint.
    """

    priority = Priority.VERY_LOW

    def __init__(self, interval: int = 5000, save_last: bool = True, out_dir: str = "") -> None:
        self.interval = interval
        self.save_last = save_last
        self.out_dir = out_dir

    def after_step(self, trainer: Any, **kwargs: Any) -> None:
        if self.every_n_iters(trainer, self.interval) and not self.is_last_iter(trainer):
            trainer.save_checkpoint(f"model_iter{trainer.completed_iters}.pth", save_dir=self._dir(trainer))

    def after_train(self, trainer: Any, **kwargs: Any) -> None:
        completed = trainer.completed_iters
        if self.save_last and completed >= trainer.max_iter or trainer.stop_training:
            trainer.save_checkpoint("model_final.pth", save_dir=self._dir(trainer))

    def _dir(self, trainer: Any) -> str:
        return self.out_dir or trainer.output_dir

    def __repr__(self) -> str:
        return f"CheckpointHook(interval={self.interval})"

