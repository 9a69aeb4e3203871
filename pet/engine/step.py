"""One training step: forward, loss reduction, finite check, backward, optimizer (with AMP).

The train loop (:mod:`pet.engine.loops`) fetches a batch and calls :class:`TrainStep`;
everything else around a step (schedules, logging, checkpoints) is a hook's job.
"""
from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pet.engine.models import call_model
from pet.engine.precision import Precision
from pet.utils import comm
from pet.utils.errors import TrainingError

__all__ = ["TrainStep", "StepResult"]

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one step reports back to the loop.

    ``metrics``: every loss term, ``total_loss`` and ``data_time``, averaged over processes
    (``data_time``: the slowest process's). ``stop_signal``: the largest signal number any
    process received before this step's reduction (0: none), so all stop after the same step.
    """

    metrics: dict[str, float]
    stop_signal: int


class TrainStep:
    """Forward -> loss terms reduced over processes -> finite check -> backward -> optimizer step.

    One call is one iteration: an optimizer step over one batch, or over several with
    gradient accumulation (``SOLVER.ACCUM_STEPS``): each batch's loss is divided by their
    number and back-propagated; DistributedDataParallel skips its gradient all-reduce
    (``no_sync``) for all but the last; the GradScaler unscales, clips and steps once.
    With batches that average their loss over images, N batches of B images give the
    gradient of one batch of N x B images (tested).

    The loss terms are averaged over processes *before* the finite check, so every process
    takes the same decision: one raising or skipping while the others wait in backward's
    all-reduce would hang a distributed run. A non-finite loss raises a
    :class:`TrainingError` naming the iteration and the term, or, with ``skip_nonfinite``,
    skips the update (counted in ``nonfinite_skipped``).

    ``precision`` autocasts the forward; a float16 precision comes with a GradScaler,
    whose state is part of a checkpoint (``grad_scaler``).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, precision: Precision, *,
                 clip_grad_norm: float = 0.0, skip_nonfinite: bool = False) -> None:
        self.model, self.optimizer, self.precision = model, optimizer, precision
        self.clip_grad_norm, self.skip_nonfinite = clip_grad_norm, skip_nonfinite
        self.grad_scaler = torch.amp.GradScaler("cuda") if precision.grad_scaler else None
        self.nonfinite_skipped = 0

    def __call__(self, batches: Sequence[Any], *, iteration: int, data_seconds: float,
                 stop_signal: int = 0) -> StepResult:
        """Train on ``batches`` (one, or ``ACCUM_STEPS``); ``iteration`` (1-based) names the step in errors,
        ``stop_signal`` is this process's pending signal (0: none), shared through the last reduction."""
        self.optimizer.zero_grad(set_to_none=True)
        summed: dict[str, float] = {}
        for index, batch in enumerate(batches):
            last = index == len(batches) - 1
            with contextlib.nullcontext() if last else self._no_sync():
                # The data time and this process's signal travel with the last batch's reduction.
                losses, reduced, signal = self._forward(batch, data_seconds if last else 0.0,
                                                        stop_signal if last else 0)
                data_time = reduced.pop("data_time")
                for name, value in reduced.items():
                    summed[name] = summed.get(name, 0.0) + value
                if not math.isfinite(reduced["total_loss"]):
                    self._on_nonfinite(reduced, iteration)
                    return StepResult(self._mean(summed, index + 1, data_time), signal)
                self._backward(losses / len(batches) if len(batches) > 1 else losses)
        self._optimizer_step()
        return StepResult(self._mean(summed, len(batches), data_time), signal)

    def _forward(self, batch: Any, data_seconds: float, stop_signal: int) -> tuple[torch.Tensor, dict[str, float], int]:
        """The summed loss to back-propagate; the loss terms, ``total_loss`` and ``data_time`` reduced over
        processes (data time: the slowest's); any process's signal."""
        with self.precision.autocast():
            loss_dict = call_model(self.model, batch)
        if not isinstance(loss_dict, dict) or not loss_dict:
            raise TrainingError(
                f"The model's training forward must return a non-empty dict of losses, got {type(loss_dict).__name__}"
            )
        terms = list(loss_dict.values())
        losses = terms[0]
        for term in terms[1:]:
            losses = losses + term
        # One device sync for all terms (item() per term would sync once each on CUDA).
        values = [t.detach().item() for t in terms] if len(terms) == 1 or losses.device.type == "cpu" else (
            torch.stack([t.detach().float() for t in terms]).tolist())
        local = dict(zip(loss_dict, values), total_loss=sum(values), data_time=data_seconds)
        reduced, signal = comm.reduce_scalars_with_flag(local, stop_signal, maximum=("data_time",))
        # The model's order, then the terms only other processes had (their mean counts this process's as 0).
        return losses, {**{name: reduced[name] for name in local}, **reduced}, signal

    @staticmethod
    def _mean(summed: dict[str, float], count: int, data_time: float) -> dict[str, float]:
        """Loss terms averaged over the accumulated batches, in the model's order, then ``data_time``."""
        return {**{name: value / count for name, value in summed.items()}, "data_time": data_time}

    def _no_sync(self) -> Any:
        no_sync = getattr(self.model, "no_sync", None)  # DistributedDataParallel's
        return no_sync() if no_sync is not None else contextlib.nullcontext()

    def _backward(self, loss: torch.Tensor) -> None:
        (self.grad_scaler.scale(loss) if self.grad_scaler is not None else loss).backward()

    def _optimizer_step(self) -> None:
        if self.grad_scaler is not None:
            self.grad_scaler.unscale_(self.optimizer)
            self._clip_gradients()
            self.grad_scaler.step(self.optimizer)
            self.grad_scaler.update()
        else:
            self._clip_gradients()
            self.optimizer.step()

    def _clip_gradients(self) -> None:
        if self.clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad_norm)

    def _on_nonfinite(self, metrics: dict[str, float], iteration: int) -> None:
        bad = ", ".join(f"{k}={v}" for k, v in metrics.items() if k != "total_loss" and not math.isfinite(v))
        if self.skip_nonfinite:
            self.nonfinite_skipped += 1
            logger.warning(f"Non-finite loss at iteration {iteration} ({bad}); step skipped "
                           f"({self.nonfinite_skipped} skipped so far)")
            return
        raise TrainingError(
            f"Non-finite loss at iteration {iteration}: {bad}. The last good checkpoint is kept. "
            "Lower SOLVER.BASE_LR, raise SOLVER.WARMUP_ITERS or set SOLVER.CLIP_GRAD_NORM; "
            "SOLVER.SKIP_NONFINITE True skips such steps instead."
        )
