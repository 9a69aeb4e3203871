"""The Pet four: PeriodicWriter, IterationTimer, LRScheduler and PreciseBN."""
from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from fvcore.common.config import CfgNode
from fvcore.nn.precise_bn import get_bn_modules, update_bn_stats

from pet.data import build_train_loader
from pet.engine.common import call_model
from pet.engine.events import EventStorage, EventWriter, build_writers, close_writers
from pet.engine.hooks.base import HOOKS, Priority, TrainerLike, TrainHook
from pet.utils import comm
from pet.utils.errors import ConfigError
from pet.utils.tensor import move_to_device

__all__ = ["PeriodicWriter", "IterationTimer", "LRScheduler", "PreciseBN"]

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
        if self.every_n_iters(trainer, self.period) or self.is_last_iter(trainer):
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


class _CallWithBatch(torch.nn.Module):
    """Lets fvcore's ``update_bn_stats`` (which calls ``model(inputs)``) drive a ``model(*batch)`` model."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Any) -> Any:
        return call_model(self.model, batch)


@HOOKS.register()
class PreciseBN(TrainHook):
    """Recomputes true BatchNorm population statistics every ``period`` iterations and at the end.

    BN running averages are dominated by the last few batches; with a changing model
    they lag behind. fvcore's ``update_bn_stats`` re-estimates them over ``num_iter``
    training batches with the weights frozen. A model without training-mode BN layers
    disables the hook (logged once).

    ``data_loader_fn`` returns the loader to draw batches from (called once, at the first
    update). Give it a loader of its own: iterating the trainer's loader while training
    draws from it would disturb the training batch sequence (with persistent workers,
    ``iter(DataLoader)`` resets the one iterator both share). Default: the trainer's
    loader, only for loaders whose ``iter()`` gives independent iterators (a persistent-worker
    DataLoader is refused in ``before_train``). :meth:`from_config` builds a separate one.

    The number of batches drawn is checkpointed, so a resumed run continues the PreciseBN
    stream where it stopped (for loaders with ``set_start_iter``, as Pet's are).
    """

    priority = Priority.ABOVE_NORMAL

    def __init__(
        self,
        period: int = 0,
        num_iter: int = 200,
        data_loader_fn: Callable[[], Iterable[Any]] | None = None,
    ) -> None:
        self.period = period
        self.num_iter = num_iter
        self._data_loader_fn = data_loader_fn
        self._loader: Iterable[Any] | None = None
        self._batches: Iterator[Any] | None = None
        self._batches_drawn = 0
        self._disabled = False

    @classmethod
    def from_config(cls, cfg: CfgNode, trainer: TrainerLike) -> PreciseBN | None:
        """``TEST.PRECISE_BN`` settings. The batches come from the trainer's loader when the caller gave
        the trainer one (their data, their model's batch format); else from a second loader over
        ``TRAIN.DATASETS``, as detectron2 does, built at the first update so a run that never
        gets there pays nothing."""
        settings = cfg.TEST.PRECISE_BN
        if not settings.ENABLED:
            return None
        if not getattr(trainer, "data_loader_from_cfg", True):
            return cls(settings.PERIOD, settings.NUM_ITER)

        def build_loader() -> Iterable[Any]:
            logger.info(f"PreciseBN draws its batches from a separate loader over {list(cfg.TRAIN.DATASETS)}.")
            return build_train_loader(cfg)

        return cls(settings.PERIOD, settings.NUM_ITER, build_loader)

    def before_train(self, trainer: TrainerLike, **kwargs: Any) -> None:
        if not get_bn_modules(trainer.model):
            logger.info("PreciseBN is disabled: the model has no BatchNorm layer in training mode.")
            self._disabled = True
        elif self._data_loader_fn is None and getattr(trainer.data_loader, "persistent_workers", False):
            raise ConfigError(
                "PreciseBN cannot draw from the trainer's loader: it has persistent workers, so iterating it would "
                "restart the training batch sequence. Give PreciseBN a data_loader_fn (PreciseBN.from_config(cfg) "
                "builds a separate training loader)."
            )

    def after_step(self, trainer: TrainerLike, **kwargs: Any) -> None:
        if self._disabled:
            return
        if self.every_n_iters(trainer, self.period) or self.is_last_iter(trainer):
            self.update_stats(trainer)

    def update_stats(self, trainer: TrainerLike) -> None:
        """Run ``num_iter`` batches through the model in training mode, without gradients."""
        device = trainer.device
        batches = (move_to_device(batch, device) for batch in self._next_batches(trainer))
        with torch.no_grad():
            update_bn_stats(_CallWithBatch(trainer.model), batches, self.num_iter)

    def state_dict(self) -> dict[str, int]:
        return {"batches_drawn": self._batches_drawn}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._batches_drawn = int(state.get("batches_drawn", 0))

    def _next_batches(self, trainer: TrainerLike) -> Iterator[Any]:
        if self._loader is None and self._data_loader_fn is None:
            self._loader = trainer.data_loader  # the trainer positions it on resume; leave that alone
        elif self._loader is None:
            self._loader = self._data_loader_fn()
            self._skip_to_resume_point()
        for _ in range(self.num_iter):
            batch = next(self._batches, None) if self._batches is not None else None
            if batch is None:  # first use, or a finite (epoch-mode) loader ran out: start it again
                self._batches = iter(self._loader)
                batch = next(self._batches)
            self._batches_drawn += 1
            yield batch

    def _skip_to_resume_point(self) -> None:
        """After a resume, make this hook's own loader start where the interrupted run's stream was."""
        if not self._batches_drawn or not hasattr(self._loader, "set_start_iter"):
            return
        try:
            position = self._batches_drawn % len(self._loader)  # type: ignore[arg-type]
        except TypeError:  # an infinite loader has no length
            position = self._batches_drawn
        self._loader.set_start_iter(position)
