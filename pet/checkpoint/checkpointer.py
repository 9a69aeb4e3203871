"""The Checkpointer: every checkpoint a training run writes or reads goes through it.

A checkpoint holds everything an exact resume needs: weights, optimizer, LR schedule, GradScaler, the loader
position (iterations completed, epoch), RNG states and every stateful hook's ``state_dict`` (keyed by
:meth:`pet.engine.hooks.HookList.state_dict`); and, when the training data has one, the label space
(``"label_space"``: :meth:`LabelSpace.to_list`), so that tools/predict.py and tools/export.py name the model's
detections without the dataset (:meth:`Checkpointer.state` lists the keys).

The trainer owns one :class:`Checkpointer` (``trainer.checkpointer``), built from the model and the run's
checkpointables, as detectron2's trainer owns its ``DetectionCheckpointer``. It builds that state, writes files
atomically (:mod:`pet.checkpoint.files`), keeps ``last_checkpoint`` naming the newest regular checkpoint,
removes pruned ones, links ``model_final.pth``, publishes slim copies, and resumes (removing the temporary files
a killed write left). Hooks only decide *when* and *under what name*: :class:`pet.engine.hooks.CheckpointHook`
for the regular, final and stop checkpoints (its ``before_stop``), :class:`pet.engine.hooks.BestCheckpointHook`
for the best ones. A stop goes one way: loop -> ``before_stop`` hooks -> checkpointer, never back into the loop.

:mod:`pet.checkpoint` sits below the engine (it imports :mod:`pet.utils` and :mod:`pet.data` only), so the
trainer, predict, deploy and tools all import it; it never sees the trainer.
"""
from __future__ import annotations

import hashlib
import io
import logging
import os
import shutil
import socket
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from fvcore.common.config import CfgNode

from pet.checkpoint.files import atomic_save, explain_write_failure, read_last_checkpoint, write_last_checkpoint
from pet.checkpoint.loading import load_checkpoint, load_weights
from pet.utils import comm
from pet.utils.errors import ConfigError, PetError, TrainingError
from pet.utils.files import atomic_path, write_bytes_atomic
from pet.utils.rng import get_rng_state, set_rng_state

__all__ = ["Checkpointer", "SCHEDULE_KEYS", "agreed_last_checkpoint", "run_schedule"]

logger = logging.getLogger(__name__)

# The SOLVER keys that shape the learning rate of every iteration: checkpoints record them (with MAX_ITER),
# so a resume can say what changed.
SCHEDULE_KEYS = ("BASE_LR", "LR_POLICY", "STEPS", "GAMMA", "FLAT_ITERS", "COSINE_END_FACTOR", "WARMUP_ITERS",
                 "WARMUP_FACTOR", "WEIGHT_DECAY", "MOMENTUM")


