"""The hooks that act after every step: IterationTimer (its time), LRScheduler (the lr, then the
schedule's step) and PeriodicWriter (the storage to the writers every ``DISPLAY_ITER``).

With :class:`pet.engine.hooks.PreciseBN` they are the Pet four.
"""
from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from fvcore.common.config import CfgNode

from pet.engine.events import EventStorage, EventWriter, build_writers, close_writers
from pet.engine.hooks.base import HOOKS, Priority, TrainerLike, TrainHook
from pet.utils import comm

__all__ = ["PeriodicWriter", "IterationTimer", "LRScheduler"]

logger = logging.getLogger(__name__)


def _format_duration(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(round(seconds))))


@HOOKS.register()
class PeriodicWriter(TrainHook):
    """Hands the storage to every writer each ``period`` iterations and after the last one.

    Runs after the hooks that put values in a step (timer, lr, evaluation) so a write
    sees that step complete. Writers are closed in ``after_train``, also on failure, each even when
    another fails, in their ``close_order`` (:func:`pet.engine.events.close_writers`).
    ``writers`` may be a function ``trainer -> writers``, called in ``before_train``
    once a resume has fixed ``trainer.start_iter`` (writers use it to continue their files).
    """

    priority = Priority.LOW

    def __init__(
        self,
        writers: Iterable[EventWriter] | Callable[[Any], Iterable[EventWriter]],
        period: int = 20,
    ) -> None:
        self._writers_fn = writers if callable(writers) else None
        self.writers: list[EventWriter] = [] if callable(writers) else list(writers)
        self.period = period
        self._last_written = -1

    @classmethod
    def from_config(cls, cfg: CfgNode, trainer: TrainerLike) -> PeriodicWriter | None:
        """The terminal, metrics.json, TensorBoard and ``TRAIN.WRITERS`` writers, on the main process."""
        if not comm.is_main_process():
            return None
        return cls(lambda t: build_writers(cfg, t.max_iter, t.start_iter), period=cfg.DISPLAY_ITER)

    def before_train(self, trainer: TrainerLike, **kwargs: Any) -> None:
        if self._writers_fn is not None:
            os.makedirs(trainer.output_dir, exist_ok=True)
            self.writers = list(self._writers_fn(trainer))

    def after_step(self, trainer: TrainerLike, storage: EventStorage, **kwargs: Any) -> None:
        if trainer.loop.ends_period(trainer.iter, self.period, "iter") or self.is_last_iter(trainer):
            self._write(trainer, storage)

    def after_train(self, trainer: TrainerLike, storage: EventStorage, **kwargs: Any) -> None:
        try:
            if storage.iter > self._last_written and storage.iter > trainer.start_iter:
                self._write(trainer, storage)  # a run stopped early still logs its last state
        finally:
            close_writers(self.writers)

    def _write(self, trainer: TrainerLike, storage: EventStorage) -> None:
        for writer in self.writers:
            writer.write(trainer=trainer, storage=storage)
        self._last_written = storage.iter


@HOOKS.register()
class IterationTimer(TrainHook):
    """Puts ``time`` (seconds of each step: data, forward, backward, optimizer) and reports totals.

    Hook time is excluded because the trainer measures the step itself
    (``trainer.last_step_seconds``); the first ``warmup_iter`` steps of a run (slow:
    allocator growth, worker start-up) are left out of ``time`` and the average speed.
    """

    priority = Priority.VERY_HIGH

    def __init__(self, warmup_iter: int = 3) -> None:
        self.warmup_iter = warmup_iter
        self._elapsed_before_resume = 0.0

    @classmethod
    def from_config(cls, cfg: CfgNode, trainer: TrainerLike) -> IterationTimer:
        return cls()

    def before_train(self, **kwargs: Any) -> None:
        self._start = time.perf_counter()
        self._steps = 0
        self._all_step_seconds = 0.0
        self._timed_seconds = 0.0
        self._timed_steps = 0

    def after_step(self, trainer: TrainerLike, storage: EventStorage, **kwargs: Any) -> None:
        seconds = trainer.last_step_seconds
        self._steps += 1
        self._all_step_seconds += seconds
        if self._steps > self.warmup_iter:
            self._timed_seconds += seconds
            self._timed_steps += 1
            storage.put_scalar("time", seconds)

    def after_train(self, **kwargs: Any) -> None:
        total = time.perf_counter() - self._start
        if self._timed_steps:
            logger.info(
                f"Overall training speed: {self._timed_steps} iterations in "
                f"{_format_duration(self._timed_seconds)} ({self._timed_seconds / self._timed_steps:.4f} s / it)"
            )
        hooks_and_overhead = max(total - self._all_step_seconds, 0.0)
        logger.info(
            f"Total training time: {_format_duration(total)} ({_format_duration(hooks_and_overhead)} on hooks)"
            + (f"; {_format_duration(total + self._elapsed_before_resume)} including earlier runs"
               if self._elapsed_before_resume else "")
        )

    def state_dict(self) -> dict[str, float]:
        now = getattr(self, "_start", None)
        elapsed = time.perf_counter() - now if now is not None else 0.0
        return {"elapsed_seconds": self._elapsed_before_resume + elapsed}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self._elapsed_before_resume = float(state.get("elapsed_seconds", 0.0))


@HOOKS.register()
class LRScheduler(TrainHook):
    """Puts ``lr`` (unsmoothed) then steps the scheduler, after every iteration.

    With several parameter groups, the reported lr is the one of the group holding
    the most parameters (the backbone and heads, not the bias/norm group).
    """

    priority = Priority.HIGH

    def __init__(self, optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None) -> None:
        self._optimizer = optimizer
        self._scheduler = scheduler

    @classmethod
    def from_config(cls, cfg: CfgNode, trainer: TrainerLike) -> LRScheduler:
        return cls()

    def before_train(self, trainer: TrainerLike, **kwargs: Any) -> None:
        self._optimizer = self._optimizer or trainer.optimizer
        self._scheduler = self._scheduler or trainer.scheduler
        groups = self._optimizer.param_groups
        self._group = max(range(len(groups)), key=lambda i: sum(p.numel() for p in groups[i]["params"]))

    def after_step(self, storage: EventStorage, **kwargs: Any) -> None:
        storage.put_scalar("lr", self._optimizer.param_groups[self._group]["lr"], smoothing_hint=False)
        if self._scheduler is not None:
            self._scheduler.step()
