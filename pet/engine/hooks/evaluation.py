"""EvalHook: periodic validation whose metrics every hook and writer sees in the same step."""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from fvcore.common.config import CfgNode

from pet.data.build import per_process_batch_size
from pet.engine.hooks.base import HOOKS, Priority, TrainerLike, TrainHook
from pet.engine.inference import evaluate_on_datasets
from pet.engine.metrics import flatten_metrics
from pet.engine.models import unwrap_model
from pet.utils import comm

__all__ = ["EvalHook", "default_eval_function"]

logger = logging.getLogger(__name__)


def default_eval_function(cfg: CfgNode) -> Callable[[TrainerLike], dict[str, float]]:
    """Validation on ``TEST.DATASETS`` with the ``TEST.EVALUATOR``; results under ``CKPT/val``.

    The test batch size is checked here, when the hooks are built, so a setting that cannot be split over the
    processes stops the run before training rather than at the first validation.
    """
    per_process_batch_size(cfg.TEST.IMS_PER_BATCH, "TEST.IMS_PER_BATCH")

    def evaluate(trainer: TrainerLike) -> dict[str, float]:
        return evaluate_on_datasets(cfg, unwrap_model(trainer.model), os.path.join(cfg.CKPT, "val"))

    return evaluate


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

    def __init__(self, period: int, eval_function: Callable[[TrainerLike], Mapping[str, Any]]) -> None:
        self.period = period
        self.eval_function = eval_function
        self.last_eval_iter = -1
        self.last_metrics: dict[str, float] = {}

    @classmethod
    def from_config(cls, cfg: CfgNode, trainer: TrainerLike) -> EvalHook | None:
        """``HOOKS.EVAL.PERIOD`` > 0 with ``TEST.DATASETS``: :func:`default_eval_function` every period."""
        if cfg.HOOKS.EVAL.PERIOD <= 0 or not cfg.TEST.DATASETS:
            return None
        return cls(cfg.HOOKS.EVAL.PERIOD, default_eval_function(cfg))

    def after_step(self, trainer: TrainerLike, **kwargs: Any) -> None:
        # Epoch mode validates in the step that ends the epoch (not in after_epoch), so the
        # writers and CheckpointHook of this very step see the metrics.
        due = trainer.loop.ends_period(trainer.iter, self.period) or self.is_last_iter(trainer)
        if due or trainer.stop_training:
            self.evaluate(trainer)

    def after_train(self, trainer: TrainerLike, **kwargs: Any) -> None:
        # Catches a stop requested by a hook that runs after this one, and a resumed run that
        # had nothing left to train; a failed or interrupted run is not validated.
        if self.finished(trainer) and self.last_eval_iter != trainer.iter:
            self.evaluate(trainer)

    def evaluate(self, trainer: TrainerLike) -> dict[str, float]:
        """Run one validation now; returns the flat metrics (also given to every hook)."""
        completed = trainer.iter
        if self.last_eval_iter == completed:
            return self.last_metrics
        self.last_eval_iter = completed
        trainer.call_hooks("before_val")
        model = trainer.model
        was_training = model.training
        start = time.perf_counter()
        try:
            metrics = flatten_metrics(self.eval_function(trainer))
        finally:
            model.train(was_training)
        if comm.get_world_size() > 1:
            metrics = comm.all_gather_object(metrics)[0]
        for name, value in metrics.items():
            trainer.storage.put_scalar(name, value, smoothing_hint=False)
        # The first metrics (AP, AP50, ...) and the validation loss, when there is one.
        names = list(metrics)[:8] + [name for name in metrics if name.endswith("loss/total_loss")]
        shown = ", ".join(f"{name}: {metrics[name]:.4f}" for name in dict.fromkeys(names))
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
