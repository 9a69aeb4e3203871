"""The train loop: fetch a batch, run one :class:`~pet.engine.step.TrainStep`, call the hooks; repeat.

Reading guide: :meth:`Trainer.train` runs the loop of the mode (:mod:`pet.engine.loops`:
iteration or epoch mode), which calls :meth:`Trainer.run_steps`; :meth:`Trainer._run_step` is one
iteration. What a step does (forward, backward, AMP, optimizer) is in :mod:`pet.engine.step`; what
happens around it (schedules, logging, validation, checkpoints) is in hooks (:mod:`pet.engine.hooks`)
called at fixed mount points, in priority order; checkpoints are written and read by
``trainer.checkpointer`` (:mod:`pet.engine.checkpointer`).

One counter: ``trainer.iter == storage.iter`` at every mount point. Inside a step it is
the 1-based number of the running iteration; outside one, the number of iterations
completed (``start_iter`` before the first step, ``max_iter`` after the last).
"""
from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch
from fvcore.common.config import CfgNode

from pet.data import build_train_loader
from pet.data.workers import WORKER_DIED_EXIT_CODE, remedy
from pet.engine.build import build_train_hooks, prepare_model
from pet.engine.checkpointer import Checkpointer
from pet.engine.events import EventStorage
from pet.engine.hooks.base import HookList, TrainHook
from pet.engine.loops import TrainLoop, WorkerDiedAtFetch, build_loop
from pet.engine.models import default_model_builder, resolve_device, unwrap_model
from pet.engine.optim import build_lr_scheduler, build_optimizer
from pet.engine.precision import choose_precision
from pet.engine.step import TrainStep
from pet.utils import comm
from pet.utils.errors import ConfigError, TrainingInterrupted
from pet.utils.tensor import move_to_device

__all__ = ["Trainer"]

logger = logging.getLogger(__name__)


