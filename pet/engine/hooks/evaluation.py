"""EvalHook: periodic validation whose metrics every hook and writer sees in the same step.

Also home of :func:`metric_rule`, which decides whether a larger or a smaller value of a
metric is better (shared by CheckpointHook's SAVE_BEST and EarlyStoppingHook).
"""
from __future__ import annotations

import logging
import math
import numbers
import os
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from pet.engine.checkpoint import unwrap_model
from pet.engine.hooks.base import HOOKS, Priority, TrainHook
from pet.utils import comm
from pet.utils.errors import ConfigError, TrainingError

__all__ = ["EvalHook", "metric_rule", "is_better", "default_eval_function"]

logger = logging.getLogger(__name__)

# Tokens of a metric name (split on "/", "_", "@", ...) that mean "larger is better":
# AP, AP50, APs, mAP, AR, AR100, ARl, acc, top1, precision, recall, (m)IoU, AUC, F1, dice.
_GREATER = re.compile(r"^(m?ap(\d+|[sml])?|ar(\d+|[sml])?|m?acc\w*|top\d*|precision|recall|m?iou|auc|f1|m?dice)$")


def metric_rule(metric: str, rule: str = "", key: str = "RULE") -> str:
    """``"greater"`` or ``"less"``: ``rule`` when given, else inferred from the name of ``metric``.

    Names with "loss" are "less"; AP/mAP/AR/acc/top/precision/recall/IoU names are
    "greater"; anything else is a :class:`ConfigError` asking for ``key`` to be set.
    """
    rule = (rule or "").lower()
    if rule in ("greater", "less"):
        return rule
    if rule:
        raise ConfigError(f"{key} must be 'greater', 'less' or empty (inferred from the metric name), got {rule!r}")
    if "loss" in metric.lower():
        return "less"
    if any(_GREATER.match(token) for token in re.split(r"[^a-z0-9]+", metric.lower()) if token):
        return "greater"
    raise ConfigError(
        f"Cannot tell whether a larger or a smaller '{metric}' is better; set {key} to 'greater' or 'less'"
    )


def is_better(value: float, best: float | None, rule: str, min_delta: float = 0.0) -> bool:
    """Strictly better than ``best`` by more than ``min_delta`` (any finite value beats None)."""
    if not math.isfinite(value):
        return False
    if best is None:
        return True
    return value - min_delta > best if rule == "greater" else value + min_delta < best


def default_eval_function(cfg: Any) -> Callable[[Any], dict[str, float]]:
    """Validation on ``TEST.DATASETS`` with the COCO evaluator; results under ``CKPT/val``.

    The test batch size is checked here, when the hooks are built, so a setting that cannot be split over the
    processes stops the run before training rather than at the first validation.
    """
    from pet.data.build import per_process_batch_size

    per_process_batch_size(cfg.TEST.IMS_PER_BATCH, "TEST.IMS_PER_BATCH")

    def evaluate(trainer: Any) -> dict[str, float]:
        from pet.engine.inference import evaluate_on_datasets  # the test loop imports the trainer

        return evaluate_on_datasets(cfg, unwrap_model(trainer.model), os.path.join(cfg.CKPT, "val"))

    return evaluate


def _flat_metrics(results: Any, prefix: str = "") -> dict[str, float]:
    """``{"bbox": {"AP": 1.0}}`` -> ``{"bbox/AP": 1.0}``; values must be numbers."""
    if not isinstance(results, Mapping):
        raise TrainingError(f"The eval function must return a dict of metrics, got {type(results).__name__}")
    flat: dict[str, float] = {}
    for name, value in results.items():
        if isinstance(value, Mapping):
            flat.update(_flat_metrics(value, f"{prefix}{name}/"))
        elif isinstance(value, (numbers.Real, torch.Tensor)) and not isinstance(value, bool):  # numpy scalars too
            flat[f"{prefix}{name}"] = float(value)
        else:
            raise TrainingError(
                f"Metric '{prefix}{name}' of the eval function is a {type(value).__name__}, not a number"
            )
    return flat


@HOOKS.register()
class EvalHook(TrainHook):
    """Validates every ``period`` iterations (epochs in epoch mode) and once after training.

    ``eval_function(trainer) -> {"bbox/AP": ..., ...}`` does the work (nested dicts are
    flattened with "/"). Around it every hook gets ``before_val`` and ``after_val(metrics=)``
    (EMAHook swaps the averaged weights in and out there); the metrics are put into the
    storage unsmoothed *in the same step*, before the writers (LOW) and CheckpointHook
    (VERY_LOW) run, so metrics.json and SAVE_BEST see them at once. ``period <= 0``
    validates only after training. A run that fails is not validated; a run stopped
    through ``trainer.stop_training`` is. In distributed runs every process runs the eval
    function (on its shard) and all get the main process's metrics, so hooks that act on
    them (early stopping) decide the same everywhere.
    """

    priority = Priority.BELOW_NORMAL

    def __init__(self, period: int, eval_function: Callable[[Any], Mapping[str, Any]]) -> None:
        self.period = period
        self.eval_function = eval_function
        self.last_eval_iter = -1
        self.last_metrics: dict[str, float] = {}

    def after_step(self, trainer: Any, **kwargs: Any) -> None:
        completed = trainer.iter + 1
        if trainer.max_epochs > 0:
            # Epoch mode: validate in the step that ends the epoch (not in after_epoch) so the
            # writers and CheckpointHook of this very step see the metrics.
            if completed % trainer.iters_per_epoch:
                due = False
            else:
                epochs = completed // trainer.iters_per_epoch
                due = (self.period > 0 and epochs % self.period == 0) or epochs >= trainer.max_epochs
        else:
            due = (self.period > 0 and completed % self.period == 0) or completed >= trainer.max_iter
        if due or trainer.stop_training:
            self.evaluate(trainer)

    def after_train(self, trainer: Any, **kwargs: Any) -> None:
        # Catches a stop requested by a hook that runs after this one, and a resumed run that
        # had nothing left to train; a failed run (neither condition) is not validated.
        # trainer.iter counts finished steps even when one failed half-way (storage.iter does not).
        finished = trainer.stop_training or trainer.iter >= trainer.max_iter
        if finished and self.last_eval_iter != trainer.iter:
            self.evaluate(trainer)

    def evaluate(self, trainer: Any) -> dict[str, float]:
        """Run one validation now; returns the flat metrics (also given to every hook)."""
        completed = trainer.completed_iters
        if self.last_eval_iter == completed:
            return self.last_metrics
        self.last_eval_iter = completed
        trainer.call_hooks("before_val")
        model = trainer.model
        was_training = model.training
        start = time.perf_counter()
        try:
            metrics = _flat_metrics(self.eval_function(trainer))
        finally:
            model.train(was_training)
        if comm.get_world_size() > 1:
            metrics = comm.all_gather_object(metrics)[0]
        for name, value in metrics.items():
            trainer.storage.put_scalar(name, value, smoothing_hint=False)
        shown = ", ".join(f"{name}: {value:.4f}" for name, value in list(metrics.items())[:8])
        logger.info(f"Validation after iteration {completed} ({time.perf_counter() - start:.1f} s): {shown}")
        self.last_metrics = metrics
        trainer.call_hooks("after_val", metrics=metrics)
        return metrics

    def state_dict(self) -> dict[str, int]:
        return {"last_eval_iter": self.last_eval_iter}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.last_eval_iter = int(state.get("last_eval_iter", -1))

    def __repr__(self) -> str:
        return f"EvalHook(period={self.period})"