class Checkpointer:
    """All checkpoint I/O of a training run: ``model`` and the named ``checkpointables`` (objects with
    ``state_dict()`` / ``load_state_dict(state)``), written to and read from ``save_dir``.

    The trainer builds it with its optimizer, LR scheduler, GradScaler (None entries are left out) and hooks
    (:class:`pet.engine.hooks.HookList`, whose state is every stateful hook's), and with what a checkpoint records
    about the run: ``schedule`` (``MAX_ITER`` and the :data:`SCHEDULE_KEYS`, compared on resume), ``precision``
    (the name the weights were trained in) and ``label_space``. The loader position (iterations completed, epoch)
    is given to each :meth:`save` and read back from what :meth:`resume_or_load` returns, so the checkpointer
    never holds the trainer, as detectron2's ``Checkpointer(model, **checkpointables)`` never does.

    Only the main process writes, removes or links files; every method may be called on every process (the
    others return the path the main process writes).
    """

    def __init__(self, model: torch.nn.Module, save_dir: str, *, schedule: dict[str, Any] | None = None,
                 precision: str = "", label_space: list[dict[str, Any]] | None = None,
                 **checkpointables: Any) -> None:
        self.model = model
        self.save_dir = save_dir
        self.schedule = schedule or {}
        self.precision = precision
        self.label_space = label_space
        self.checkpointables = {name: part for name, part in checkpointables.items() if part is not None}
        self._last_regular: tuple[int, str] | None = None  # (iteration, path) of the newest last_checkpoint

    # ------------------------------------------------------------------ saving
    def state(self, iteration: int, epoch: int, *, optimizer: bool = True, scheduler: bool = True) -> dict[str, Any]:
        """Everything needed to resume the run exactly after ``iteration`` completed iterations (in ``epoch``).

        ``optimizer`` / ``scheduler`` False leave out the optimizer's state (and the GradScaler's) /
        the schedule's: a smaller file, but a resume restarts the momentum / the schedule.
        """
        parts = dict(self.checkpointables)
        if not optimizer:
            parts.pop("optimizer", None)
            parts.pop("grad_scaler", None)
        if not scheduler:
            parts.pop("scheduler", None)
        state: dict[str, Any] = {
            "model": comm.unwrap_model(self.model).state_dict(),
            **{name: part.state_dict() for name, part in parts.items()},
            "iter": iteration,
            "epoch": epoch,
            "rng": get_rng_state(),
            "schedule": self.schedule,
        }
        if "optimizer" in self.checkpointables:
            state["optimizer_class"] = type(self.checkpointables["optimizer"]).__name__
        if self.precision:  # the precision the weights were trained in (SOLVER.AMP)
            state["precision"] = self.precision
        if self.label_space is not None:  # what the model's labels mean, so it can predict without its dataset
            state["label_space"] = self.label_space
        return state

    def save(self, filename: str, *, iteration: int, epoch: int, hook_kwargs: Mapping[str, Any] | None = None,
             save_dir: str = "", update_last: bool = True, optimizer: bool = True, scheduler: bool = True,
             extra: dict[str, Any] | None = None, all_ranks: bool = False) -> str:
        """Write :meth:`state` (with ``extra`` keys) to ``save_dir/filename`` atomically; its path.

        The hooks see the state in ``before_save_checkpoint`` first (EMAHook adds its average), called with
        ``hook_kwargs``: the keyword arguments of the mount point the caller is in (``trainer=``, ``storage=``,
        ...), passed on. With ``update_last`` the run's ``last_checkpoint`` then names the file (by name in the
        run's directory, by absolute path elsewhere). ``all_ranks``: every process calls this at the same point
        (the regular and the stop checkpoints), so the checkpoint also gets each process's random-number state
        (``rng_per_rank``, gathered from all), which a resume of the same number of processes gives back to
        each: a process draws (RPN and RoI sampling) what it would have drawn without the interruption, not rank
        0's draws.
        """
        save_dir = save_dir or self.save_dir
        path = os.path.join(save_dir, filename)
        if update_last:
            self._last_regular = (iteration, path)
        rng_per_rank = comm.all_gather_object(get_rng_state()) if all_ranks and comm.get_world_size() > 1 else None
        if not comm.is_main_process():
            return path
        state = {**self.state(iteration, epoch, optimizer=optimizer, scheduler=scheduler), **(extra or {})}
        if rng_per_rank is not None:
            state["rng_per_rank"] = rng_per_rank
        hooks = self.checkpointables.get("hooks")
        if hooks is not None:
            hooks("before_save_checkpoint", checkpoint=state, **(hook_kwargs or {}))
        atomic_save(state, path)
        if update_last:
            same_dir = os.path.abspath(save_dir) == os.path.abspath(self.save_dir)
            write_last_checkpoint(self.save_dir, filename if same_dir else os.path.abspath(path))
        logger.info(f"Saved checkpoint {path}")
        return path

    def saved_at(self, iteration: int) -> str | None:
        """The checkpoint this run's ``last_checkpoint`` names if it was written after ``iteration``, else None
        (the loop asks after ``before_stop``: did a hook save the iterations completed?)."""
        if self._last_regular is None or self._last_regular[0] != iteration:
            return None
        return self._last_regular[1]

    def remove(self, filename: str, save_dir: str = "", reason: str = "") -> None:
        """Delete ``save_dir/filename`` (a pruned regular checkpoint) if it is there."""
        path = os.path.join(save_dir or self.save_dir, filename)
        if comm.is_main_process() and os.path.isfile(path):
            os.remove(path)
            logger.info(f"Removed {path}{f' ({reason})' if reason else ''}")

    def link_final(self, filename: str, save_dir: str = "") -> str:
        """``save_dir/model_final.pth``: a hard link to the checkpoint ``filename`` (a copy where links fail)."""
        save_dir = save_dir or self.save_dir
        source, target = os.path.join(save_dir, filename), os.path.join(save_dir, "model_final.pth")
        if not comm.is_main_process():
            return target
        try:
            with atomic_path(target) as tmp:
                try:
                    os.link(source, tmp)
                except OSError:
                    shutil.copyfile(source, tmp)
        except OSError as exc:
            raise TrainingError(f"Could not write {target}: {exc.strerror or exc}; {source} is complete") from exc
        logger.info(f"Final checkpoint {target} (= {filename})")
        return target

    def publish(self, keys: Sequence[str], save_dir: str = "") -> str | None:
        """A copy of ``model_final.pth`` with only the top-level ``keys``, named
        ``model_final-{first 8 hex digits of its sha256}.pth``; its path (None when none of the keys is there)."""
        save_dir = save_dir or self.save_dir
        if not comm.is_main_process():
            return None
        final = load_checkpoint(os.path.join(save_dir, "model_final.pth"))
        missing = [k for k in keys if k not in final]
        if missing:
            logger.warning(f"HOOKS.CHECKPOINT.PUBLISHED_KEYS {missing} are not in the checkpoint "
                           f"(it has {sorted(final)}); they are left out of the published file")
        slim = {k: final[k] for k in keys if k in final}
        if not slim:
            return None
        buffer = io.BytesIO()
        torch.save(slim, buffer)
        data = buffer.getvalue()
        path = os.path.join(save_dir, f"model_final-{hashlib.sha256(data).hexdigest()[:8]}.pth")
        with explain_write_failure(path):
            write_bytes_atomic(path, data, fsync=True)
        logger.info(f"Published {path} with keys {sorted(slim)} ({len(data) / 2**20:.1f} MiB)")
        return path

    # ------------------------------------------------------------------ loading
    def resume_or_load(self, resume: bool, weights: str = "", *, unsafe: bool = False,
                       weights_only: bool = False) -> dict[str, Any] | None:
        """Resume from ``last_checkpoint`` when ``resume`` and one exists, and return that checkpoint (its
        ``"iter"`` and ``"epoch"`` are where the run goes on); else load ``weights`` (``TRAIN.WEIGHTS``, if set)
        into the model and return None.

        ``weights_only`` resumes everything but the optimizer's state (see :meth:`load`).
        """
        last = agreed_last_checkpoint(self.save_dir) if resume else None
        if last is not None:
            state = load_checkpoint(last, unsafe=unsafe)
            try:
                self.load(state, optimizer_state=not weights_only)
            except PetError:
                raise
            except (RuntimeError, ValueError, KeyError) as exc:  # a model, optimizer or hook of other shapes
                detail = textwrap.shorten(str(exc), 300, placeholder=" ...")
                raise ConfigError(f"Cannot resume from {last}: it does not fit this config's model or optimizer "
                                  f"({type(exc).__name__}: {detail}). Train this config in a new CKPT, or set the "
                                  f"changed keys back ({self.save_dir}/config.yaml is the config it was "
                                  "trained with).") from exc
            fresh = " with a fresh optimizer (--resume-weights-only)" if weights_only else ""
            logger.info(f"Resumed from {last} at iteration {int(state['iter'])}{fresh}")
            return state
        if weights:
            load_weights(self.model, weights, unsafe=unsafe)
            logger.info(f"Initialised from {weights} (not a resume: training starts at iteration 0)")
        return None

    def load(self, state: dict[str, Any], *, optimizer_state: bool = True) -> None:
        """Put the model and the checkpointables where the checkpoint ``state`` left them, and this process's
        random generators; the caller sets its loader position from ``state["iter"]`` / ``state["epoch"]``.

        The optimizer's state (momentum, Adam moments) comes from the checkpoint, its settings
        (learning rate, weight decay, momentum factor) from this run, and the LR schedule is
        this run's from the resumed iteration on: a resume may change ``SOLVER.MAX_ITER``,
        ``STEPS``, ``LR_POLICY``, ``BASE_LR`` ..., and one log line says what changed. An
        optimizer of another class cannot take the saved state: that is a ConfigError, unless
        ``optimizer_state`` is False (``--resume-weights-only``), which starts a fresh optimizer.
        """
        optimizer = self.checkpointables.get("optimizer")
        saved_class, current_class = state.get("optimizer_class"), type(optimizer).__name__
        if optimizer is not None and optimizer_state and saved_class and saved_class != current_class:
            raise ConfigError(
                f"The checkpoint was trained with {saved_class}, this run uses {current_class} (SOLVER.OPTIMIZER): "
                f"the optimizer state cannot carry over. Set SOLVER.OPTIMIZER back to {saved_class}, or resume with "
                "--resume-weights-only (weights, iteration, schedule and hook state from the checkpoint; a fresh "
                "optimizer)."
            )
        # With EMAHook, "model" holds the averaged weights (what test and deployment use)
        # and "model_raw" the ones training continues from.
        comm.unwrap_model(self.model).load_state_dict(state.get("model_raw", state["model"]))
        for name, part in self.checkpointables.items():
            if not state.get(name) or (name in ("optimizer", "grad_scaler") and not optimizer_state):
                continue
            if name == "optimizer":
                _load_optimizer_state(part, state[name])
            else:
                part.load_state_dict(state[name])
        per_rank = state.get("rng_per_rank")
        if per_rank is not None and len(per_rank) == comm.get_world_size():
            set_rng_state(per_rank[comm.get_rank()])
        elif "rng" in state:
            set_rng_state(state["rng"])
        _log_schedule_changes(state.get("schedule"), self.schedule, int(state["iter"]))