class Trainer:
    """Runs training for ``SOLVER.MAX_ITER`` iterations or ``SOLVER.MAX_EPOCHS`` epochs (``self.loop``).

    Anything not passed in is built from ``cfg``: the model (any ``nn.Module`` whose
    training forward returns a dict of losses) through the meta-architecture registry,
    the data loader through :mod:`pet.data`, the optimizer and LR schedule from
    ``SOLVER``. With ``default_hooks`` the hooks of :func:`pet.engine.build.build_train_hooks`
    are registered; add more with :meth:`register_hooks`. ``data_loader`` may be any
    re-iterable of batches: in iteration mode a finite one is cycled, ``set_epoch(k)`` on
    its sampler before pass ``k``. :meth:`train` resumes first when ``TRAIN.AUTO_RESUME``
    says so (unless :meth:`resume_or_load` was called).

    Attributes hooks may rely on: see :class:`pet.engine.hooks.TrainerLike`.
    """

    def __init__(self, cfg: CfgNode, *, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
                 data_loader: Iterable[Any] | None = None, default_hooks: bool = True) -> None:
        self.cfg = cfg
        self.output_dir = cfg.CKPT
        self.device = resolve_device(cfg.DEVICE)
        model = prepare_model(model if model is not None else default_model_builder()(cfg), cfg, self.device)
        self.model = _wrap_distributed(model, self.device)
        # Whether the loader is the config's (TRAIN.DATASETS) or the caller's: PreciseBN estimates on the caller's.
        self.data_loader_from_cfg = data_loader is None
        self.data_loader = data_loader if data_loader is not None else build_train_loader(cfg)
        self.loop: TrainLoop = build_loop(cfg, self.data_loader)
        self.max_iter, self.max_epochs, self.iters_per_epoch = (
            self.loop.max_iter, self.loop.max_epochs, self.loop.iters_per_epoch)
        self.optimizer = optimizer if optimizer is not None else build_optimizer(cfg, unwrap_model(self.model))
        self.scheduler = scheduler if scheduler is not None else build_lr_scheduler(cfg, self.optimizer, self.max_iter)
        precision = choose_precision(cfg.SOLVER.AMP.ENABLED, cfg.SOLVER.AMP.DTYPE, self.device, training=True)
        logger.info(f"Training precision: {precision}")
        self.train_step = TrainStep(self.model, self.optimizer, precision, clip_grad_norm=cfg.SOLVER.CLIP_GRAD_NORM,
                                    skip_nonfinite=cfg.SOLVER.SKIP_NONFINITE)
        self.storage = EventStorage(0)
        self.start_iter = self.epoch = 0
        self.stop_training = False
        self.last_step_seconds = self.last_data_seconds = 0.0
        self.hooks = HookList()
        self.checkpointer = Checkpointer(self)
        self._signals = _StopSignals()
        self._loaded = False  # resume_or_load ran (train() runs it otherwise, as TRAIN.AUTO_RESUME says)
        if default_hooks:
            self.register_hooks(build_train_hooks(cfg, self))

    @property
    def iter(self) -> int:
        """The one iteration counter, kept in ``storage.iter`` (see the module docstring)."""
        return self.storage.iter

    @iter.setter
    def iter(self, value: int) -> None:
        self.storage.iter = value

    def register_hook(self, hook: TrainHook, priority: int | str | None = None) -> None:
        """Insert ``hook`` by priority (its own, or ``priority``); equal priorities keep registration order."""
        self.hooks.add(hook, priority)

    def register_hooks(self, hooks: Iterable[TrainHook | None]) -> None:
        for hook in hooks:
            if hook is not None:
                self.register_hook(hook)

    def call_hooks(self, point: str, **kwargs: Any) -> None:
        """Call mount point ``point`` on every hook with ``trainer``, ``storage`` (and epoch info)."""
        self.hooks(point, trainer=self, storage=self.storage, **{**self.loop.hook_kwargs(self), **kwargs})

    def resume_or_load(self, resume: bool = True, *, unsafe: bool = False, weights_only: bool = False) -> None:
        """Resume from ``last_checkpoint`` when ``resume`` and one exists; else load ``TRAIN.WEIGHTS``.

        :meth:`train` calls it with ``resume=TRAIN.AUTO_RESUME`` unless it was called before, so the
        key means the same from Python as from tools/train_net.py. ``weights_only``: resume all but
        the optimizer's state (after changing the optimizer type).
        """
        self._loaded = True
        self.checkpointer.resume_or_load(resume, unsafe=unsafe, weights_only=weights_only)

    def train(self) -> None:
        """Run from ``start_iter`` to ``max_iter``; ``after_train`` runs even when a step fails."""
        if not self._loaded:
            self.resume_or_load(resume=self.cfg.TRAIN.AUTO_RESUME)
        logger.info(f"Hooks in call order:\n{self.hooks.order_table()}")
        logger.info(f"Starting training from iteration {self.start_iter} to {self.max_iter}")
        self.model.train()
        self.storage = EventStorage(self.start_iter)
        with self.storage, self._signals:
            try:
                self.call_hooks("before_train")
                try:
                    self.loop.run(self)
                except WorkerDiedAtFetch as death:
                    self._save_and_stop(str(death), WORKER_DIED_EXIT_CODE,
                                        advice=remedy(getattr(self.data_loader, "num_workers", None)))
            except BaseException:
                # The first error is the one to report: a hook failing in after_train
                # (a full disk, say) is logged, not raised over it.
                try:
                    self.call_hooks("after_train")
                except Exception:
                    logger.exception("after_train also failed while handling the error below")
                raise
            else:
                self.call_hooks("after_train")
            finally:
                if comm.is_main_process():
                    logger.info(f"Time spent in hooks:\n{self.hooks.cost_table()}")

    def run_steps(self, end: int) -> None:
        """Run iterations until ``iter`` reaches ``end`` or a hook sets ``stop_training`` (called by the loop)."""
        while self.iter < end and not self.stop_training:
            self._run_step()

    def _run_step(self) -> None:
        """One iteration: the counter moves to it, hooks around the step; a failure leaves it uncounted."""
        self.iter += 1
        try:
            self.call_hooks("before_step")
            start = time.perf_counter()
            batches = self.loop.next_batches(self.iter)
            if self.device.type != "cpu":
                batches = [move_to_device(batch, self.device) for batch in batches]
            self.last_data_seconds = time.perf_counter() - start
            result = self.train_step(batches, iteration=self.iter, data_seconds=self.last_data_seconds,
                                     stop_signal=self._signals.received)
            self.last_step_seconds = time.perf_counter() - start
            for name, value in result.metrics.items():  # already reduced over processes
                self.storage.put_scalar(name, value)
            if self.train_step.nonfinite_skipped:
                self.storage.put_scalar("nonfinite_skipped", self.train_step.nonfinite_skipped, smoothing_hint=False)
            self.call_hooks("after_step")
        except BaseException:
            self.iter -= 1
            raise
        # In one process a signal is known at once; across processes every one learns of a signal any
        # of them got from the step's one reduction, so all stop after the same step, with no extra collective.
        signum = result.stop_signal if comm.get_world_size() > 1 else self._signals.received
        if signum:
            self._save_and_stop(f"Training stopped by {signal.Signals(signum).name} after iteration {self.iter}",
                                128 + signum)

    def _save_and_stop(self, reason: str, exit_code: int, advice: str = "") -> None:
        """Save the iterations completed (:meth:`Checkpointer.save_for_stop`: through CheckpointHook's schedule
        when there is one, else ``model_iter{N}.pth`` in CKPT, so a stopped run can always resume) and raise
        :class:`TrainingInterrupted` with ``exit_code``: one line, the reason, the checkpoint, ``advice``."""
        path = self.checkpointer.save_for_stop()
        advice = f" If it happens again: {advice}." if advice else ""
        raise TrainingInterrupted(f"{reason}; checkpoint {path}. Run the same command to resume from it.{advice}",
                                  exit_code=exit_code)


class _StopSignals(contextlib.AbstractContextManager):
    """While entered (in the main thread), SIGTERM / SIGINT ask training to finish the current step, save a
    checkpoint and stop: ``received`` is the signal's number (0: none). A second one stops at once."""

    def __init__(self) -> None:
        self.received = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopSignals:
        self.received = 0
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _request_stop(self, signum: int, frame: Any) -> None:
        if self.received:
            raise KeyboardInterrupt
        self.received = signum
        logger.warning(f"Received {signal.Signals(signum).name}: stopping after the current iteration")


def _wrap_distributed(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model`` in DistributedDataParallel when more than one process trains (as is otherwise)."""
    if comm.get_world_size() == 1 or isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model
    if device.type != "cuda" and any(isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules()):
        raise ConfigError("SyncBN (MODEL.BACKBONE.NORM) needs CUDA devices: torch's SyncBatchNorm is GPU-only. "
                          "Use NORM BN (per-process statistics) for distributed CPU runs.")
    device_ids = [device.index] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
