"""CheckpointHook: periodic, last, best and published checkpoints, all written atomically."""
from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import shutil
from collections.abc import Sequence
from typing import Any

import torch

from pet.engine.checkpoint import atomic_write_bytes, load_checkpoint, temporary_path, write_last_checkpoint
from pet.engine.hooks.base import HOOKS, Priority, TrainHook
from pet.engine.hooks.evaluation import EvalHook, is_better, metric_rule
from pet.utils import comm
from pet.utils.errors import ConfigError, TrainingError

__all__ = ["CheckpointHook"]

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
    """Writes the checkpoints of a run; ``last_checkpoint`` names the newest regular one.

    Regular checkpoints, ``model_iter{N}.pth`` (``model_epoch{N}.pth`` with ``by_epoch``),
    are written at step ``save_begin`` and every ``interval`` steps after it (iterations,
    or epochs with ``by_epoch``; ``interval <= 0``: none but the last), and, with
    ``save_last``, after the last iteration, which is also published as ``model_final.pth``
    (a hard link: no extra disk). A run stopped through ``trainer.stop_training``
    (early stopping) gets that last checkpoint too, a run stopped by SIGTERM / SIGINT a
    regular one (:meth:`save_now`, called by the trainer); a failed run none. ``max_keep`` > 0
    keeps only the newest N regular checkpoints this hook knows of (best ones never
    count). ``save_optimizer`` / ``save_scheduler`` False make them smaller but a resume
    then restarts the optimizer's momentum / the schedule.

    ``save_best`` names validation metrics (``"auto"``: the first metric of the first
    validation); ``model_best_{metric}.pth`` is replaced each time a metric strictly
    improves, in direction ``rule`` (one for all, or one per metric; empty: inferred from
    the name, see :func:`metric_rule`). ``published_keys`` writes, after training, a copy
    of the final checkpoint with only those top-level keys (``["model"]`` for deployment)
    named ``model_final-{first 8 hex digits of its sha256}.pth``.

    Runs last (VERY_LOW) so a checkpoint holds what every other hook did in that step,
    including this step's validation. Its own state (kept files, best values) is saved
    with every checkpoint, so a resumed run prunes and compares exactly as an
    uninterrupted one. Only the main process writes.
    """

    priority = Priority.VERY_LOW

    def __init__(
        self,
        interval: int = 5000,
        *,
        by_epoch: bool = False,
        save_optimizer: bool = True,
        save_scheduler: bool = True,
        out_dir: str = "",
        max_keep: int = -1,
        save_last: bool = True,
        save_best: str | Sequence[str] = (),
        rule: str | Sequence[str] = "",
        save_begin: int = 0,
        published_keys: Sequence[str] = (),
    ) -> None:
        self.interval = interval
        self.by_epoch = by_epoch
        self.save_optimizer = save_optimizer
        self.save_scheduler = save_scheduler
        self.out_dir = out_dir
        self.max_keep = max_keep
        self.save_last = save_last
        self.save_begin = save_begin
        self.published_keys = _as_list(published_keys)
        self.save_best = _as_list(save_best)
        rules = [rule] * len(self.save_best) if isinstance(rule, str) else list(rule)
        if len(rules) != len(self.save_best):
            raise ConfigError(f"{_RULE_KEY} lists {len(rules)} rules for {len(self.save_best)} SAVE_BEST metrics")
        self._given_rules = dict(zip(self.save_best, rules))
        # Explicit metric names are checked now, not after hours of training.
        self._rules = {m: metric_rule(m, r, _RULE_KEY) for m, r in self._given_rules.items() if m != "auto"}
        self.auto_metric = ""
        self.kept: list[str] = []
        self.best: dict[str, float] = {}
        self.best_iter: dict[str, int] = {}
        self.last_saved_iter = -1
        self.last_saved_name = ""
        self._pending: dict[str, float] | None = None
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ mount points
    def before_train(self, trainer: Any, **kwargs: Any) -> None:
        if self.by_epoch and trainer.max_epochs <= 0:
            raise ConfigError("HOOKS.CHECKPOINT.BY_EPOCH needs epoch mode (SOLVER.MAX_EPOCHS > 0)")
        if self.save_best and not any(isinstance(hook, EvalHook) for hook in trainer.hooks):
            logger.warning("HOOKS.CHECKPOINT.SAVE_BEST is set but nothing validates: set TEST.EVAL_PERIOD > 0")

    def after_val(self, metrics: dict[str, float], **kwargs: Any) -> None:
        if self.save_best:
            self._pending = dict(metrics)

    def after_step(self, trainer: Any, **kwargs: Any) -> None:
        completed = trainer.iter + 1
        improved = self._update_best(completed)
        if not self.by_epoch and self._due(completed):
            self._save_regular(trainer, f"model_iter{completed}.pth", completed)
        self._save_best(trainer, improved, completed)

    def after_epoch(self, trainer: Any, **kwargs: Any) -> None:
        completed = trainer.completed_iters
        improved = self._update_best(completed)
        epochs = trainer.epoch + 1
        whole_epoch = trainer.iters_per_epoch > 0 and completed == epochs * trainer.iters_per_epoch
        if self.by_epoch and whole_epoch and self._due(epochs):
            self._save_regular(trainer, f"model_epoch{epochs}.pth", completed)
        self._save_best(trainer, improved, completed)

    def after_train(self, trainer: Any, **kwargs: Any) -> None:
        # trainer.iter counts finished steps even when one failed half-way (storage.iter does not).
        completed = trainer.iter
        if completed < trainer.max_iter and not trainer.stop_training:
            return  # a failed or interrupted run: its last good checkpoint stays the newest
        improved = self._update_best(completed)  # a validation run by EvalHook.after_train
        if self.save_last or trainer.stop_training:
            self._save_unless_saved(trainer, completed)
            self._write_final(trainer)
        self._save_best(trainer, improved, completed)
        if self.published_keys and (self.save_last or trainer.stop_training):
            self._publish(trainer)

    def after_load_checkpoint(self, trainer: Any, checkpoint: dict[str, Any], **kwargs: Any) -> None:
        # A checkpoint the trainer wrote itself (a signal stop in a run without this hook) is a
        # regular one this hook did not record: adopt it so MAX_KEEP prunes it and a finished
        # run links it as final.
        completed = int(checkpoint.get("iter", -1))
        name = f"model_iter{completed}.pth"
        if name not in self.kept and os.path.isfile(os.path.join(self._dir(trainer), name)):
            self.kept.append(name)
            self.last_saved_iter, self.last_saved_name = completed, name

    # ------------------------------------------------------------------ regular checkpoints
    def save_now(self, trainer: Any) -> str:
        """Save the iterations completed so far as a regular checkpoint now; its path.

        For a stop outside the schedule (SIGTERM / SIGINT): the file goes where this hook
        writes, joins the kept list (MAX_KEEP applies) and ``last_checkpoint`` names it. When
        this step's checkpoint is already written, nothing is written twice. Call it on every
        process (the book-keeping must match); only the main process writes.
        """
        self._save_unless_saved(trainer, trainer.iter)
        return os.path.join(self._dir(trainer), self.last_saved_name)

    def _save_unless_saved(self, trainer: Any, completed: int) -> None:
        last = os.path.join(self._dir(trainer), self.last_saved_name)
        if self.last_saved_iter != completed or not os.path.isfile(last):
            self._save_regular(trainer, self._last_name(trainer, completed), completed)

    def _due(self, step: int) -> bool:
        return self.interval > 0 and step >= self.save_begin and (step - self.save_begin) % self.interval == 0

    def _last_name(self, trainer: Any, completed: int) -> str:
        per_epoch = trainer.iters_per_epoch
        if self.by_epoch and per_epoch and completed % per_epoch == 0:
            return f"model_epoch{completed // per_epoch}.pth"
        return f"model_iter{completed}.pth"

    def _dir(self, trainer: Any) -> str:
        return self.out_dir or trainer.output_dir

    def _state(self, trainer: Any) -> dict[str, Any]:
        state = trainer.checkpoint_state()
        if not self.save_optimizer:
            state.pop("optimizer", None)
            state.pop("grad_scaler", None)
        if not self.save_scheduler:
            state.pop("scheduler", None)
        return state

    def _save_regular(self, trainer: Any, name: str, completed: int) -> None:
        # Book-keeping first (on every process, so all hold the same state), so the
        # checkpoint records itself as kept and the pruning it implies.
        self.last_saved_iter, self.last_saved_name = completed, name
        if name in self.kept:
            self.kept.remove(name)
        self.kept.append(name)
        stale = self.kept[:-self.max_keep] if self.max_keep > 0 else []
        self.kept = self.kept[len(stale):]
        if not comm.is_main_process():
            return
        directory = self._dir(trainer)
        trainer.save_checkpoint(name, state=self._state(trainer), update_last=False, save_dir=directory)
        same_dir = os.path.abspath(directory) == os.path.abspath(trainer.output_dir)
        write_last_checkpoint(trainer.output_dir, name if same_dir else os.path.abspath(os.path.join(directory, name)))
        for old in stale:  # only once last_checkpoint names the new, complete file
            path = os.path.join(directory, old)
            if os.path.isfile(path):
                os.remove(path)
                logger.info(f"Removed {path} (HOOKS.CHECKPOINT.MAX_KEEP {self.max_keep})")

    def _write_final(self, trainer: Any) -> None:
        """``model_final.pth``: a hard link to the last regular checkpoint (a copy where links fail)."""
        if not comm.is_main_process():
            return
        directory = self._dir(trainer)
        source = os.path.join(directory, self.last_saved_name)
        target = os.path.join(directory, "model_final.pth")
        tmp = temporary_path(target)
        try:
            if os.path.exists(tmp):
                os.remove(tmp)
            try:
                os.link(source, tmp)
            except OSError:
                shutil.copyfile(source, tmp)
            os.replace(tmp, target)
        except OSError as exc:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise TrainingError(f"Could not write {target}: {exc.strerror or exc}; {source} is complete") from exc
        logger.info(f"Final checkpoint {target} (= {self.last_saved_name})")

    def _publish(self, trainer: Any) -> None:
        if not comm.is_main_process():
            return
        directory = self._dir(trainer)
        final = load_checkpoint(os.path.join(directory, "model_final.pth"))
        missing = [k for k in self.published_keys if k not in final]
        if missing:
            logger.warning(f"HOOKS.CHECKPOINT.PUBLISHED_KEYS {missing} are not in the checkpoint "
                           f"(it has {sorted(final)}); they are left out of the published file")
        slim = {k: final[k] for k in self.published_keys if k in final}
        if not slim:
            return
        buffer = io.BytesIO()
        torch.save(slim, buffer)
        data = buffer.getvalue()
        path = os.path.join(directory, f"model_final-{hashlib.sha256(data).hexdigest()[:8]}.pth")
        atomic_write_bytes(data, path)
        logger.info(f"Published {path} with keys {sorted(slim)} ({len(data) / 2**20:.1f} MiB)")

    # ------------------------------------------------------------------ best checkpoints
    def _update_best(self, completed: int) -> list[str]:
        """Take the metrics of this step's validation; the SAVE_BEST metrics that improved."""
        metrics, self._pending = self._pending, None
        if not metrics:
            return []
        if "auto" in self.save_best:
            self._resolve_auto(next(iter(metrics)))
        improved = []
        for metric in self.save_best:
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
        self.save_best = list(dict.fromkeys(self.auto_metric if m == "auto" else m for m in self.save_best))
        logger.info(f"HOOKS.CHECKPOINT.SAVE_BEST auto: keeping the best '{self.auto_metric}'")

    def _save_best(self, trainer: Any, improved: list[str], completed: int) -> None:
        if not improved or not comm.is_main_process():
            return
        for metric in improved:
            name = "model_best_" + re.sub(r"[^A-Za-z0-9._-]+", "_", metric) + ".pth"
            state = self._state(trainer)
            state["best"] = {"metric": metric, "value": self.best[metric], "iter": completed}
            trainer.save_checkpoint(name, state=state, update_last=False, save_dir=self._dir(trainer))
            logger.info(f"New best {metric} {self.best[metric]:.4f} after iteration {completed}: {name}")

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict[str, Any]:
        return {
            "kept": list(self.kept),
            "best": dict(self.best),
            "best_iter": dict(self.best_iter),
            "auto_metric": self.auto_metric,
            "last_saved_iter": self.last_saved_iter,
            "last_saved_name": self.last_saved_name,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.kept = list(state.get("kept", []))
        self.best = {k: float(v) for k, v in state.get("best", {}).items()}
        self.best_iter = {k: int(v) for k, v in state.get("best_iter", {}).items()}
        self.last_saved_iter = int(state.get("last_saved_iter", -1))
        self.last_saved_name = str(state.get("last_saved_name", ""))
        if state.get("auto_metric") and "auto" in self.save_best:
            self._resolve_auto(state["auto_metric"])

    def __repr__(self) -> str:
        unit = "epochs" if self.by_epoch else "iters"
        best = f", save_best={self.save_best}" if self.save_best else ""
        return f"CheckpointHook(interval={self.interval} {unit}, max_keep={self.max_keep}{best})"
