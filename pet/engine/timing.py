"""Honest inference timing: per-stage timers (data / infer / post and any named extra) with warm-up.

:class:`InferenceTimer` is what the test loop (:func:`pet.engine.inference.inference_on_dataset`)
drives; :class:`pet.engine.hooks.TestHook` adds the test callbacks to it.
"""
from __future__ import annotations

import datetime
import functools
import logging
import time
from collections.abc import Callable
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
    """Inference-speed tracker with Pet's tic/toc API.

    Timers ``iter``, ``data``, ``infer`` and ``post`` exist by default; others are
    created by ``add_timer`` or on first ``tic``. Every timer ``name`` has the shortcuts
    ``name_tic()`` / ``name_toc()``. The first ``num_warmup`` iterations (an iteration
    ends at ``toc("iter")``) are excluded from every timer. ``wait()`` synchronises CUDA
    only when the model runs on a CUDA device, so CPU timing pays nothing for it.

    ``clock`` (keyword only) is the time source of every timer, ``time.perf_counter``
    by default; a test can pass a fake clock that advances only when it says so.
    """

    DEFAULT_TIMERS = ("iter", "data", "infer", "post")

    def __init__(self, cfg_filename: str | None = None, logperiod: int = 10, num_warmup: int = 5, *,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.cfg_filename = cfg_filename
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

    # ----------------------------------------------------------------- timers
    def add_timer(self, name: str) -> StageTimer:
        """The timer ``name``, created (with its ``name_tic`` / ``name_toc`` shortcuts) if new."""
        if name not in self.timers:
            self.timers[name] = StageTimer(self.clock)
            setattr(self, f"{name}_tic", functools.partial(self.tic, name))
            setattr(self, f"{name}_toc", functools.partial(self.toc, name))
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

    def wait(self) -> None:
        """Block until queued CUDA work is done, so the next ``toc`` measures it."""
        if self.cuda_sync:
            torch.cuda.synchronize()

    # ----------------------------------------------------------------- reports
    def log_stats(
        self,
        cur_idx: int,
        start_ind: int,
        end_ind: int,
        total_num_images: int,
        ims_per_gpu: int = 1,
        suffix: str | None = None,
        log_all: bool = False,
    ) -> None:
        """Log ``[Testing][range:a-b of N][i/n][T s = D s + I s + P s][eta: ...]`` every logperiod batches.

        Times are per image, averaged over the timed (non-warm-up) iterations. ``log_all``
        adds ``[name: X s]`` for each extra timer, before the ETA.
        """
        num_batches = -(-(end_ind - start_ind) // ims_per_gpu)
        if cur_idx % self.logperiod and cur_idx != num_batches:
            return
        per_image = {name: timer.average / ims_per_gpu for name, timer in self.timers.items()}
        eta = per_image["iter"] * max(end_ind - start_ind - cur_idx * ims_per_gpu, 0)
        line = (
            f"[Testing][range:{start_ind + 1}-{end_ind} of {total_num_images}][{cur_idx}/{num_batches}]"
            f"[{per_image['iter']:.3f}s = {per_image['data']:.3f}s + {per_image['infer']:.3f}s"
            f" + {per_image['post']:.3f}s]"
        )
        if log_all:
            line += "".join(f"[{name}: {per_image[name]:.3f}s]" for name in self.extra_timers)
        line += f"[eta: {datetime.timedelta(seconds=int(eta))}]"
        if suffix:
            line += suffix
        logger.info(line)

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
