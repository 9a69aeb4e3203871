"""EMAHook: an exponential moving average of the weights, used for validation, test and deployment."""
from __future__ import annotations

import logging
import math
from typing import Any

import torch
from fvcore.common.config import CfgNode

from pet.engine.hooks.base import HOOKS, Priority, TrainerLike, TrainHook
from pet.engine.models import unwrap_model
from pet.utils.errors import ConfigError

__all__ = ["EMAHook"]

logger = logging.getLogger(__name__)


@HOOKS.register()
class EMAHook(TrainHook):
    """Keeps ``ema = (1 - m) * ema + m * weights`` of every floating-point parameter.

    The average is updated after every ``period``-th iteration, from iteration
    ``begin_iter`` (1-based; 0 or 1: from the first) or epoch ``begin_epoch`` (1-based,
    epoch mode); before that it is a plain copy of the weights. With ``anneal_iters`` > 0
    the momentum starts near 1 and decays to ``momentum``:
    ``m_t = momentum + (1 - momentum) * exp(-(1 + t) / anneal_iters)`` after ``t`` updates,
    so early averages are not dominated by the random initialisation. Buffers (BN
    statistics) are not averaged: the model's current ones are used.

    The averaged weights are swapped into the model around each validation
    (``before_val`` / ``after_val``) and written as the checkpoint's ``"model"``, with the
    raw weights under ``"model_raw"``: test_net.py, ``TRAIN.WEIGHTS`` and the published
    file get the averaged weights, a resume continues from the raw ones and the average.
    Runs at NORMAL priority: after the optimizer step, before EvalHook validates.
    """

    priority = Priority.NORMAL

    def __init__(
        self,
        momentum: float = 0.0002,
        period: int = 1,
        begin_iter: int = 0,
        begin_epoch: int = 0,
        anneal_iters: int = 0,
    ) -> None:
        if not 0.0 < momentum <= 1.0:
            raise ConfigError(f"HOOKS.EMA.MOMENTUM must be in (0, 1], got {momentum}")
        if period < 1:
            raise ConfigError(f"HOOKS.EMA.PERIOD must be >= 1, got {period}")
        self.momentum, self.period, self.anneal_iters = momentum, period, anneal_iters
        self.begin_iter, self.begin_epoch = begin_iter, begin_epoch
        self.steps = 0  # averaging updates done
        self._params: list[torch.nn.Parameter] = []
        self._index: dict[str, int] = {}  # state_dict name (tied weights: every alias) -> position
        self._ema: list[torch.Tensor] | None = None
        self._stash: list[torch.Tensor] | None = None

    @classmethod
    def from_config(cls, cfg: CfgNode, trainer: TrainerLike) -> EMAHook | None:
        e = cfg.HOOKS.EMA
        return cls(e.MOMENTUM, e.PERIOD, e.BEGIN_ITER, e.BEGIN_EPOCH, e.ANNEAL_ITERS) if e.ENABLED else None

    # ------------------------------------------------------------------ the average
    def momentum_at(self, steps: int) -> float:
        """Momentum of the update that follows ``steps`` earlier updates."""
        if self.anneal_iters > 0:
            return self.momentum + (1.0 - self.momentum) * math.exp(-(1 + steps) / self.anneal_iters)
        return self.momentum

    def averaged_state(self) -> dict[str, torch.Tensor]:
        """``{parameter name: averaged tensor}`` (the tensors themselves, not copies)."""
        assert self._ema is not None, "EMAHook has not seen the model yet"
        return {name: self._ema[i] for name, i in self._index.items()}

    def _setup(self, trainer: TrainerLike) -> None:
        if self._ema is not None:
            return
        positions: dict[int, int] = {}
        for name, param in unwrap_model(trainer.model).named_parameters(remove_duplicate=False):
            if param.dtype.is_floating_point:
                if id(param) not in positions:
                    positions[id(param)] = len(self._params)
                    self._params.append(param)
                self._index[name] = positions[id(param)]
        with torch.no_grad():
            self._ema = [p.detach().clone() for p in self._params]

    def _started(self, trainer: TrainerLike) -> bool:
        if self.begin_epoch > 0 and trainer.epoch + 1 < self.begin_epoch:
            return False
        return trainer.iter >= self.begin_iter

    # ------------------------------------------------------------------ mount points
    def before_train(self, trainer: TrainerLike, **kwargs: Any) -> None:
        if self.begin_epoch > 0 and trainer.max_epochs <= 0:
            raise ConfigError("HOOKS.EMA.BEGIN_EPOCH needs epoch mode (SOLVER.MAX_EPOCHS > 0); use BEGIN_ITER")
        self._setup(trainer)

    @torch.no_grad()
    def after_step(self, trainer: TrainerLike, **kwargs: Any) -> None:
        if not self._started(trainer):
            torch._foreach_copy_(self._ema, self._params)
        elif trainer.loop.ends_period(trainer.iter, self.period, "iter"):
            torch._foreach_lerp_(self._ema, self._params, self.momentum_at(self.steps))
            self.steps += 1

    @torch.no_grad()
    def before_val(self, **kwargs: Any) -> None:
        self._stash = [p.detach().clone() for p in self._params]
        torch._foreach_copy_(self._params, self._ema)

    @torch.no_grad()
    def after_val(self, **kwargs: Any) -> None:
        self._restore()

    def after_train(self, **kwargs: Any) -> None:
        self._restore()  # a validation that raised left the averaged weights in the model

    @torch.no_grad()
    def _restore(self) -> None:
        if self._stash is not None:
            torch._foreach_copy_(self._params, self._stash)
            self._stash = None

    def before_save_checkpoint(self, checkpoint: dict[str, Any], **kwargs: Any) -> None:
        if self._ema is None or "model_raw" in checkpoint:
            return
        raw = checkpoint["model"]
        averaged = type(raw)(raw)
        averaged.update((name, tensor) for name, tensor in self.averaged_state().items() if name in raw)
        checkpoint["model"], checkpoint["model_raw"] = averaged, raw

    @torch.no_grad()
    def after_load_checkpoint(self, trainer: TrainerLike, checkpoint: dict[str, Any], **kwargs: Any) -> None:
        self._setup(trainer)  # the model holds the raw weights now (the trainer loads "model_raw")
        if "model_raw" not in checkpoint:
            logger.info("The checkpoint has no averaged weights: the EMA starts from the loaded weights")
            return
        averaged = checkpoint["model"]
        for name, position in self._index.items():
            if name in averaged:
                self._ema[position].copy_(averaged[name])

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps}  # the averaged weights travel as the checkpoint's "model"

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.steps = int(state.get("steps", 0))

    def __repr__(self) -> str:
        return f"EMAHook(momentum={self.momentum}, begin_iter={self.begin_iter})"
