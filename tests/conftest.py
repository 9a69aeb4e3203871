"""Shared fixtures: a tiny regression model and loaders that cost nothing to run."""
from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pet.config import load_cfg

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


class ToyModel(torch.nn.Module):
    """Linear regression with a BatchNorm, returning a loss dict like a detector."""

    def __init__(self, with_bn: bool = False) -> None:
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(4) if with_bn else torch.nn.Identity()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        pred = self.linear(self.bn(x))
        return {"loss_mse": torch.nn.functional.mse_loss(pred, y), "loss_l1": (pred - y).abs().mean()}


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


@pytest.fixture
def make_cfg(tmp_path):
    """``make_cfg(KEY, VALUE, ...)``: defaults for a toy CPU run writing under tmp_path."""

    def _make(*opts: object, freeze: bool = True):
        base = [
            "CKPT", str(tmp_path / "run"), "DEVICE", "cpu", "SOLVER.MAX_ITER", "20", "SOLVER.BASE_LR", "0.01",
            "SOLVER.WARMUP_ITERS", "0", "SOLVER.LR_POLICY", "cosine", "DISPLAY_ITER", "5",
            "TRAIN.AUTO_RESUME", "False",
        ]
        if "SOLVER.MAX_EPOCHS" in opts:  # epoch mode: the iteration count comes from the loader
            base[base.index("SOLVER.MAX_ITER") + 1] = "0"
        return load_cfg(None, base + [str(o) for o in opts], freeze=freeze)

    return _make


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


def run_two_ranks(worker: Any, init_file: Any, *args: Any, timeout: float = 120) -> list[Any]:
    """Run ``worker(rank, init_file, *args, queue)`` in two processes; what they put on the queue, sorted.

    Spawned, not forked: a fork copies torch's OpenMP thread pool, which hangs the child once an
    earlier test has used it. A hang shows up as ``queue.Empty`` after ``timeout``; both
    processes must exit cleanly.
    """
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    workers = [context.Process(target=worker, args=(rank, init_file, *args, queue)) for rank in range(2)]
    for process in workers:
        process.start()
    try:
        results = sorted(queue.get(timeout=timeout) for _ in workers)
    finally:
        for process in workers:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    assert [process.exitcode for process in workers] == [0, 0]
    return results


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
