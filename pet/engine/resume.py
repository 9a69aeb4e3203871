"""The training state in a checkpoint: what is saved, how a run resumes from it.

A checkpoint holds everything an exact resume needs: weights, optimizer, LR schedule,
GradScaler, the iteration counter, RNG states and every stateful hook's ``state_dict``; and, when
the training data has one, the label space (``"label_space"``: :meth:`LabelSpace.to_list`), so that
tools/predict.py and tools/export.py name the model's detections without the dataset.
:class:`pet.engine.trainer.Trainer` exposes these as ``checkpoint_state``,
``save_checkpoint`` and ``resume_or_load``; hooks (CheckpointHook) call them there.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Protocol

from pet.data.categories import LabelSpace
from pet.engine.checkpoint import (
    atomic_save,
    get_rng_state,
    load_checkpoint,
    read_last_checkpoint,
    set_rng_state,
    write_last_checkpoint,
)
from pet.engine.common import unwrap_model
from pet.engine.hooks.base import TrainerLike, TrainHook
from pet.engine.optim import SCHEDULE_KEYS
from pet.engine.step import TrainStep
from pet.utils import comm
from pet.utils.errors import ConfigError
from pet.utils.weights import load_weights

__all__ = ["checkpoint_state", "training_label_space", "save_checkpoint", "load_training_state", "resume_or_load",
           "stateful_hooks"]

logger = logging.getLogger(__name__)


class ResumableTrainer(TrainerLike, Protocol):
    """What saving and resuming need beyond what hooks see: the step (its GradScaler) and the hooks
    in registration order (their state keys)."""

    train_step: TrainStep
    hooks_in_registration_order: list[TrainHook]


def stateful_hooks(hooks_in_registration_order: list[TrainHook]) -> list[tuple[str, TrainHook]]:
    """``(key, hook)`` for each hook with a ``state_dict``: its class name, ``Name.1``, ... for repeats.

    Keys follow registration order, not priority, so changing one hook's priority does
    not swap the states of two hooks of the same class; the first hook of a class keeps
    the plain name, so checkpoints from before repeats were keyed load.
    """
    seen: dict[str, int] = {}
    keyed = []
    for hook in hooks_in_registration_order:
        if hasattr(hook, "state_dict"):
            name = type(hook).__name__
            repeat = seen.get(name, 0)
            seen[name] = repeat + 1
            keyed.append((f"{name}.{repeat}" if repeat else name, hook))
    return keyed


def checkpoint_state(trainer: ResumableTrainer) -> dict[str, Any]:
    """Everything needed to resume ``trainer`` exactly after its ``iter`` completed iterations."""
    step = trainer.train_step
    state: dict[str, Any] = {
        "model": unwrap_model(trainer.model).state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict() if trainer.scheduler is not None else None,
        "iter": trainer.iter,
        "epoch": trainer.epoch,
        "rng": get_rng_state(),
        "hooks": {key: hook.state_dict() for key, hook in stateful_hooks(trainer.hooks_in_registration_order)},
        "optimizer_class": type(trainer.optimizer).__name__,
        "schedule": _schedule(trainer),
    }
    if step.grad_scaler is not None:
        state["grad_scaler"] = step.grad_scaler.state_dict()
    label_space = training_label_space(getattr(trainer.data_loader, "dataset", None))
    if label_space is not None:  # what the model's labels mean, so it can predict without its dataset
        state["label_space"] = label_space.to_list()
    return state


def training_label_space(dataset: Any) -> LabelSpace | None:
    """The label space of the training set ``dataset`` (a loader's ``dataset``); None for data without one."""
    if getattr(dataset, "label_space", None) is not None:
        return dataset.label_space
    ids, names = getattr(dataset, "label_to_category_id", None), getattr(dataset, "class_names", None)
    if ids is None or names is None:
        return None
    return LabelSpace(tuple(int(ids[label]) for label in range(1, len(names) + 1)), tuple(names))


def save_checkpoint(trainer: TrainerLike, filename: str, *, state: dict[str, Any] | None = None,
                    update_last: bool = True, save_dir: str | None = None) -> str:
    """Write ``save_dir/filename`` (default: the run's directory) atomically, on the main process only.

    Hooks see the state in ``before_save_checkpoint`` first (EMAHook adds its average);
    with ``update_last`` the directory's ``last_checkpoint`` then names the new file.
    """
    save_dir = save_dir or trainer.output_dir
    path = os.path.join(save_dir, filename)
    if not comm.is_main_process():
        return path
    state = state if state is not None else trainer.checkpoint_state()
    trainer.call_hooks("before_save_checkpoint", checkpoint=state)
    atomic_save(state, path)
    if update_last:
        write_last_checkpoint(save_dir, filename)
    logger.info(f"Saved checkpoint {path}")
    return path


def load_training_state(trainer: ResumableTrainer, state: dict[str, Any], *, optimizer_state: bool = True) -> None:
    """Put ``trainer`` where the checkpoint ``state`` was written; hooks get ``after_load_checkpoint``.

    The optimizer's state (momentum, Adam moments) comes from the checkpoint, its settings
    (learning rate, weight decay, momentum factor) from this run, and the LR schedule is
    this run's from the resumed iteration on: a resume may change ``SOLVER.MAX_ITER``,
    ``STEPS``, ``LR_POLICY``, ``BASE_LR`` ..., and one log line says what changed. An
    optimizer of another class cannot take the saved state: that is a ConfigError, unless
    ``optimizer_state`` is False (``--resume-weights-only``), which starts a fresh optimizer.
    """
    saved_class, current_class = state.get("optimizer_class"), type(trainer.optimizer).__name__
    if optimizer_state and saved_class and saved_class != current_class:
        raise ConfigError(
            f"The checkpoint was trained with {saved_class}, this run uses {current_class} (SOLVER.OPTIMIZER): "
            f"the optimizer state cannot carry over. Set SOLVER.OPTIMIZER back to {saved_class}, or resume with "
            "--resume-weights-only (weights, iteration, schedule and hook state from the checkpoint; a fresh "
            "optimizer)."
        )
    # With EMAHook, "model" holds the averaged weights (what test and deployment use)
    # and "model_raw" the ones training continues from.
    unwrap_model(trainer.model).load_state_dict(state.get("model_raw", state["model"]))
    if optimizer_state and state.get("optimizer"):
        _load_optimizer_state(trainer.optimizer, state["optimizer"])
    if state.get("scheduler") and trainer.scheduler is not None:
        trainer.scheduler.load_state_dict(state["scheduler"])
    grad_scaler = trainer.train_step.grad_scaler
    if optimizer_state and state.get("grad_scaler") and grad_scaler is not None:
        grad_scaler.load_state_dict(state["grad_scaler"])
    trainer.start_iter = trainer.iter = int(state["iter"])
    trainer.epoch = trainer.start_iter // trainer.iters_per_epoch if trainer.iters_per_epoch else 0
    if "rng" in state:
        set_rng_state(state["rng"])
    hook_states = state.get("hooks", {})
    for key, hook in stateful_hooks(trainer.hooks_in_registration_order):
        if hook_states.get(key) is not None and hasattr(hook, "load_state_dict"):
            hook.load_state_dict(hook_states[key])
    _log_schedule_changes(state.get("schedule"), _schedule(trainer), trainer.start_iter)
    trainer.call_hooks("after_load_checkpoint", checkpoint=state)


def resume_or_load(trainer: ResumableTrainer, resume: bool, *, unsafe: bool = False,
                   weights_only: bool = False) -> None:
    """Resume from ``last_checkpoint`` when ``resume`` and one exists; else load ``TRAIN.WEIGHTS`` (if set).

    ``weights_only`` resumes everything but the optimizer's state (see :func:`load_training_state`).
    """
    last = read_last_checkpoint(trainer.output_dir) if resume else None
    if last is not None:
        load_training_state(trainer, load_checkpoint(last, unsafe=unsafe), optimizer_state=not weights_only)
        fresh = " with a fresh optimizer (--resume-weights-only)" if weights_only else ""
        logger.info(f"Resumed from {last} at iteration {trainer.start_iter}{fresh}")
    elif trainer.cfg.TRAIN.WEIGHTS:
        load_weights(trainer.model, trainer.cfg.TRAIN.WEIGHTS, unsafe=unsafe)
        logger.info(f"Initialised from {trainer.cfg.TRAIN.WEIGHTS} (not a resume: training starts at iteration 0)")


def _load_optimizer_state(optimizer: Any, saved: dict[str, Any]) -> None:
    """The saved per-parameter state, under this run's group settings (lr, weight decay, ...)."""
    settings = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(saved)
    for group, own in zip(optimizer.param_groups, settings):
        group.update(own)


def _schedule(trainer: ResumableTrainer) -> dict[str, Any]:
    """What shapes the learning rate of each iteration: ``MAX_ITER`` and the ``SOLVER`` schedule keys."""
    solver = trainer.cfg.SOLVER
    return {"MAX_ITER": trainer.max_iter, **{key: _plain(solver[key]) for key in SCHEDULE_KEYS}}


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, (tuple, list)) else value


def _log_schedule_changes(saved: dict[str, Any] | None, current: dict[str, Any], start_iter: int) -> None:
    changes = [f"{key} {saved[key]} -> {value}" for key, value in current.items()
               if saved is not None and key in saved and saved[key] != value]
    if changes:
        logger.info(f"Resumed with a changed schedule ({'; '.join(changes)}): the learning rate follows the new "
                    f"schedule from iteration {start_iter}.")
