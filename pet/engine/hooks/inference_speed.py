"""TestHook: Pet's test-time hook, the inference timer as Pet users know it.

The jobs live apart: :class:`pet.engine.inference_timer.InferenceTimer` times the stages,
:class:`pet.engine.inference.TestCallback` is the callback contract. TestHook is a TestCallback that
holds a timer and offers it with Pet's API (docs/design.md); a hook that only acts on results
(a visualiser, a results dumper) subclasses TestCallback. The module is named for what the hook
measures, not for the class (a ``test_*.py`` would read as a pytest file); TestHook opts out of
pytest's collection with ``__test__``.
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from pet.engine.inference import TestCallback
from pet.engine.inference_timer import InferenceTimer

__all__ = ["TestHook"]


class TestHook(TestCallback):
    """The inference-speed tracker: ``TestHook(cfg_filename=None, logperiod=10, num_warmup=5)``.

    Everything of its timer (``self.timer``, an :class:`~pet.engine.inference_timer.InferenceTimer`) is
    reachable on the hook: ``tic(name)``, ``toc(name)``, ``add_timer``, ``reset_timer``, ``wait()``
    (CUDA synchronize when the model is on CUDA), ``stage(name)``, ``timers``, ``speed_summary()``,
    and settings such as ``cuda_sync`` can be set on the hook. ``<name>_tic()`` / ``<name>_toc()``
    exist for every registered timer (``iter``, ``data``, ``infer``, ``post`` and those added).
    Warm-up iterations are excluded from every timer. The test callbacks ``before_test``,
    ``after_test_iter`` and ``after_test`` are no-ops to override.
    """

    __test__ = False  # not a pytest test class, despite the name

    def __init__(self, cfg_filename: str | None = None, logperiod: int = 10, num_warmup: int = 5, *,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.cfg_filename = cfg_filename
        self.timer = InferenceTimer(logperiod, num_warmup, clock=clock)

    def log_stats(self, cur_idx: int, start_ind: int, end_ind: int, total_num_images: int, ims_per_gpu: int = 1,
                  suffix: str | None = None, log_all: bool = False) -> None:
        """Pet's progress line (:meth:`InferenceTimer.log_progress`) for batch ``cur_idx``, ``ims_per_gpu`` images
        a batch, every ``logperiod`` batches; ``log_all`` adds the extra timers, ``suffix`` ends the line."""
        self.timer.ims_per_batch = ims_per_gpu
        self.timer.log_progress(cur_idx, start_ind, end_ind, total_num_images, extras=log_all, suffix=suffix or "")

    def __getattr__(self, name: str) -> Any:
        timer = self.__dict__.get("timer")
        if timer is None:
            raise AttributeError(name)
        stage, _, action = name.rpartition("_")
        if action in ("tic", "toc") and stage in timer.timers:
            return functools.partial(getattr(timer, action), stage)
        return getattr(timer, name)

    def __setattr__(self, name: str, value: Any) -> None:
        timer = self.__dict__.get("timer")
        if timer is not None and name in vars(timer):
            setattr(timer, name, value)
        else:
            super().__setattr__(name, value)