def run_schedule(cfg: CfgNode, max_iter: int) -> dict[str, Any]:
    """What shapes the learning rate of each iteration of a run: ``MAX_ITER`` and the ``SOLVER`` schedule keys
    (:data:`SCHEDULE_KEYS`), as checkpoints record it."""
    return {"MAX_ITER": max_iter, **{key: _plain(cfg.SOLVER[key]) for key in SCHEDULE_KEYS}}


def agreed_last_checkpoint(save_dir: str) -> str | None:
    """:func:`read_last_checkpoint` of ``save_dir``, checked to be the same file on every process.

    In a run of several machines ``CKPT`` must be one folder all of them read (a shared file
    system). When it is not, a machine without the checkpoint would start over while the others
    resume, and their weights would silently part ways; so every process reports the
    ``last_checkpoint`` it sees (its name and size), and any that differs from rank 0's stops every
    process with one error naming that process's host and folder.
    """
    seen, error = _what_this_process_sees(save_dir)
    if comm.get_world_size() > 1:
        everyone = comm.all_gather_object(seen)
        reference = everyone[0]
        differ = [s for s in everyone[1:] if (s["name"], s["size"], s["error"]) != (reference["name"],
                                                                                   reference["size"], None)]
        if differ or reference["error"]:
            raise ConfigError(_not_shared_message(reference, differ))
    if error is not None:
        raise error
    return seen["path"]


