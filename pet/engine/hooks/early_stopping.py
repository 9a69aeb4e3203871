"""EarlyStoppingHook: end training when a validation metric stops improving."""
from __future__ import annotations

import logging
import math
from typing import Any

from fvcore.common.config import CfgNode

from pet.engine.hooks.base import HOOKS, Priority, TrainerLike, TrainHook
from pet.engine.hooks.evaluation import EvalHook
from pet.engine.metrics import is_better, metric_rule
from pet.utils.errors import ConfigError

__all__ = ["EarlyStoppingHook"]

logger = logging.getLogger(__name__)


@HOOKS.register()
class EarlyStoppingHook(TrainHook):
    """Sets ``trainer.stop_training`` when ``monitor`` has not improved for ``patience`` validations.

    At each ``after_val``: a value better than the best so far by more than ``min_delta``
    (direction ``rule``, inferred from the name when empty) resets the count; any other
    value adds one, and the run stops at the validation where the count reaches
    ``patience``. It also stops at once when the value reaches ``stopping_threshold``, or
    is NaN/inf with ``check_finite``. A missing metric is a warning, or a ConfigError with
    ``strict``. Stopping is clean: the step finishes, CheckpointHook writes the final
    checkpoint and ``after_train`` runs. The counters are saved in checkpoints; resuming
    a run that was stopped stops again at once unless the reason no longer holds (e.g.
    ``PATIENCE`` was raised).
    """

    priority = Priority.LOW

    def __init__(
        self,
        monitor: str = "bbox/AP",
        rule: str = "",
        min_delta: float = 0.0,
        patience: int = 5,
        stopping_threshold: float | None = None,
        check_finite: bool = True,
        strict: bool = False,
    ) -> None:
        if patience < 0 or min_delta < 0:
            raise ConfigError(
                f"HOOKS.EARLY_STOPPING.PATIENCE and MIN_DELTA must be >= 0, got {patience} and {min_delta}"
            )
        self.monitor = monitor
        self.rule = metric_rule(monitor, rule, "HOOKS.EARLY_STOPPING.RULE")
        self.min_delta = min_delta
        self.patience = patience
        self.stopping_threshold = stopping_threshold
        self.check_finite = check_finite
        self.strict = strict
        self.best: float | None = None
        self.wait = 0
        self.stop_reason = ""  # "", "patience", "threshold" or "nonfinite"

    @classmethod
    def from_config(cls, cfg: CfgNode, trainer: TrainerLike) -> EarlyStoppingHook | None:
        e = cfg.HOOKS.EARLY_STOPPING
        if not e.ENABLED:
            return None
        return cls(e.MONITOR, e.RULE, e.MIN_DELTA, e.PATIENCE, e.STOPPING_THRESHOLD, e.CHECK_FINITE, e.STRICT)

    def before_train(self, trainer: TrainerLike, **kwargs: Any) -> None:
        if not any(isinstance(hook, EvalHook) for hook in trainer.hooks):
            logger.warning("EarlyStoppingHook has no EvalHook to watch: set HOOKS.EVAL.PERIOD > 0")
        if self.stop_reason and self._still_stopped():
            logger.info(f"This run was stopped early ({self.stop_reason}); it stays stopped. Disable "
                        "HOOKS.EARLY_STOPPING or raise its PATIENCE / STOPPING_THRESHOLD to train on.")
            trainer.stop_training = True
        else:
            self.stop_reason = ""

    def after_val(self, trainer: TrainerLike, metrics: dict[str, float], **kwargs: Any) -> None:
        if self.monitor not in metrics:
            message = (f"EarlyStoppingHook: '{self.monitor}' is not among the validation metrics "
                       f"({', '.join(metrics) or 'none'})")
            if self.strict:
                raise ConfigError(f"{message}; set HOOKS.EARLY_STOPPING.MONITOR to one of them")
            logger.warning(message)
            return
        value = float(metrics[self.monitor])
        if not math.isfinite(value):
            if self.check_finite:
                self._stop(trainer, "nonfinite", f"{self.monitor} is {value}")
            return
        if is_better(value, self.best, self.rule, self.min_delta):
            self.best, self.wait = value, 0
        else:
            self.wait += 1
        if self._reached_threshold():
            self._stop(trainer, "threshold", f"{self.monitor} {self.best} reached {self.stopping_threshold}")
        elif self.wait >= self.patience:
            self._stop(trainer, "patience", f"{self.monitor} has not improved on {self.best} for {self.wait} "
                                            f"validations (patience {self.patience}, min_delta {self.min_delta})")

    def _reached_threshold(self) -> bool:
        if self.stopping_threshold is None or self.best is None:
            return False
        threshold = float(self.stopping_threshold)
        return self.best >= threshold if self.rule == "greater" else self.best <= threshold

    def _still_stopped(self) -> bool:
        if self.stop_reason == "patience":
            return self.wait >= self.patience
        if self.stop_reason == "threshold":
            return self._reached_threshold()
        return self.check_finite

    def _stop(self, trainer: TrainerLike, reason: str, message: str) -> None:
        self.stop_reason = reason
        trainer.stop_training = True
        logger.info(f"Early stopping after iteration {trainer.iter}: {message}")

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "wait": self.wait, "stop_reason": self.stop_reason}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = state.get("best")
        self.wait = int(state.get("wait", 0))
        self.stop_reason = str(state.get("stop_reason", ""))

    def __repr__(self) -> str:
        return f"EarlyStoppingHook(monitor={self.monitor}, patience={self.patience})"
