"""The train loop: fetch a batch, run one :class:`~pet.engine.step.TrainStep`, call the hooks; repeat.

Reading guide: :meth:`Trainer.train` is the whole loop and :meth:`Trainer._run_step` one
iteration. What a step does (forward, backward, AMP, optimizer) is in
:mod:`pet.engine.step`; what happens around it (schedules, logging, validation,
checkpoints) is in hooks (:mod:`pet.engine.hooks`) called at fixed mount points, in
priority order; checkpoints are written and read by ``trainer.checkpointer``
(:mod:`pet.engine.checkpointer`).

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
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from fvcore.common.config import CfgNode

from pet.data import build_train_loader
from pet.data.workers import WORKER_DIED_EXIT_CODE, fetch, remedy
from pet.engine.build import build_train_hooks, prepare_model
from pet.engine.checkpointer import Checkpointer
from pet.engine.events import EventStorage
from pet.engine.hooks.base import HookList, TrainHook
from pet.engine.models import build_model, resolve_device, unwrap_model
from pet.engine.optim import build_lr_scheduler, build_optimizer
from pet.engine.precision import choose_precision
from pet.engine.step import TrainStep
from pet.utils import comm
from pet.utils.errors import ConfigError, TrainingError, TrainingInterrupted
from pet.utils.tensor import move_to_device

__all__ = ["Trainer"]

logger = logging.getLogger(__name__)


class Trainer:
    """Runs training for ``SOLVER.MAX_ITER`` iterations or ``SOLVER.MAX_EPOCHS`` epochs.

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

    def __init__(
        self,
        cfg: CfgNode,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        data_loader: Iterable[Any] | None = None,
        default_hooks: bool = True,
    ) -> None:
        self.cfg = cfg
        self.output_dir = cfg.CKPT
        self.device = resolve_device(cfg.DEVICE)
        model = prepare_model(model if model is not None else build_model(cfg), cfg, self.device)
        self.model = _wrap_distributed(model, self.device)
        # Whether the loader is the config's (TRAIN.DATASETS) or the caller's: PreciseBN estimates on the caller's.
        self.data_loader_from_cfg = data_loader is None
        self.data_loader = data_loader if data_loader is not None else build_train_loader(cfg)

        self.max_epochs = cfg.SOLVER.MAX_EPOCHS
        self.accum_steps = cfg.SOLVER.ACCUM_STEPS  # batches per iteration
        self.iters_per_epoch = self._iters_per_epoch() if self.max_epochs > 0 else 0
        self.max_iter = self.max_epochs * self.iters_per_epoch if self.max_epochs > 0 else cfg.SOLVER.MAX_ITER
        self.optimizer = optimizer if optimizer is not None else build_optimizer(cfg, unwrap_model(self.model))
        self.scheduler = scheduler if scheduler is not None else build_lr_scheduler(cfg, self.optimizer, self.max_iter)

        precision = choose_precision(cfg.SOLVER.AMP.ENABLED, cfg.SOLVER.AMP.DTYPE, self.device, training=True)
        logger.info(f"Training precision: {precision}")
        self.train_step = TrainStep(self.model, self.optimizer, precision, clip_grad_norm=cfg.SOLVER.CLIP_GRAD_NORM,
                                    skip_nonfinite=cfg.SOLVER.SKIP_NONFINITE)

        self.storage = EventStorage(0)
        self.start_iter = 0
        self.epoch = 0
        self.stop_training = False
        self.last_step_seconds = 0.0
        self.last_data_seconds = 0.0
        self.hooks = HookList()
        self._loaded = False  # resume_or_load ran (train() runs it otherwise, as TRAIN.AUTO_RESUME says)
        self._signal_received = 0  # the signal number asking this process to stop (0: none)
        self._batches: Iterator[Any] = iter(())
        self.checkpointer = Checkpointer(self)
        if default_hooks:
            self.register_hooks(build_train_hooks(cfg, self))

    @property
    def iter(self) -> int:
        """The one iteration counter, kept in ``storage.iter`` (see the module docstring)."""
        return self.storage.iter

    @iter.setter
    def iter(self, value: int) -> None:
        self.storage.iter = value

    # ------------------------------------------------------------------ hooks
    def register_hook(self, hook: TrainHook, priority: int | str | None = None) -> None:
        """Insert ``hook`` by priority (its own, or ``priority``); equal priorities keep registration order."""
        self.hooks.add(hook, priority)

    def register_hooks(self, hooks: Iterable[TrainHook | None]) -> None:
        for hook in hooks:
            if hook is not None:
                self.register_hook(hook)

    def call_hooks(self, point: str, **kwargs: Any) -> None:
        """Call mount point ``point`` on every hook with ``trainer``, ``storage`` (and epoch info)."""
        if self.max_epochs > 0:
            kwargs.setdefault("epoch", self.epoch)
            kwargs.setdefault("max_epochs", self.max_epochs)
        self.hooks(point, trainer=self, storage=self.storage, **kwargs)

    # ------------------------------------------------------------------ checkpoints (pet.engine.checkpointer)
    def resume_or_load(self, resume: bool = True, *, unsafe: bool = False, weights_only: bool = False) -> None:
        """Resume from ``last_checkpoint`` when ``resume`` and one exists; else load ``TRAIN.WEIGHTS``.

        :meth:`train` calls it with ``resume=TRAIN.AUTO_RESUME`` unless it was called before, so the
        key means the same from Python as from tools/train_net.py. ``weights_only``: resume all but
        the optimizer's state (after changing the optimizer type).
        """
        self._loaded = True
        self.checkpointer.resume_or_load(resume, unsafe=unsafe, weights_only=weights_only)

    # ------------------------------------------------------------------ the loop
    def train(self) -> None:
        """Run from ``start_iter`` to ``max_iter``; ``after_train`` runs even when a step fails."""
        if not self._loaded:
            self.resume_or_load(resume=self.cfg.TRAIN.AUTO_RESUME)
        logger.info(f"Hooks in call order:\n{self.hooks.order_table()}")
        logger.info(f"Starting training from iteration {self.start_iter} to {self.max_iter}")
        self.model.train()
        self.storage = EventStorage(self.start_iter)
        with self.storage, self._stop_on_signals():
            try:
                self.call_hooks("before_train")
                try:
                    if self.max_epochs > 0:
                        self._train_epochs()
                    else:
                        self._train_iterations()
                except _WorkerDiedAtFetch as death:
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

    def _iters_per_epoch(self) -> int:
        """Iterations in one pass over the loader (a last group of fewer than ACCUM_STEPS batches is dropped)."""
        iterations = len(self.data_loader) // self.accum_steps  # type: ignore[arg-type]
        if iterations == 0:
            raise ConfigError(f"The training loader has {len(self.data_loader)} batches, fewer than "  # type: ignore[arg-type]
                              f"SOLVER.ACCUM_STEPS ({self.accum_steps}): an epoch would have no iteration.")
        return iterations

    def _train_iterations(self) -> None:
        self.call_hooks("before_epoch")
        self._batches = self._endless_batches(self.start_iter * self.accum_steps)
        while self.iter < self.max_iter and not self.stop_training:
            self._run_step()
        self.call_hooks("after_epoch")

    def _train_epochs(self) -> None:
        skip = self.start_iter - self.epoch * self.iters_per_epoch
        while self.epoch < self.max_epochs and not self.stop_training:
            self._set_sampler_epoch(self.epoch)
            self.call_hooks("before_epoch")
            self._batches = self._start_pass(skip * self.accum_steps)
            skip = 0
            end = (self.epoch + 1) * self.iters_per_epoch
            while self.iter < end and not self.stop_training:
                self._run_step()
            self.call_hooks("after_epoch")
            self.epoch += 1

    def _run_step(self) -> None:
        """One iteration: the counter moves to it, hooks around the step; a failure leaves it uncounted."""
        self.iter += 1
        try:
            self.call_hooks("before_step")
            start = time.perf_counter()
            batches = self._next_batches()
            if self.device.type != "cpu":
                batches = [move_to_device(batch, self.device) for batch in batches]
            self.last_data_seconds = time.perf_counter() - start
            result = self.train_step(batches, iteration=self.iter, data_seconds=self.last_data_seconds,
                                     stop_signal=self._signal_received)
            self.last_step_seconds = time.perf_counter() - start
            self._put_metrics(result.metrics)
            self.call_hooks("after_step")
        except BaseException:
            self.iter -= 1
            raise
        # In one process a signal is known at once; across processes every one learns of a signal any
        # of them got from the step's one reduction, so all stop after the same step, with no extra collective.
        signum = result.stop_signal if comm.get_world_size() > 1 else self._signal_received
        if signum:
            self._stop_for_signal(signum)

    def _put_metrics(self, metrics: dict[str, float]) -> None:
        """Store this step's metrics, already reduced over processes."""
        for name, value in metrics.items():
            self.storage.put_scalar(name, value)
        if self.train_step.nonfinite_skipped:
            self.storage.put_scalar("nonfinite_skipped", self.train_step.nonfinite_skipped, smoothing_hint=False)

    # ------------------------------------------------------------------ data
    def _next_batches(self) -> list[Any]:
        """This step's batches; raises when a data-loading worker of any process has died.

        The fetch is where a death is acted on (:func:`pet.data.workers.fetch`): before the forward
        pass, while weights, optimizer and counters are those of the last completed iteration, which
        :meth:`train` then saves. In a distributed run the processes agree here (one small all-reduce
        per step), so a process whose worker died does not leave the others waiting in the gradient
        all-reduce.
        """
        batches, death = [], None
        while len(batches) < self.accum_steps and death is None:
            batch, death = fetch(self._batches)
            batches.append(batch)
        if comm.get_world_size() > 1 and comm.any_process(death is not None):
            deaths = comm.all_gather_object(death)
            rank = next(r for r, d in enumerate(deaths) if d is not None)
            death = deaths[rank].replace("worker", f"worker of rank {rank}", 1)
        if death is not None:
            raise _WorkerDiedAtFetch(f"Training stopped after iteration {self.iter - 1}: a {death}")
        return batches

    def _set_sampler_epoch(self, epoch: int) -> None:
        for holder in (getattr(self.data_loader, "batch_sampler", None), getattr(self.data_loader, "sampler", None)):
            if hasattr(holder, "set_epoch"):
                holder.set_epoch(epoch)

    def _endless_batches(self, start_batch: int) -> Iterator[Any]:
        """Iteration mode's batch stream, after the first ``start_batch`` batches.

        Pet's loaders (``set_start_iter``) are infinite and skip by index arithmetic. Any other
        loader is cycled pass after pass, ``set_epoch(k)`` on its sampler before pass k, as
        MMEngine's iteration loop does; a resume drops the batches already consumed.
        """
        if hasattr(self.data_loader, "set_start_iter"):
            yield from self._start_pass(start_batch)
            return
        try:
            epoch, skip = divmod(start_batch, len(self.data_loader))  # type: ignore[arg-type]
        except (TypeError, ZeroDivisionError):  # no length (or 0, reported below): drop batch by batch
            epoch, skip = 0, start_batch
        while True:
            self._set_sampler_epoch(epoch)
            drawn = 0
            for batch in self.data_loader:
                drawn += 1
                if drawn > skip:
                    yield batch
            if drawn == 0:
                raise TrainingError(f"The training data loader ({type(self.data_loader).__name__}) yielded no batch; "
                                    "check that its dataset is not empty and its batch size fits it.")
            skip = max(0, skip - drawn)
            epoch += 1

    def _start_pass(self, skip_batches: int) -> Iterator[Any]:
        """An iterator over the loader that starts after ``skip_batches`` batches (resuming).

        A loader with ``set_start_iter`` skips by index arithmetic; any other loader has
        its first batches drawn and dropped.
        """
        if hasattr(self.data_loader, "set_start_iter"):
            self.data_loader.set_start_iter(skip_batches)
            return iter(self.data_loader)
        iterator = iter(self.data_loader)
        for _ in range(skip_batches):
            next(iterator)
        return iterator

    # ------------------------------------------------------------------ stopping on a signal
    @contextlib.contextmanager
    def _stop_on_signals(self) -> Iterator[None]:
        """SIGTERM / SIGINT finish the current step, save a checkpoint and stop (a second one stops at once)."""
        self._signal_received = 0
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def request_stop(signum: int, frame: Any) -> None:
            if self._signal_received:
                raise KeyboardInterrupt
            self._signal_received = signum
            logger.warning(f"Received {signal.Signals(signum).name}: stopping after the current iteration")

        previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _stop_for_signal(self, signum: int) -> None:
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


class _WorkerDiedAtFetch(Exception):
    """A data-loading worker died, seen at a training fetch: the state is that of the last completed iteration."""


def _wrap_distributed(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model`` in DistributedDataParallel when more than one process trains (as is otherwise)."""
    if comm.get_world_size() == 1 or isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model
    if device.type != "cuda" and any(isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules()):
        raise ConfigError("SyncBN (MODEL.BACKBONE.NORM) needs CUDA devices: torch's SyncBatchNorm is GPU-only. "
                          "Use NORM BN (per-process statistics) for distributed CPU runs.")
    device_ids = [device.index] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
