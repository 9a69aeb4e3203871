"""Loop modes: how a run's iterations are grouped into epochs and where each step's batches come from.

One class per mode, as MMEngine's ``IterBasedTrainLoop`` / ``EpochBasedTrainLoop``, so that neither the
trainer nor the hooks branch on the mode: :class:`IterationLoop` (``SOLVER.MAX_ITER`` iterations, one
``before_epoch`` / ``after_epoch`` around them) and :class:`EpochLoop` (``SOLVER.MAX_EPOCHS`` passes over a
finite loader). A loop calls back into the trainer for what every mode shares (``call_hooks``,
``run_steps``); hooks ask it whether a period (in its unit) ends at an iteration (:meth:`TrainLoop.ends_period`).

Both feed steps from passes over the loader, each after ``set_epoch(k)`` on its sampler, the first one
starting where a resumed run left off (by index arithmetic with ``set_start_iter``, Pet's loaders; else by
drawing and dropping batches); iteration mode chains the passes (:func:`endless_batches`).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from fvcore.common.config import CfgNode

from pet.data.workers import fetch
from pet.utils import comm
from pet.utils.errors import ConfigError, TrainingError

__all__ = ["TrainLoop", "IterationLoop", "EpochLoop", "build_loop", "endless_batches", "WorkerDiedAtFetch"]


class LoopTrainer(Protocol):
    """What a loop drives: the trainer's counters and its step."""

    iter: int
    epoch: int
    start_iter: int
    stop_training: bool

    def call_hooks(self, point: str, **kwargs: Any) -> None: ...

    def run_steps(self, end: int) -> None: ...


class WorkerDiedAtFetch(Exception):
    """A data-loading worker died, seen at a training fetch: the state is that of the last completed iteration."""


class TrainLoop:
    """What both modes share: the loader, ``accum_steps`` batches per iteration, the batch stream."""

    max_iter: int
    max_epochs = 0  # epoch mode only
    iters_per_epoch = 0  # epoch mode only

    def __init__(self, data_loader: Iterable[Any], accum_steps: int) -> None:
        self.data_loader = data_loader
        self.accum_steps = accum_steps
        self._batches: Iterator[Any] = iter(())

    def run(self, trainer: LoopTrainer) -> None:
        """Run ``trainer`` from its ``start_iter`` to :attr:`max_iter`, with the epoch mount points."""
        raise NotImplementedError

    def hook_kwargs(self, trainer: LoopTrainer) -> dict[str, int]:
        """The mode's extra keyword arguments for every mount point (``epoch=``/``max_epochs=`` in epoch mode)."""
        return {}

    def ends_period(self, iteration: int, period: int) -> bool:
        """Iteration ``iteration`` ends a period of ``period`` units of this mode (never for ``period <= 0``)."""
        return period > 0 and iteration % period == 0

    def next_batches(self, iteration: int) -> list[Any]:
        """The ``accum_steps`` batches of step ``iteration``; raises :class:`WorkerDiedAtFetch` when a data-loading
        worker of any process has died.

        The fetch is where a death is acted on (:func:`pet.data.workers.fetch`): before the forward
        pass, while weights, optimizer and counters are those of the last completed iteration, which
        the trainer then saves. In a distributed run the processes agree here (one small all-reduce
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

    def run(self, trainer: LoopTrainer) -> None:
        trainer.call_hooks("before_epoch")
        self._batches = endless_batches(self.data_loader, trainer.start_iter * self.accum_steps)
        trainer.run_steps(self.max_iter)
        trainer.call_hooks("after_epoch")


class EpochLoop(TrainLoop):
    """``max_epochs`` passes over a finite loader, ``set_epoch(k)`` on its sampler before pass ``k``; an epoch is
    ``len(loader) // accum_steps`` iterations (a last group of fewer than ``accum_steps`` batches is dropped)."""

    def __init__(self, data_loader: Iterable[Any], accum_steps: int, max_epochs: int) -> None:
        super().__init__(data_loader, accum_steps)
        batches = len(data_loader)  # type: ignore[arg-type]
        if batches < accum_steps:
            raise ConfigError(f"The training loader has {batches} batches, fewer than SOLVER.ACCUM_STEPS "
                              f"({accum_steps}): an epoch would have no iteration.")
        self.max_epochs = max_epochs
        self.iters_per_epoch = batches // accum_steps
        self.max_iter = max_epochs * self.iters_per_epoch

    def run(self, trainer: LoopTrainer) -> None:
        skip = trainer.start_iter - trainer.epoch * self.iters_per_epoch
        while trainer.epoch < self.max_epochs and not trainer.stop_training:
            _set_sampler_epoch(self.data_loader, trainer.epoch)
            trainer.call_hooks("before_epoch")
            self._batches = _one_pass(self.data_loader, skip * self.accum_steps)
            skip = 0
            trainer.run_steps((trainer.epoch + 1) * self.iters_per_epoch)
            trainer.call_hooks("after_epoch")
            trainer.epoch += 1

    def hook_kwargs(self, trainer: LoopTrainer) -> dict[str, int]:
        return {"epoch": trainer.epoch, "max_epochs": self.max_epochs}

    def ends_period(self, iteration: int, period: int) -> bool:
        epochs, within = divmod(iteration, self.iters_per_epoch)
        return period > 0 and within == 0 and epochs % period == 0


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
