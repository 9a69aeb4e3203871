"""CheckpointHook (periodic, last, final, published) and BestCheckpointHook (best per metric).

Both decide when a checkpoint is due and what it is called; ``trainer.checkpointer``
(:class:`pet.checkpoint.Checkpointer`) writes, prunes and links the files. They keep their
book-keeping in their ``state_dict``, so a resumed run prunes and compares exactly as an uninterrupted one.
"""
from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from typing import Any

from fvcore.common.config import CfgNode

from pet.engine.hooks.base import HOOKS, Priority, TrainerLike, TrainHook
from pet.engine.hooks.evaluation import EvalHook
from pet.engine.metrics import is_better, metric_rule
from pet.utils import comm
from pet.utils.errors import ConfigError

__all__ = ["CheckpointHook", "BestCheckpointHook"]

logger = logging.getLogger(__name__)

_RULE_KEY = "HOOKS.CHECKPOINT.RULE"


def _as_list(value: str | Sequence[str] | None) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    return [str(v) for v in value if v]


@HOOKS.register()
class CheckpointHook(TrainHook):
    """Writes the regular checkpoints of a run; ``last_checkpoint`` names the newest.

    Regular checkpoints, ``model_iter{N}.pth`` (``model_epoch{N}.pth`` with ``by_epoch``),
    are written at step ``save_begin`` and every ``period`` steps after it (iterations,
    or epochs with ``by_epoch``; ``period <= 0``: none but the last), and, with
    ``save_last``, after the last iteration, which is also published as ``model_final.pth``
    (a hard link: no extra disk). A run stopped through ``trainer.stop_training``
    (early stopping) gets that last checkpoint too, a run stopped by SIGTERM / SIGINT or a
    dead data-loading worker a regular one (:meth:`before_stop`); a failed run none. ``max_keep`` > 0 keeps
    only the newest N regular checkpoints this hook knows of. ``save_optimizer`` / ``save_scheduler`` False make them
    smaller but a resume then restarts the optimizer's momentum / the schedule.
    ``published_keys`` writes, after training, a copy of the final checkpoint with only
    those top-level keys (``["model"]`` for deployment) named
    ``model_final-{first 8 hex digits of its sha256}.pth``.

    Runs last (VERY_LOW) so a checkpoint holds what every other hook did in that step,
    including this step's validation. Only the main process writes.
    """

    priority = Priority.VERY_LOW

    def __init__(self, period: int = 5000, *, by_epoch: bool = False, save_optimizer: bool = True,
                 save_scheduler: bool = True, out_dir: str = "", max_keep: int = -1, save_last: bool = True,
                 save_begin: int = 0, published_keys: Sequence[str] = ()) -> None:
        self.period, self.by_epoch, self.save_begin = period, by_epoch, save_begin
        self.save_optimizer, self.save_scheduler = save_optimizer, save_scheduler
        self.out_dir, self.max_keep, self.save_last = out_dir, max_keep, save_last
        self.published_keys = _as_list(published_keys)
        self.kept: list[str] = []
        self.last_saved_iter = -1
        self.last_saved_name = ""

    @classmethod
    def from_config(cls, cfg: CfgNode, trainer: TrainerLike) -> CheckpointHook:
        c = cfg.HOOKS.CHECKPOINT
        return cls(c.PERIOD, by_epoch=c.BY_EPOCH, save_optimizer=c.SAVE_OPTIMIZER, save_scheduler=c.SAVE_SCHEDULER,
                   out_dir=c.OUT_DIR, max_keep=c.MAX_KEEP, save_last=c.SAVE_LAST, save_begin=c.SAVE_BEGIN,
                   published_keys=c.PUBLISHED_KEYS)

    # ------------------------------------------------------------------ mount points
    def before_train(self, trainer: TrainerLike, **kwargs: Any) -> None:
        if self.by_epoch and trainer.max_epochs <= 0:
            raise ConfigError("HOOKS.CHECKPOINT.BY_EPOCH needs epoch mode (SOLVER.MAX_EPOCHS > 0)")

    def after_step(self, trainer: TrainerLike, **kwargs: Any) -> None:
        if trainer.loop.ends_period(trainer.iter, self.period, self.unit, self.save_begin):
            self._save_regular(trainer, self._name(trainer), {"trainer": trainer, **kwargs})

    def before_stop(self, trainer: TrainerLike, **kwargs: Any) -> None:
        """Save the iterations completed as a regular checkpoint, for a stop outside the schedule (SIGTERM /
        SIGINT, a dead data-loading worker): where this hook writes, in the kept list (MAX_KEEP applies),
        named by ``last_checkpoint``; nothing twice when this step's checkpoint is written already. Every
        process runs it (the book-keeping must match); only the main process writes."""
        self._save_unless_saved(trainer, {"trainer": trainer, **kwargs})

    def after_train(self, trainer: TrainerLike, **kwargs: Any) -> None:
        if not self.finished(trainer):
            return  # a failed or interrupted run: its last good checkpoint stays the newest
        if self.save_last or trainer.stop_training:
            self._save_unless_saved(trainer, {"trainer": trainer, **kwargs})
            trainer.checkpointer.link_final(self.last_saved_name, self._dir(trainer))
            if self.published_keys:
                trainer.checkpointer.publish(self.published_keys, self._dir(trainer))

    def after_load_checkpoint(self, trainer: TrainerLike, checkpoint: dict[str, Any], **kwargs: Any) -> None:
        # A checkpoint the trainer wrote itself (a signal stop in a run without this hook) is a
        # regular one this hook did not record: adopt it so MAX_KEEP prunes it and a finished
        # run links it as final.
        completed = int(checkpoint.get("iter", -1))
        name = f"model_iter{completed}.pth"
        if name not in self.kept and os.path.isfile(os.path.join(self._dir(trainer), name)):
            self.kept.append(name)
            self.last_saved_iter, self.last_saved_name = completed, name

    # ------------------------------------------------------------------ regular checkpoints
    @property
    def unit(self) -> str:
        """What ``period`` and ``save_begin`` count (:meth:`pet.engine.loops.TrainLoop.ends_period`)."""
        return "epoch" if self.by_epoch else "iter"

    def _save_unless_saved(self, trainer: TrainerLike, hook_kwargs: dict[str, Any]) -> None:
        last = os.path.join(self._dir(trainer), self.last_saved_name)
        if self.last_saved_iter != trainer.iter or not os.path.isfile(last):
            self._save_regular(trainer, self._name(trainer), hook_kwargs)

    def _name(self, trainer: TrainerLike) -> str:
        """``model_epoch{N}.pth`` at the end of epoch N when counting epochs, else ``model_iter{N}.pth``."""
        if trainer.loop.ends_period(trainer.iter, 1, self.unit):
            return f"model_{self.unit}{trainer.loop.completed(trainer.iter, self.unit)}.pth"
        return f"model_iter{trainer.iter}.pth"

    def _dir(self, trainer: TrainerLike) -> str:
        return self.out_dir or trainer.output_dir

    def _save_regular(self, trainer: TrainerLike, name: str, hook_kwargs: dict[str, Any]) -> None:
        # Book-keeping first (on every process, so all hold the same state), so the
        # checkpoint records itself as kept and the pruning it implies.
        self.last_saved_iter, self.last_saved_name = trainer.iter, name
        if name in self.kept:
            self.kept.remove(name)
        self.kept.append(name)
        stale = self.kept[:-self.max_keep] if self.max_keep > 0 else []
        self.kept = self.kept[len(stale):]
        directory = self._dir(trainer)
        checkpointer = trainer.checkpointer
        checkpointer.save(name, iteration=trainer.iter, epoch=trainer.epoch, hook_kwargs=hook_kwargs,
                          save_dir=directory, optimizer=self.save_optimizer, scheduler=self.save_scheduler,
                          all_ranks=True)
        for old in stale:  # only once last_checkpoint names the new, complete file
            checkpointer.remove(old, directory, f"HOOKS.CHECKPOINT.MAX_KEEP {self.max_keep}")

    def state_dict(self) -> dict[str, Any]:
        return {"kept": list(self.kept), "last_saved_iter": self.last_saved_iter,
                "last_saved_name": self.last_saved_name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.kept = list(state.get("kept", []))
        self.last_saved_iter = int(state.get("last_saved_iter", -1))
        self.last_saved_name = str(state.get("last_saved_name", ""))

    def __repr__(self) -> str:
        unit = "epochs" if self.by_epoch else "iters"
        return f"CheckpointHook(period={self.period} {unit}, max_keep={self.max_keep})"


@HOOKS.register()
class BestCheckpointHook(TrainHook):
    """Keeps ``model_best_{metric}.pth`` for each of ``metrics``, replaced when the metric strictly improves.

    ``metrics``: validation metric names (``"auto"``: the first metric of the first
    validation); ``rule``: ``"greater"`` / ``"less"`` for all of them or one per metric,
    empty to infer it from the name (see :func:`pet.engine.metrics.metric_rule`). The file
    holds the full training state plus ``"best": {metric, value, iter}``; it never counts
    towards CheckpointHook's ``max_keep``, and ``last_checkpoint`` never names it.

    It takes the metrics of a validation in ``after_val`` and writes in the same step's
    ``after_step`` (VERY_LOW, after CheckpointHook), or in ``after_train`` for the final
    validation. The best values are saved in checkpoints, so a resumed run only replaces
    a file with a truly better one.
    """

    priority = Priority.VERY_LOW

    def __init__(self, metrics: str | Sequence[str], rule: str | Sequence[str] = "", *, out_dir: str = "",
                 save_optimizer: bool = True, save_scheduler: bool = True) -> None:
        self.metrics = _as_list(metrics)
        rules = [rule] * len(self.metrics) if isinstance(rule, str) else list(rule)
        if len(rules) != len(self.metrics):
            raise ConfigError(f"{_RULE_KEY} lists {len(rules)} rules for {len(self.metrics)} SAVE_BEST metrics")
        self.out_dir = out_dir
        self.save_optimizer = save_optimizer
        self.save_scheduler = save_scheduler
        self._given_rules = dict(zip(self.metrics, rules))
        # Explicit metric names are checked now, not after hours of training.
        self._rules = {m: metric_rule(m, r, _RULE_KEY) for m, r in self._given_rules.items() if m != "auto"}
        self.auto_metric = ""
        self.best: dict[str, float] = {}
        self.best_iter: dict[str, int] = {}
        self._pending: dict[str, float] | None = None
        self._warned: set[str] = set()

    @classmethod
    def from_config(cls, cfg: CfgNode, trainer: TrainerLike) -> BestCheckpointHook | None:
        c = cfg.HOOKS.CHECKPOINT
        if not _as_list(c.SAVE_BEST):
            return None
        return cls(c.SAVE_BEST, c.RULE, out_dir=c.OUT_DIR, save_optimizer=c.SAVE_OPTIMIZER,
                   save_scheduler=c.SAVE_SCHEDULER)

    def before_train(self, trainer: TrainerLike, **kwargs: Any) -> None:
        if not any(isinstance(hook, EvalHook) for hook in trainer.hooks):
            logger.warning("HOOKS.CHECKPOINT.SAVE_BEST is set but nothing validates: set HOOKS.EVAL.PERIOD > 0")

    def after_val(self, metrics: dict[str, float], **kwargs: Any) -> None:
        self._pending = dict(metrics)

    def after_step(self, trainer: TrainerLike, **kwargs: Any) -> None:
        self._save_improved(trainer, {"trainer": trainer, **kwargs})

    def after_train(self, trainer: TrainerLike, **kwargs: Any) -> None:
        if self.finished(trainer):  # the validation EvalHook.after_train may have run
            self._save_improved(trainer, {"trainer": trainer, **kwargs})

    def _save_improved(self, trainer: TrainerLike, hook_kwargs: dict[str, Any]) -> None:
        metrics, self._pending = self._pending, None
        if not metrics:
            return
        for metric in self._improved(metrics, trainer.iter):
            if not comm.is_main_process():
                continue
            name = "model_best_" + re.sub(r"[^A-Za-z0-9._-]+", "_", metric) + ".pth"
            best = {"metric": metric, "value": self.best[metric], "iter": trainer.iter}
            trainer.checkpointer.save(name, iteration=trainer.iter, epoch=trainer.epoch, hook_kwargs=hook_kwargs,
                                      save_dir=self.out_dir, update_last=False, optimizer=self.save_optimizer,
                                      scheduler=self.save_scheduler, extra={"best": best})
            logger.info(f"New best {metric} {self.best[metric]:.4f} after iteration {trainer.iter}: {name}")

    def _improved(self, metrics: dict[str, float], completed: int) -> list[str]:
        """Record the values of ``metrics`` that beat the best so far; their names."""
        if "auto" in self.metrics:
            self._resolve_auto(next(iter(metrics)))
        improved = []
        for metric in self.metrics:
            if metric not in metrics:
                if metric not in self._warned:
                    self._warned.add(metric)
                    logger.warning(f"HOOKS.CHECKPOINT.SAVE_BEST '{metric}' is not among the validation metrics "
                                   f"({', '.join(metrics)})")
                continue
            if is_better(metrics[metric], self.best.get(metric), self._rules[metric]):
                self.best[metric], self.best_iter[metric] = float(metrics[metric]), completed
                improved.append(metric)
        return improved

    def _resolve_auto(self, metric: str) -> None:
        self.auto_metric = self.auto_metric or metric
        rule = self._given_rules.pop("auto")
        self._given_rules.setdefault(self.auto_metric, rule)
        self._rules.setdefault(self.auto_metric, metric_rule(self.auto_metric, rule, _RULE_KEY))
        self.metrics = list(dict.fromkeys(self.auto_metric if m == "auto" else m for m in self.metrics))
        logger.info(f"HOOKS.CHECKPOINT.SAVE_BEST auto: keeping the best '{self.auto_metric}'")

    def state_dict(self) -> dict[str, Any]:
        return {"best": dict(self.best), "best_iter": dict(self.best_iter), "auto_metric": self.auto_metric}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = {k: float(v) for k, v in state.get("best", {}).items()}
        self.best_iter = {k: int(v) for k, v in state.get("best_iter", {}).items()}
        if state.get("auto_metric") and "auto" in self.metrics:
            self._resolve_auto(state["auto_metric"])

    def __repr__(self) -> str:
        return f"BestCheckpointHook({self.metrics})"
