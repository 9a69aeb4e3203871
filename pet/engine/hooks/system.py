"""Hooks about the machine a run uses: EmptyCacheHook (CUDA memory), SyncBuffersHook (buffers across
processes), ProfilerHook (torch.profiler traces)."""
from __future__ import annotations

import logging
import os
from typing import Any

import torch
from fvcore.common.config import CfgNode

from pet.engine.hooks.base import HOOKS, Priority, TrainerLike, TrainHook
from pet.engine.models import unwrap_model
from pet.utils import comm
from pet.utils.errors import ConfigError

__all__ = ["EmptyCacheHook", "SyncBuffersHook", "ProfilerHook"]

logger = logging.getLogger(__name__)


@HOOKS.register()
class EmptyCacheHook(TrainHook):
    """Returns cached CUDA memory to the driver after validation, and after each epoch / iteration.

    Useful when another process shares the GPU or when validation's memory pattern
    fragments the cache; it costs speed (the next allocations are slower), so per
    iteration is off by default. A no-op without CUDA.
    """

    def __init__(self, after_iter: bool = False, after_epoch: bool = True) -> None:
        self.empty_after_iter = after_iter
        self.empty_after_epoch = after_epoch

    @classmethod
    def from_config(cls, cfg: CfgNode, trainer: TrainerLike) -> EmptyCacheHook | None:
        c = cfg.HOOKS.EMPTY_CACHE
        return cls(c.AFTER_ITER, c.AFTER_EPOCH) if c.ENABLED else None

    def after_step(self, **kwargs: Any) -> None:
        if self.empty_after_iter:
            _empty_cuda_cache()

    def after_epoch(self, **kwargs: Any) -> None:
        if self.empty_after_epoch:
            _empty_cuda_cache()

    def after_val(self, **kwargs: Any) -> None:
        _empty_cuda_cache()

    def __repr__(self) -> str:
        return f"EmptyCacheHook(after_iter={self.empty_after_iter}, after_epoch={self.empty_after_epoch})"


def _empty_cuda_cache() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@HOOKS.register()
class SyncBuffersHook(TrainHook):
    """Averages buffers (BatchNorm running statistics) across processes before validation and at epoch end.

    Each process's BN statistics only saw its own batches; without this, validation and
    checkpoints (written by the main process) use the main process's alone. A no-op in a
    single process. Runs at NORMAL priority: before EvalHook and CheckpointHook.
    """

    @classmethod
    def from_config(cls, cfg: CfgNode, trainer: TrainerLike) -> SyncBuffersHook | None:
        return cls() if cfg.HOOKS.SYNC_BUFFERS.ENABLED and comm.get_world_size() > 1 else None

    @torch.no_grad()
    def before_val(self, trainer: TrainerLike, **kwargs: Any) -> None:
        comm.all_reduce_buffers(unwrap_model(trainer.model))

    @torch.no_grad()
    def after_epoch(self, trainer: TrainerLike, **kwargs: Any) -> None:
        comm.all_reduce_buffers(unwrap_model(trainer.model))


@HOOKS.register()
class ProfilerHook(TrainHook):
    """Profiles iterations ``start_iter + 1`` to ``end_iter`` (numbers as ``trainer.iter``) with ``torch.profiler``.

    ``output="table"``: the operators sorted by self time (CUDA time on a GPU) go to
    ``output_dir/profiler.txt``; ``"tensorboard"``: a trace under ``output_dir/profiler/``
    for TensorBoard's profiler plugin. Runs first (HIGHEST), so the profile covers the
    step itself and no hook's ``after_step``. Only the main process writes.
    """

    priority = Priority.HIGHEST

    def __init__(
        self, start_iter: int = 10, end_iter: int = 15, output: str = "table", output_dir: str = ".",
        row_limit: int = 30,
    ) -> None:
        if end_iter <= start_iter or start_iter < 0:
            raise ConfigError(f"HOOKS.PROFILER needs 0 <= START_ITER < END_ITER, got {start_iter} and {end_iter}")
        if output not in ("table", "tensorboard"):
            raise ConfigError(f"HOOKS.PROFILER.OUTPUT must be 'table' or 'tensorboard', got {output!r}")
        self.start_iter, self.end_iter = start_iter, end_iter
        self.output, self.output_dir, self.row_limit = output, output_dir, row_limit
        self._profiler: torch.profiler.profile | None = None
        self._done = False
        self._on_cuda = False

    @classmethod
    def from_config(cls, cfg: CfgNode, trainer: TrainerLike) -> ProfilerHook | None:
        p = cfg.HOOKS.PROFILER
        return cls(p.START_ITER, p.END_ITER, p.OUTPUT, cfg.CKPT) if p.ENABLED else None

    def before_step(self, trainer: TrainerLike, **kwargs: Any) -> None:
        if self._done or self._profiler is not None or not self.start_iter < trainer.iter <= self.end_iter:
            return
        self._on_cuda = trainer.device.type == "cuda"
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self._on_cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities)
        self._profiler.start()

    def after_step(self, trainer: TrainerLike, **kwargs: Any) -> None:
        if self._profiler is not None and trainer.iter >= self.end_iter:
            self._finish(trainer.iter)

    def after_train(self, trainer: TrainerLike, **kwargs: Any) -> None:
        if self._profiler is not None:  # training ended inside the window
            self._finish(trainer.iter)

    def _finish(self, end: int) -> None:
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        self._done = True
        if not comm.is_main_process():
            return
        os.makedirs(self.output_dir, exist_ok=True)
        if self.output == "tensorboard":
            trace_dir = os.path.join(self.output_dir, "profiler")
            torch.profiler.tensorboard_trace_handler(trace_dir)(profiler)
            logger.info(f"Profiler trace of iterations {self.start_iter + 1}-{end} in {trace_dir}")
            return
        sort_by = "self_device_time_total" if self._on_cuda else "self_cpu_time_total"
        path = os.path.join(self.output_dir, "profiler.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write(f"Iterations {self.start_iter + 1}-{end}, sorted by {sort_by}\n")
            f.write(profiler.key_averages().table(sort_by=sort_by, row_limit=self.row_limit))
        logger.info(f"Profile of iterations {self.start_iter + 1}-{end} written to {path}")

    def __repr__(self) -> str:
        return f"ProfilerHook([{self.start_iter}, {self.end_iter}), {self.output})"
