"""PreciseBN: true BatchNorm population statistics, re-estimated with the weights frozen."""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from fvcore.common.config import CfgNode
from fvcore.nn.precise_bn import get_bn_modules, update_bn_stats

from pet.data import build_train_loader
from pet.engine.hooks.base import HOOKS, Priority, TrainerLike, TrainHook
from pet.engine.models import call_model
from pet.utils.errors import ConfigError
from pet.utils.tensor import move_to_device

__all__ = ["PreciseBN"]

logger = logging.getLogger(__name__)


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
        """``HOOKS.PRECISE_BN`` settings. The batches come from the trainer's loader when the caller gave
        the trainer one (their data, their model's batch format); else from a second loader over
        ``TRAIN.DATASETS``, as detectron2 does, built at the first update so a run that never
        gets there pays nothing."""
        settings = cfg.HOOKS.PRECISE_BN
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
        if trainer.loop.ends_period(trainer.iter, self.period, "iter") or self.is_last_iter(trainer):
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
