"""engine: per-iteration overhead of Pet's Trainer over a plain PyTorch loop (and MMEngine's Runner).

The same trivial model, loader and SGD (momentum, weight decay) everywhere, so compute is ~0;
Pet runs its default hooks and writers, MMEngine its default hooks when mmengine is importable
(it is not a Pet dependency: install it in the benchmark's own environment). Per-iteration time
is the steady state, clocked by a lowest-priority hook after every iteration (see _StepClock);
the time with building and finishing the run is printed next to it.
"""
from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from functools import partial
from typing import Any

import torch

from pet.config import load_cfg
from pet.engine.hooks import TrainHook
from pet.engine.trainer import Trainer

from .common import format_fingerprint, interleaved

BATCH = 8


class _Batches(torch.utils.data.Dataset):
    """Pre-made ``{"x", "y"}`` batches: the loader does no work, so the loop overhead shows."""

    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.xs = torch.randn(n, BATCH, 4, generator=gen)

    def __len__(self) -> int:
        return len(self.xs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.xs[i]
        return {"x": x, "y": x.sum(dim=1, keepdim=True)}


def _first(items: list) -> dict[str, torch.Tensor]:
    return items[0]


def _make_loader(n: int) -> torch.utils.data.DataLoader:
    """The same loader for every framework: batch_size 1 over pre-made batches, 0 workers."""
    return torch.utils.data.DataLoader(_Batches(n), batch_size=1, shuffle=False, num_workers=0, collate_fn=_first)


class _LossDictModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.mse_loss(self.linear(x), y)}


# Iterations run before the steady-state clock starts: lazy initialisation, first-use costs.
WARM_ITERS = 100


class _StepClock:
    """Timestamps after each iteration. Steady-state time per iteration is measured between the end
    of iteration WARM_ITERS and the end of the last one, so it holds every per-iteration cost (loop,
    hooks, writers) and none of the one-off ones (building, final checkpoint, curves.png)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def tick(self) -> None:
        self.times.append(time.perf_counter())

    def result(self, start: float, end: float) -> dict[str, float]:
        iters = len(self.times)
        return {"steady": (self.times[-1] - self.times[WARM_ITERS - 1]) / (iters - WARM_ITERS),
                "total": (end - start) / iters}


def run_plain(iters: int) -> dict[str, float]:
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    loader = _make_loader(iters)
    clock = _StepClock()
    start = time.perf_counter()
    for batch in loader:
        loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        clock.tick()
    return clock.result(start, time.perf_counter())


def run_pet(iters: int) -> dict[str, float]:
    clock = _StepClock()

    class ClockHook(TrainHook):
        priority = "LOWEST"

        def after_step(self, **kwargs: Any) -> None:
            clock.tick()

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        cfg = load_cfg(None, ["CKPT", tmp, "DEVICE", "cpu", "SOLVER.MAX_ITER", str(iters), "SOLVER.BASE_LR",
                              "0.01", "SOLVER.WARMUP_ITERS", "0", "TRAIN.AUTO_RESUME", "False"])
        trainer = Trainer(cfg, model=_LossDictModel(), data_loader=_make_loader(iters))
        trainer.register_hooks([ClockHook()])
        trainer.train()
        return clock.result(start, time.perf_counter())


def run_mmengine(iters: int) -> dict[str, float] | None:
    try:
        from mmengine.hooks import Hook
        from mmengine.model import BaseModel
        from mmengine.runner import Runner
    except ImportError:
        return None

    class MMModel(BaseModel):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 1)

        def forward(self, x, y, mode="loss"):  # noqa: ANN001 - MMEngine's calling convention
            return {"loss": torch.nn.functional.mse_loss(self.linear(x), y)}

    clock = _StepClock()

    class ClockHook(Hook):
        priority = "LOWEST"

        def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:  # noqa: ANN001
            clock.tick()

    loader = _make_loader(iters + 10)  # + 10: never exhausted (MMEngine sleeps 2 s when it is)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        runner = Runner(
            model=MMModel(),
            work_dir=tmp,
            train_dataloader=loader,
            optim_wrapper={"optimizer": {"type": "SGD", "lr": 0.01, "momentum": 0.9, "weight_decay": 1e-4}},
            train_cfg={"by_epoch": False, "max_iters": iters},
            default_hooks={"checkpoint": {"type": "CheckpointHook", "interval": 10**9}},
            custom_hooks=[ClockHook()],
            log_level="WARNING",
        )
        runner.train()
        return clock.result(start, time.perf_counter())


def engine(args: argparse.Namespace, fingerprint: dict) -> dict:
    torch.set_num_threads(1)
    logging.getLogger("pet").setLevel(logging.WARNING)
    runners = {"plain": run_plain, "pet": run_pet, "mmengine": run_mmengine}
    samples = interleaved({name: partial(fn, args.iters) for name, fn in runners.items()}, args.repeats)
    us = {name: {kind: statistics.median(s[kind] for s in v) * 1e6 for kind in ("steady", "total")}
          for name, v in samples.items() if v}
    overhead = {name: us[name]["steady"] - us["plain"]["steady"] for name in us if name != "plain"}
    print(format_fingerprint(fingerprint))
    print(f"engine overhead, trivial model, {args.iters} iterations x {args.repeats} interleaved repeats (median), "
          f"1 thread; steady state after {WARM_ITERS} iterations; 'with set-up' adds building and finishing the run")
    print(f"{'loop':<10} {'us/iter':>10} {'overhead us':>12} {'us/iter with set-up':>20}")
    for name, value in us.items():
        print(f"{name:<10} {value['steady']:>10.1f} {overhead.get(name, 0.0):>12.1f} {value['total']:>20.1f}")
    if "mmengine" in overhead:
        print(f"Pet overhead / MMEngine overhead = {overhead['pet'] / overhead['mmengine']:.2f}")
    return {"us_per_iter": us, "overhead_us": overhead, "samples_s": samples}