def _what_this_process_sees(save_dir: str) -> tuple[dict[str, Any], PetError | None]:
    path, error = None, None
    try:
        path = read_last_checkpoint(save_dir)
    except PetError as exc:
        error = exc
    node = os.environ.get("GROUP_RANK")
    return {"rank": comm.get_rank(), "where": f"{socket.gethostname()}{f' (node {node})' if node else ''}",
            "dir": os.path.abspath(save_dir), "path": path, "name": os.path.basename(path) if path else None,
            "size": os.path.getsize(path) if path else None, "error": str(error) if error else None}, error


def _not_shared_message(reference: dict[str, Any], differ: list[dict[str, Any]]) -> str:
    def sees(s: dict[str, Any]) -> str:
        if s["error"]:
            return f"an unreadable last_checkpoint in {s['dir']} ({s['error']})"
        if s["name"] is None:
            return f"no last_checkpoint in {s['dir']}"
        return f"last_checkpoint {s['name']} ({s['size']} bytes) in {s['dir']}"

    others = "; ".join(f"rank {s['rank']} on {s['where']} sees {sees(s)}" for s in differ)
    return (f"The processes of this run do not see the same checkpoint: rank 0 on {reference['where']} sees "
            f"{sees(reference)}; {others}. CKPT must be one folder that every machine reads and writes the same "
            "way (a shared file system): point CKPT at one, or copy the checkpoint and last_checkpoint of rank 0's "
            "folder to the others, then run the same command again.")


def _load_optimizer_state(optimizer: Any, saved: dict[str, Any]) -> None:
    """The saved per-parameter state, under this run's group settings (lr, weight decay, ...)."""
    settings = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(saved)
    for group, own in zip(optimizer.param_groups, settings):
        group.update(own)


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, (tuple, list)) else value


def _log_schedule_changes(saved: dict[str, Any] | None, current: dict[str, Any], start_iter: int) -> None:
    changes = [f"{key} {saved[key]} -> {value}" for key, value in current.items()
               if saved is not None and key in saved and saved[key] != value]
    if changes:
        logger.info(f"Resumed with a changed schedule ({'; '.join(changes)}): the learning rate follows the new "
                    f"schedule from iteration {start_iter}.")
