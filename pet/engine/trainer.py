"""The Trainer: builds and holds what training needs; its loop (:mod:`pet.engine.loops`) runs the iterations.

Reading guide: :meth:`Trainer.__init__` builds (or takes) the model, data loader, loop, optimizer, LR
schedule, :class:`~pet.engine.step.TrainStep`, event storage, hooks and checkpointer. :meth:`Trainer.train`
resumes and hands itself to ``self.loop.run``, which owns the iteration: fetch, step, hook calls, stop
checks. What a step does (forward, backward, AMP, optimizer) is in :mod:`pet.engine.step`; what
happens around it (schedules, logging, validation, checkpoints) is in hooks (:mod:`pet.engine.hooks`)
called by the loop at fixed mount points, in priority order; checkpoints are written and read by
``trainer.checkpointer`` (:mod:`pet.checkpoint`).

One counter: ``trainer.iter == storage.iter`` at every mount point. Inside a step it is
the 1-based number of the running iteration; outside one, the number of iterations
completed (``start_iter`` before the first step, ``max_iter`` after the last).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from fvcore.common.config import CfgNode

from pet.checkpoint import Checkpointer, run_schedule
from pet.data import build_train_loader
from pet.data.categories import dataset_label_space
from pet.data.synthetic import synthetic_batch
from pet.engine.build import build_train_hooks
from pet.engine.events import EventStorage
from pet.engine.hooks.base import HookList, TrainHook
from pet.engine.loops import TrainLoop, build_loop
from pet.engine.models import default_model_builder, model_keypoint_count, prepare_model, resolve_device, unwrap_model
from pet.engine.optim import build_lr_scheduler, build_optimizer
from pet.engine.precision import choose_precision
from pet.engine.speed_probe import SpeedProbe, model_probe
from pet.engine.step import TrainStep
from pet.utils import comm
from pet.utils.errors import ConfigError
from pet.utils.rng import get_rng_state, set_rng_state

__all__ = ["Trainer"]

logger = logging.getLogger(__name__)


class Trainer:
    """Builds and holds a training run of ``SOLVER.MAX_ITER`` iterations or ``SOLVER.MAX_EPOCHS`` epochs;
    ``self.loop`` (:class:`pet.engine.loops.IterationLoop` or :class:`~pet.engine.loops.EpochLoop`) runs it.

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
        precision = choose_precision(cfg.SOLVER.AMP.ENABLED, cfg.SOLVER.AMP.DTYPE, self.device, training=True,
                                     probe=self._probe)
        logger.info(f"Training precision: {precision}")
        self.train_step = TrainStep(self.model, self.optimizer, precision, clip_grad_norm=cfg.SOLVER.CLIP_GRAD_NORM,
                                    skip_nonfinite=cfg.SOLVER.SKIP_NONFINITE)
        self.storage = EventStorage(0)
        self.start_iter = self.epoch = 0
        self.stop_training = False
        self.last_step_seconds = self.last_data_seconds = 0.0
        self.hooks = HookList()
        label_space = dataset_label_space(getattr(self.data_loader, "dataset", None))
        self.checkpointer = Checkpointer(
            self.model, self.output_dir, schedule=run_schedule(cfg, self.max_iter), precision=precision.name,
            label_space=label_space.to_list() if label_space is not None else None,
            optimizer=self.optimizer, scheduler=self.scheduler, grad_scaler=self.train_step.grad_scaler,
            hooks=self.hooks)
        self._loaded = False  # resume_or_load ran (train() runs it otherwise, as TRAIN.AUTO_RESUME says)
        if default_hooks:
            self.register_hooks(build_train_hooks(cfg, self))

    def _probe(self) -> SpeedProbe | None:
        """A training step to time (see :mod:`pet.engine.speed_probe`) on a generated batch shaped as the config's
        loader shapes them, or on the first batch of the caller's loader (the random generators restored; None
        for an empty loader, which the loop then reports)."""
        if self.data_loader_from_cfg:
            keypoints = model_keypoint_count(self.model, self.cfg)
            batch = synthetic_batch(self.cfg, training=True, num_keypoints=keypoints)
        else:
            rng = get_rng_state()
            try:
                batch = next(iter(self.data_loader), None)
            finally:
                set_rng_state(rng)
        return None if batch is None else model_probe(self.model, batch, training=True)

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
        """Call mount point ``point`` on every hook as the loop does (EvalHook's ``before_val`` / ``after_val``, a
        resume's ``after_load_checkpoint``)."""
        self.loop.call_hooks(self, point, **kwargs)

    def resume_or_load(self, resume: bool = True, *, unsafe: bool = False, weights_only: bool = False) -> None:
        """Resume from ``last_checkpoint`` when ``resume`` and one exists; else load ``TRAIN.WEIGHTS``.

        :meth:`train` calls it with ``resume=TRAIN.AUTO_RESUME`` unless it was called before, so the
        key means the same from Python as from tools/train_net.py. ``weights_only``: resume all but
        the optimizer's state (after changing the optimizer type).
        """
        self._loaded = True
        state = self.checkpointer.resume_or_load(resume, self.cfg.TRAIN.WEIGHTS, unsafe=unsafe,
                                                 weights_only=weights_only)
        if state is not None:  # the loader position, then the hooks read the checkpoint
            self.start_iter = self.iter = int(state["iter"])
            self.epoch = self.start_iter // self.iters_per_epoch if self.iters_per_epoch else 0
            self.call_hooks("after_load_checkpoint", checkpoint=state)

    def train(self) -> None:
        """Resume or load first (as ``TRAIN.AUTO_RESUME`` says, unless :meth:`resume_or_load` ran), then run the
        loop from ``start_iter`` to ``max_iter`` (:meth:`pet.engine.loops.TrainLoop.run`)."""
        if not self._loaded:
            self.resume_or_load(resume=self.cfg.TRAIN.AUTO_RESUME)
        logger.info(f"Hooks in call order:\n{self.hooks.order_table()}")
        logger.info(f"Starting training from iteration {self.start_iter} to {self.max_iter}")
        self.loop.run(self)


def _wrap_distributed(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model`` in DistributedDataParallel when more than one process trains (as is otherwise)."""
    if comm.get_world_size() == 1 or isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model
    if device.type != "cuda" and any(isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules()):
        raise ConfigError("SyncBN (MODEL.BACKBONE.NORM) needs CUDA devices: torch's SyncBatchNorm is GPU-only. "
                          "Use NORM BN (per-process statistics) for distributed CPU runs.")
    device_ids = [device.index] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
