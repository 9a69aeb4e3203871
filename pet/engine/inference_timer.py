"""Honest inference timing: per-stage timers (data / infer / post and any named extra) with warm-up.

:class:`InferenceTimer` is what the test loop (:func:`pet.engine.inference.inference_on_dataset`)
drives; :class:`pet.engine.hooks.TestHook` adds the test callbacks to it.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

__all__ = ["InferenceTimer", "StageTimer"]

logger = logging.getLogger(__name__)


class StageTimer:
    """Durations of one named stage, one entry per (non-warm-up) iteration.

    ``clock`` returns seconds (``time.perf_counter`` by default); tests pass a fake one.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.durations: list[float] = []
        self._start: float | None = None

    def tic(self) -> None:
        self._start = self.clock()

    def toc(self, record: bool = True) -> float:
        if self._start is None:
            raise RuntimeError("toc() called before tic()")
        elapsed = self.clock() - self._start
        self._start = None
        if record:
            self.durations.append(elapsed)
        return elapsed

    def reset(self) -> None:
        self.durations.clear()
        self._start = None

    @property
    def total(self) -> float:
        return float(sum(self.durations))

    @property
    def average(self) -> float:
        return self.total / len(self.durations) if self.durations else 0.0


class InferenceTimer:
    """The stage timer of an inference loop: named stages, timed per iteration, warm-up excluded.

    Stages ``iter``, ``data``, ``infer`` and ``post`` exist by default; others are created by
    ``add_timer`` or on first use (``timed("rpn")`` in model code, see :mod:`pet.utils.timers`).
    A stage is timed by ``with timer.stage("infer", wait=True):`` (``wait``: synchronise CUDA before
    it stops, so queued kernels are counted), or by ``tic(name)`` / ``toc(name)`` where a stage
    straddles a loop statement (the data fetch, the iteration). The first ``num_warmup``
    iterations (an iteration ends at ``toc("iter")``) are excluded from every stage.

    Configuration comes through the constructor (``logperiod``, ``num_warmup``, ``clock``: the
    time source, ``time.perf_counter`` by default, a fake one in tests) and, once the loop knows
    them, :meth:`configure` (the model's device and the images per iteration).
    :class:`pet.engine.hooks.TestHook` is the Pet-style hook over it.
    """

    DEFAULT_TIMERS = ("iter", "data", "infer", "post")

    def __init__(self, logperiod: int = 10, num_warmup: int = 5, *,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.logperiod = logperiod
        self.num_warmup = num_warmup
        self.cuda_sync = False
        self.ims_per_batch = 1
        self.device = "cpu"
        self.timers: dict[str, StageTimer] = {}
        self.num_iters_done = 0
        for name in self.DEFAULT_TIMERS:
            self.add_timer(name)

    def configure(self, device: torch.device, ims_per_batch: int) -> None:
        """The loop's device (CUDA: ``wait`` synchronises; the summary names the GPU) and images per iteration."""
        self.cuda_sync = device.type == "cuda"
        self.device = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        self.ims_per_batch = ims_per_batch

    # ----------------------------------------------------------------- timers
    def add_timer(self, name: str) -> StageTimer:
        """The timer ``name``, created if new."""
        if name not in self.timers:
            self.timers[name] = StageTimer(self.clock)
        return self.timers[name]

    def reset_timer(self, name: str | None = None) -> None:
        """Clear one timer, or every timer and the iteration count when ``name`` is None."""
        if name is None:
            for timer in self.timers.values():
                timer.reset()
            self.num_iters_done = 0
        else:
            self.timers[name].reset()

    @property
    def extra_timers(self) -> list[str]:
        """Names of the timers beyond the default four (added by the user or from model code), in creation order."""
        return [name for name in self.timers if name not in self.DEFAULT_TIMERS]

    def tic(self, name: str) -> None:
        self.add_timer(name).tic()

    def toc(self, name: str) -> float:
        elapsed = self.timers[name].toc(record=self.num_iters_done >= self.num_warmup)
        if name == "iter":
            self.num_iters_done += 1
        return elapsed

    @contextlib.contextmanager
    def stage(self, name: str, *, wait: bool = False) -> Iterator[None]:
        """Time the block as stage ``name`` (``wait``: synchronise CUDA before stopping); a block that raises
        is not recorded."""
        self.tic(name)
        yield
        if wait:
            self.wait()
        self.toc(name)

    def wait(self) -> None:
        """Block until queued CUDA work is done, so the next ``toc`` measures it."""
        if self.cuda_sync:
            torch.cuda.synchronize()

    # ----------------------------------------------------------------- reports
    def log_progress(self, batch: int, start: int, end: int, total: int, *, extras: bool = True,
                     suffix: str = "") -> None:
        """Log ``[Testing][range:a-b of N][i/n][T s = D s + I s + P s][eta: ...]`` after batch number ``batch``
        of the shard ``start``-``end`` of ``total`` images, every ``logperiod`` batches and at the last.

        Times are per image, averaged over the timed (non-warm-up) iterations. ``extras`` adds
        ``[name: X s]`` for each extra timer, before the ETA; ``suffix`` ends the line.
        """
        per_batch = self.ims_per_batch
        num_batches = -(-(end - start) // per_batch)
        if batch % self.logperiod and batch != num_batches:
            return
        per_image = {name: timer.average / per_batch for name, timer in self.timers.items()}
        eta = per_image["iter"] * max(end - start - batch * per_batch, 0)
        line = (
            f"[Testing][range:{start + 1}-{end} of {total}][{batch}/{num_batches}]"
            f"[{per_image['iter']:.3f}s = {per_image['data']:.3f}s + {per_image['infer']:.3f}s"
            f" + {per_image['post']:.3f}s]"
        )
        if extras:
            line += "".join(f"[{name}: {per_image[name]:.3f}s]" for name in self.extra_timers)
        logger.info(line + f"[eta: {datetime.timedelta(seconds=int(eta))}]" + suffix)

    def speed_summary(self) -> dict[str, Any]:
        """Per-image mean / p50 / p90 (ms) of every timer that ran, images/s, batch size and device."""
        summary: dict[str, Any] = {
            "ims_per_batch": self.ims_per_batch,
            "device": self.device,
            "num_warmup_iters": self.num_warmup,
            "timed_iters": len(self.timers["iter"].durations),
        }
        for name, timer in self.timers.items():
            if not timer.durations:
                continue
            ms = np.asarray(timer.durations) * 1000.0 / self.ims_per_batch
            summary[name] = {
                "mean_ms": float(ms.mean()),
                "p50_ms": float(np.percentile(ms, 50)),
                "p90_ms": float(np.percentile(ms, 90)),
            }
        iter_time = self.timers["iter"].average
        summary["images_per_second"] = self.ims_per_batch / iter_time if iter_time else 0.0
        return summary

    def log_summary(self) -> None:
        summary = self.speed_summary()
        timers = {name: v for name, v in summary.items() if isinstance(v, dict)}
        width = max(map(len, timers), default=0)
        rows = [
            f"{name:>{width}}: mean {v['mean_ms']:8.2f} ms  p50 {v['p50_ms']:8.2f} ms  p90 {v['p90_ms']:8.2f} ms"
            for name, v in timers.items()
        ]
        logger.info(
            f"Inference speed per image ({summary['timed_iters']} timed iterations after "
            f"{self.num_warmup} warm-up, batch {self.ims_per_batch}, {self.device}, "
            f"{summary['images_per_second']:.2f} images/s):\n" + "\n".join(rows)
        )
