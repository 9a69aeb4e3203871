"""The train loop: it owns the iteration (fetch, step, hook calls, stop checks); the trainer holds the parts.

One iteration, read top-down: :meth:`pet.engine.trainer.Trainer.train` resumes and calls
:meth:`TrainLoop.run`, which calls ``before_train``, the mode's epochs (:meth:`TrainLoop._run_epochs`:
``before_epoch``, steps, ``after_epoch``) and ``after_train`` (in a ``finally``); :meth:`TrainLoop._run_step`
moves the counter, calls ``before_step``, fetches the batches, calls ``trainer.train_step``
(:class:`pet.engine.step.TrainStep`), records its metrics, calls ``after_step`` and checks for a stop. The
loop reads and sets what the trainer holds (``trainer.model``, ``train_step``, ``storage``, ``hooks``,
``checkpointer``, ``iter``, ``epoch``, ``stop_training``) as MMEngine's loops use their runner; nothing
calls back into the loop's caller.

One class per mode, as MMEngine's ``IterBasedTrainLoop`` / ``EpochBasedTrainLoop``, so that neither the
trainer nor the hooks branch on the mode: :class:`IterationLoop` (``SOLVER.MAX_ITER`` iterations, one
``before_epoch`` / ``after_epoch`` around them) and :class:`EpochLoop` (``SOLVER.MAX_EPOCHS`` passes over a
finite loader). Hooks ask the loop whether a period (in its unit, or in iterations or epochs) ends at an
iteration (:meth:`TrainLoop.ends_period`): the one rule for periods.

Both feed steps from passes over the loader, each after ``set_epoch(k)`` on its sampler, the first one
starting where a resumed run left off (by index arithmetic with ``set_start_iter``, Pet's loaders; else by
drawing and dropping batches); iteration mode chains the passes (:func:`endless_batches`).

Stops: a hook's ``trainer.stop_training`` ends the run after the step (as planned: ``after_train``
saves the final checkpoint); SIGTERM / SIGINT (:class:`StopSignals`) and a data-loading worker's death
(:class:`WorkerDiedAtFetch`) call ``before_stop`` (CheckpointHook saves the iterations completed; the loop does
when no hook did) and raise :class:`~pet.utils.errors.TrainingInterrupted` with the exit code for the command line.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import torch
from fvcore.common.config import CfgNode

from pet.checkpoint import Checkpointer
from pet.data.workers import WORKER_DIED_EXIT_CODE, fetch, remedy
from pet.engine.events import EventStorage
from pet.engine.step import TrainStep
from pet.utils import comm
from pet.utils.errors import ConfigError, TrainingError, TrainingInterrupted
from pet.utils.tensor import move_to_device

__all__ = ["TrainerLike", "TrainLoop", "IterationLoop", "EpochLoop", "build_loop", "endless_batches",
           "WorkerDiedAtFetch", "StopSignals"]

logger = logging.getLogger(__name__)


class TrainerLike(Protocol):
    """What the loop and every hook may rely on in ``trainer`` (:class:`pet.engine.trainer.Trainer` has all of it;
    so must a trainer of your own that runs Pet's loops and hooks). A Protocol because the trainer module imports
    the loops and hooks, which name this shape instead of importing it.

    ``iter`` and ``storage.iter`` are one counter: the 1-based number of the current
    iteration inside a step, the number of iterations completed outside one (so
    ``start_iter`` in ``before_train``, and after a failure the last completed one).
    ``epoch`` is the 0-based index of the current epoch. ``stop_training``: set it to end
    the run cleanly after this step (validation and the final checkpoint still happen).
    ``hooks`` is a :class:`pet.engine.hooks.HookList` (callable by mount point, with ``cost_table()``);
    ``checkpointer`` (:class:`pet.checkpoint.Checkpointer`) writes and reads every checkpoint;
    ``loop`` is the mode: ``loop.ends_period(iteration, n)`` says whether a period ended.
    """

    cfg: CfgNode
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    data_loader: Any
    storage: EventStorage
    device: torch.device
    output_dir: str
    hooks: Any
    train_step: TrainStep
    checkpointer: Checkpointer
    loop: TrainLoop
    iter: int
    start_iter: int
    max_iter: int
    epoch: int
    max_epochs: int
    iters_per_epoch: int
    stop_training: bool
    last_step_seconds: float
    last_data_seconds: float

    def call_hooks(self, point: str, **kwargs: Any) -> None: ...


class WorkerDiedAtFetch(Exception):
    """A data-loading worker died, seen at a training fetch: the state is that of the last completed iteration."""


class StopSignals(contextlib.AbstractContextManager):
    """While entered (in the main thread), SIGTERM / SIGINT ask training to finish the current step, save a
    checkpoint and stop: ``received`` is the signal's number (0: none). A second one stops at once."""

    def __init__(self) -> None:
        self.received = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        self.received = 0
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _request_stop(self, signum: int, frame: Any) -> None:
        if self.received:
            raise KeyboardInterrupt
        self.received = signum
        logger.warning(f"Received {signal.Signals(signum).name}: stopping after the current iteration")


class TrainLoop:
    """What both modes share: the run around the epochs, one step, the stops, the batch stream
    (``accum_steps`` batches per iteration)."""

    max_iter: int
    max_epochs = 0  # epoch mode only
    iters_per_epoch = 0  # epoch mode only
    unit = "iter"  # what a period of this mode counts

    def __init__(self, data_loader: Iterable[Any], accum_steps: int) -> None:
        self.data_loader = data_loader
        self.accum_steps = accum_steps
        self.signals = StopSignals()
        self._batches: Iterator[Any] = iter(())

    def run(self, trainer: TrainerLike) -> None:
        """Train from ``trainer.start_iter`` to :attr:`max_iter`; ``after_train`` runs even when a step fails."""
        trainer.model.train()
        trainer.storage = EventStorage(trainer.start_iter)
        with trainer.storage, self.signals:
            try:
                self.call_hooks(trainer, "before_train")
                try:
                    self._run_epochs(trainer)
                except WorkerDiedAtFetch as death:
                    self._save_and_stop(trainer, str(death), WORKER_DIED_EXIT_CODE,
                                        advice=remedy(getattr(self.data_loader, "num_workers", None)))
            except BaseException:
                # The first error is the one to report: a hook failing in after_train
                # (a full disk, say) is logged, not raised over it.
                try:
                    self.call_hooks(trainer, "after_train")
                except Exception:
                    logger.exception("after_train also failed while handling the error below")
                raise
            else:
                self.call_hooks(trainer, "after_train")
            finally:
                if comm.is_main_process():
                    logger.info(f"Time spent in hooks:\n{trainer.hooks.cost_table()}")

    def call_hooks(self, trainer: TrainerLike, point: str, **kwargs: Any) -> None:
        """Call mount point ``point`` on every hook with :meth:`mount_kwargs` and ``kwargs``."""
        trainer.hooks(point, **{**self.mount_kwargs(trainer), **kwargs})

    def mount_kwargs(self, trainer: TrainerLike) -> dict[str, Any]:
        """The keyword arguments of every mount point: ``trainer``, ``storage`` and :meth:`hook_kwargs`."""
        return {"trainer": trainer, "storage": trainer.storage, **self.hook_kwargs(trainer)}

    def hook_kwargs(self, trainer: TrainerLike) -> dict[str, int]:
        """The mode's extra keyword arguments for every mount point (``epoch=``/``max_epochs=`` in epoch mode)."""
        return {}

    def ends_period(self, iteration: int, period: int, unit: str = "", start: int = 0) -> bool:
        """Iteration ``iteration`` ends a period of ``period`` units counted from unit ``start`` (never for
        ``period <= 0``): the one rule every hook asks. ``unit`` is ``"iter"``, ``"epoch"`` (epoch mode) or ``""``,
        this mode's own (epochs in epoch mode, iterations in iteration mode)."""
        if period <= 0:
            return False
        if (unit or self.unit) == "epoch":
            if not self.iters_per_epoch:
                raise ConfigError("A period in epochs needs epoch mode (SOLVER.MAX_EPOCHS > 0)")
            epochs, within = divmod(iteration, self.iters_per_epoch)
            return within == 0 and epochs >= start and (epochs - start) % period == 0
        return iteration >= start and (iteration - start) % period == 0

    def completed(self, iteration: int, unit: str = "") -> int:
        """The whole units (``unit`` as in :meth:`ends_period`) completed when iteration ``iteration`` ends."""
        if (unit or self.unit) == "epoch":
            return iteration // self.iters_per_epoch if self.iters_per_epoch else 0
        return iteration

    def _run_epochs(self, trainer: TrainerLike) -> None:
        """The mode's epochs: ``before_epoch``, steps up to the epoch's end, ``after_epoch``."""
        raise NotImplementedError

    def _run_steps(self, trainer: TrainerLike, end: int) -> None:
        """Run iterations until ``trainer.iter`` reaches ``end`` or a hook sets ``trainer.stop_training``."""
        while trainer.iter < end and not trainer.stop_training:
            self._run_step(trainer)

    def _run_step(self, trainer: TrainerLike) -> None:
        """One iteration: the counter moves to it, hooks around the step; a failure leaves it uncounted."""
        trainer.iter += 1
        try:
            self.call_hooks(trainer, "before_step")
            start = time.perf_counter()
            batches = self._next_batches(trainer.iter)
            if trainer.device.type != "cpu":
                batches = [move_to_device(batch, trainer.device) for batch in batches]
            trainer.last_data_seconds = time.perf_counter() - start
            result = trainer.train_step(batches, iteration=trainer.iter, data_seconds=trainer.last_data_seconds,
                                        stop_signal=self.signals.received)
            trainer.last_step_seconds = time.perf_counter() - start
            for name, value in result.metrics.items():  # already reduced over processes
                trainer.storage.put_scalar(name, value)
            if trainer.train_step.nonfinite_skipped:
                trainer.storage.put_scalar("nonfinite_skipped", trainer.train_step.nonfinite_skipped,
                                           smoothing_hint=False)
            self.call_hooks(trainer, "after_step")
        except BaseException:
            trainer.iter -= 1
            raise
        # In one process a signal is known at once; across processes every one learns of a signal any
        # of them got from the step's one reduction, so all stop after the same step, with no extra collective.
        signum = result.stop_signal if comm.get_world_size() > 1 else self.signals.received
        if signum:
            self._save_and_stop(trainer, f"Training stopped by {signal.Signals(signum).name} after iteration "
                                f"{trainer.iter}", 128 + signum)

    def _save_and_stop(self, trainer: TrainerLike, reason: str, exit_code: int, advice: str = "") -> None:
        """Save the iterations completed and raise :class:`TrainingInterrupted` with ``exit_code``: one line, the
        reason, the checkpoint, ``advice``. ``before_stop`` hooks save first (CheckpointHook: where and as its
        schedule writes); when none did, the loop writes ``model_iter{N}.pth`` in CKPT, so a stopped run can always
        resume. One way: loop -> hooks -> checkpointer."""
        self.call_hooks(trainer, "before_stop")
        path = trainer.checkpointer.saved_at(trainer.iter) or trainer.checkpointer.save(
            f"model_iter{trainer.iter}.pth", iteration=trainer.iter, epoch=trainer.epoch,
            hook_kwargs=self.mount_kwargs(trainer), all_ranks=True)
        advice = f" If it happens again: {advice}." if advice else ""
        raise TrainingInterrupted(f"{reason}; checkpoint {path}. Run the same command to resume from it.{advice}",
                                  exit_code=exit_code)

    def _next_batches(self, iteration: int) -> list[Any]:
        """The ``accum_steps`` batches of step ``iteration``; raises :class:`WorkerDiedAtFetch` when a data-loading
        worker of any process has died.

        The fetch is where a death is acted on (:func:`pet.data.workers.fetch`): before the forward
        pass, while weights, optimizer and counters are those of the last completed iteration, which
        the loop then saves. In a distributed run the processes agree here (one small all-reduce
        per step), so a process whose worker died does not leave the others waiting in the gradient
        all-reduce.
        """
        batches, death = [], None
        while len(batches) < self.accum_steps and death is None:
            batch, death = fetch(self._batches)
            batches.append(batch)
        if comm.get_world_size() > 1 and comm.any_process(death is not None):
            deaths = comm.all_gather_object(death)
            rank = next(r for r, d in enumerate(deaths) if d is not None)
            death = deaths[rank].replace("worker", f"worker of rank {rank}", 1)
        if death is not None:
            raise WorkerDiedAtFetch(f"Training stopped after iteration {iteration - 1}: a {death}")
        return batches


class IterationLoop(TrainLoop):
    """``max_iter`` iterations; one ``before_epoch`` / ``after_epoch`` around them. A finite loader is cycled,
    ``set_epoch(k)`` on its sampler before pass ``k``, as MMEngine's iteration loop does."""

    def __init__(self, data_loader: Iterable[Any], accum_steps: int, max_iter: int) -> None:
        super().__init__(data_loader, accum_steps)
        self.max_iter = max_iter

    def _run_epochs(self, trainer: TrainerLike) -> None:
        self.call_hooks(trainer, "before_epoch")
        self._batches = endless_batches(self.data_loader, trainer.start_iter * self.accum_steps)
        self._run_steps(trainer, self.max_iter)
        self.call_hooks(trainer, "after_epoch")


class EpochLoop(TrainLoop):
    """``max_epochs`` passes over a finite loader, ``set_epoch(k)`` on its sampler before pass ``k``; an epoch is
    ``len(loader) // accum_steps`` iterations (a last group of fewer than ``accum_steps`` batches is dropped)."""

    unit = "epoch"

    def __init__(self, data_loader: Iterable[Any], accum_steps: int, max_epochs: int) -> None:
        super().__init__(data_loader, accum_steps)
        batches = len(data_loader)  # type: ignore[arg-type]
        if batches < accum_steps:
            raise ConfigError(f"The training loader has {batches} batches, fewer than SOLVER.ACCUM_STEPS "
                              f"({accum_steps}): an epoch would have no iteration.")
        self.max_epochs = max_epochs
        self.iters_per_epoch = batches // accum_steps
        self.max_iter = max_epochs * self.iters_per_epoch

    def _run_epochs(self, trainer: TrainerLike) -> None:
        skip = trainer.start_iter - trainer.epoch * self.iters_per_epoch
        while trainer.epoch < self.max_epochs and not trainer.stop_training:
            _set_sampler_epoch(self.data_loader, trainer.epoch)
            self.call_hooks(trainer, "before_epoch")
            self._batches = _one_pass(self.data_loader, skip * self.accum_steps)
            skip = 0
            self._run_steps(trainer, (trainer.epoch + 1) * self.iters_per_epoch)
            self.call_hooks(trainer, "after_epoch")
            trainer.epoch += 1

    def hook_kwargs(self, trainer: TrainerLike) -> dict[str, int]:
        return {"epoch": trainer.epoch, "max_epochs": self.max_epochs}



def build_loop(cfg: CfgNode, data_loader: Iterable[Any]) -> TrainLoop:
    """Epoch mode when ``SOLVER.MAX_EPOCHS`` > 0, else iteration mode for ``SOLVER.MAX_ITER``."""
    if cfg.SOLVER.MAX_EPOCHS > 0:
        return EpochLoop(data_loader, cfg.SOLVER.ACCUM_STEPS, cfg.SOLVER.MAX_EPOCHS)
    return IterationLoop(data_loader, cfg.SOLVER.ACCUM_STEPS, cfg.SOLVER.MAX_ITER)


def endless_batches(data_loader: Iterable[Any], first_batch: int) -> Iterator[Any]:
    """Iteration mode's batches from batch ``first_batch`` on: pass after pass, ``set_epoch(k)`` on the
    sampler before pass ``k``. Each pass starts as :func:`_one_pass` starts one (Pet's iteration-mode
    loaders have no length and one endless pass; resuming a finite loader drops the batches consumed)."""
    resumable = hasattr(data_loader, "set_start_iter")
    try:
        epoch, skip = divmod(first_batch, len(data_loader))  # type: ignore[arg-type]
    except (TypeError, ZeroDivisionError):  # no length (or 0, reported below): skip from the first pass on
        epoch, skip = 0, first_batch
    while True:
        _set_sampler_epoch(data_loader, epoch)
        drawn = 0
        for batch in _one_pass(data_loader, skip) if resumable else data_loader:
            drawn += 1
            if resumable or drawn > skip:
                yield batch
        if drawn == 0:
            raise TrainingError(f"The training data loader ({type(data_loader).__name__}) yielded no batch; "
                                "check that its dataset is not empty and its batch size fits it.")
        skip = 0 if resumable else max(0, skip - drawn)
        epoch += 1


def _one_pass(data_loader: Iterable[Any], skip: int) -> Iterator[Any]:
    """An iterator over one pass of the loader after its first ``skip`` batches (by ``set_start_iter`` when
    the loader has it, else drawn and dropped)."""
    if hasattr(data_loader, "set_start_iter"):
        data_loader.set_start_iter(skip)
        return iter(data_loader)
    iterator = iter(data_loader)
    for _ in range(skip):
        next(iterator)
    return iterator


def _set_sampler_epoch(data_loader: Iterable[Any], epoch: int) -> None:
    for holder in (getattr(data_loader, "batch_sampler", None), getattr(data_loader, "sampler", None)):
        if hasattr(holder, "set_epoch"):
            holder.set_epoch(epoch)
