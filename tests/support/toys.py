"""A toy model and loaders that cost nothing to run, and small helpers for tests of the trainer and its hooks."""
from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

from pet.engine.hooks import Priority, TrainHook
from pet.engine.trainer import Trainer


class ToyModel(torch.nn.Module):
    """Linear regression with a BatchNorm, returning a loss dict like a detector."""

    def __init__(self, with_bn: bool = False) -> None:
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(4) if with_bn else torch.nn.Identity()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        pred = self.linear(self.bn(x))
        return {"loss_mse": torch.nn.functional.mse_loss(pred, y), "loss_l1": (pred - y).abs().mean()}


class NanLossModel(ToyModel):
    """A :class:`ToyModel` whose ``loss_l1`` is NaN at its ``nan_at``-th call (on process ``rank`` only, when given)."""

    def __init__(self, nan_at: int, rank: int | None = None) -> None:
        super().__init__()
        self.nan_at = nan_at
        self.rank = rank
        self.calls = 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        self.calls += 1
        losses = super().forward(x, y)
        if self.calls == self.nan_at and (self.rank is None or torch.distributed.get_rank() == self.rank):
            losses["loss_l1"] = losses["loss_l1"] * float("nan")
        return losses


class ToyLoader:
    """A finite, re-iterable loader of ``(x, y)`` batches with a fixed seed per pass."""

    def __init__(self, num_batches: int = 10, batch_size: int = 8, seed: int = 0, offset: float = 0.0) -> None:
        self.num_batches = num_batches
        self.batch_size = batch_size
        self.seed = seed
        self.offset = offset

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(self.seed)
        for _ in range(self.num_batches):
            x = torch.randn(self.batch_size, 4, generator=gen) * 3 + self.offset
            yield x, x.sum(dim=1, keepdim=True)


class InfiniteToyLoader(ToyLoader):
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(self.seed)
        while True:
            x = torch.randn(self.batch_size, 4, generator=gen) * 3 + self.offset
            yield x, x.sum(dim=1, keepdim=True)


class IndexedToyLoader(ToyLoader):
    """Batch ``i`` depends only on ``i`` (seeded by ``seed + i``); ``set_start_iter`` jumps to a batch.

    The trainer calls ``set_start_iter`` at the start of every pass, so a resumed run sees
    exactly the batches an uninterrupted one would. ``num_batches <= 0``: infinite.
    """

    def __init__(self, num_batches: int = 0, batch_size: int = 8, seed: int = 0) -> None:
        super().__init__(num_batches, batch_size, seed)
        self.start_iter = 0
        self.start_iters: list[int] = []

    def set_start_iter(self, start_iter: int) -> None:
        self.start_iter = start_iter
        self.start_iters.append(start_iter)

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed + index)
        x = torch.randn(self.batch_size, 4, generator=gen) * 3
        return x, x.sum(dim=1, keepdim=True)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        index = self.start_iter
        while self.num_batches <= 0 or index < self.num_batches:
            yield self.batch(index)
            index += 1


def toy_trainer(cfg: Any, *hooks: Any, loader: Any = None, seed: int = 0, default_hooks: bool = True) -> Trainer:
    """A Trainer of a seeded :class:`ToyModel` on an :class:`IndexedToyLoader` (or ``loader``), plus ``hooks``."""
    torch.manual_seed(seed)
    trainer = Trainer(cfg, model=ToyModel(), data_loader=loader if loader is not None else IndexedToyLoader(),
                      default_hooks=default_hooks)
    trainer.register_hooks(hooks)
    return trainer


class CrashAt(TrainHook):
    """Raises in ``before_step`` once ``at`` iterations are complete, like a process killed there."""

    priority = Priority.HIGHEST

    def __init__(self, at: int) -> None:
        self.at = at

    def before_step(self, trainer: Any, **kwargs: Any) -> None:
        if trainer.iter == self.at + 1:
            raise RuntimeError("simulated crash")


def hook_of(trainer: Trainer, cls: type) -> Any:
    """The first hook of class ``cls`` the trainer has."""
    return next(h for h in trainer.hooks if isinstance(h, cls))


def regular_iters(directory: Any) -> list[int]:
    """The N of every ``model_iter{N}.pth`` in ``directory``, sorted."""
    return sorted(int(m.group(1)) for f in os.listdir(directory) if (m := re.fullmatch(r"model_iter(\d+)\.pth", f)))


def scripted_eval(table: dict[int, dict[str, float]], calls: list[int] | None = None) -> Callable[[Any], dict]:
    """An eval function returning ``table[iterations completed]`` (a dict of metrics); records the calls."""

    def evaluate(trainer: Any) -> dict[str, float]:
        if calls is not None:
            calls.append(trainer.iter)
        return table[trainer.iter]

    return evaluate


def record_saves(trainer: Trainer) -> list[tuple[str, int]]:
    """``(filename, iteration)`` of every checkpoint the trainer writes from now on."""
    saves = []
    original = trainer.checkpointer.save

    def spy(filename: str, **kwargs: Any) -> str:
        saves.append((filename, trainer.iter))
        return original(filename, **kwargs)

    trainer.checkpointer.save = spy
    return saves


class FakeClock:
    """A ``time.perf_counter`` stand-in that moves only when told: measured durations are exact on any machine.

    Code under test "takes" time by calling ``advance(seconds)`` instead of sleeping, so a test
    asserts the exact split a timer must report instead of comparing to wall-clock bounds.
    """

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
