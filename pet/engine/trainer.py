"""The train loop: one step is data -> forward -> backward -> optimizer; hooks do the rest.

Reading guide: :meth:`Trainer.train` is the whole loop; :meth:`Trainer.run_step` is one
iteration. Logging, schedules, evaluation and checkpoints live in hooks
(:mod:`pet.engine.hooks`) called at fixed mount points, in priority order.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from fvcore.common.config import CfgNode

from pet.engine.checkpoint import (
    atomic_save,
    get_rng_state,
    load_checkpoint,
    read_last_checkpoint,
    set_rng_state,
    unwrap_model,
    write_last_checkpoint,
)
from pet.engine.events import EventStorage
from pet.engine.hooks.base import HookDispatcher, TrainHook, get_priority
from pet.engine.hooks.checkpoint import CheckpointHook
from pet.engine.optim import build_lr_scheduler, build_optimizer
from pet.engine.precision import choose_precision
from pet.utils import comm
from pet.utils.compile import compile_submodules
from pet.utils.errors import ConfigError, TrainingError, TrainingInterrupted
from pet.utils.registry import META_ARCH_REGISTRY
from pet.utils.tensor import move_to_device
from pet.utils.weights import load_weights

__all__ = ["Trainer", "resolve_device", "call_model"]

logger = logging.getLogger(__name__)

# Reduced with the losses each step: the highest signal number any process received (0: none).
_STOP = "_stop_signal"


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available (this process's local GPU), else CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise TrainingError("DEVICE is 'cuda' but no CUDA device is available; use DEVICE auto or cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device(name)


def call_model(model: torch.nn.Module, batch: Any) -> Any:
    """``model(*batch)`` for a tuple/list batch, ``model(**batch)`` for a dict, else ``model(batch)``."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


class Trainer:
    """Runs training for ``SOLVER.MAX_ITER`` iterations or ``SOLVER.MAX_EPOCHS`` epochs.

    Anything not passed in is built from ``cfg``: the model (any ``nn.Module`` whose
    training forward returns a dict of losses) through the meta-architecture registry,
    the data loader through :mod:`pet.data`, the optimizer and LR schedule from
    ``SOLVER``. With ``default_hooks`` the hooks of :func:`build_train_hooks` are
    registered; add more with :meth:`register_hooks`.

    Attributes hooks may rely on: cfg, model, optimizer, scheduler, data_loader, storage,
    iter (0-based index of the current iteration; ``max_iter`` after training),
    start_iter, max_iter, epoch (0-based current epoch), max_epochs, iters_per_epoch,
    output_dir, device, hooks, stop_training (set it to end training cleanly),
    last_step_seconds and last_data_seconds (the previous step's cost).
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
        if model is None:
            model = META_ARCH_REGISTRY.get(cfg.MODEL.META_ARCHITECTURE)(cfg)
        model.to(self.device)
        compile_submodules(model, cfg.MODEL.COMPILE)
        if comm.get_world_size() > 1 and not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            if self.device.type != "cuda" and any(isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules()):
                raise ConfigError("SyncBN (MODEL.BACKBONE.NORM) needs CUDA devices: torch's SyncBatchNorm is GPU-only. "
                                  "Use NORM BN (per-process statistics) for distributed CPU runs.")
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            model = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
        self.model = model
        # Whether the loader is the config's (TRAIN.DATASETS) or the caller's: PreciseBN estimates on the caller's.
        self.data_loader_from_cfg = data_loader is None
        if data_loader is None:
            from pet.data import build_train_loader

            data_loader = build_train_loader(cfg)
        self.data_loader = data_loader

        self.max_epochs = cfg.SOLVER.MAX_EPOCHS
        if self.max_epochs > 0:
            self.iters_per_epoch = len(data_loader)  # type: ignore[arg-type]
            self.max_iter = self.max_epochs * self.iters_per_epoch
        else:
            self.iters_per_epoch = 0
            self.max_iter = cfg.SOLVER.MAX_ITER
        self.optimizer = optimizer if optimizer is not None else build_optimizer(cfg, unwrap_model(model))
        self.scheduler = scheduler if scheduler is not None else build_lr_scheduler(cfg, self.optimizer, self.max_iter)

        self.precision = choose_precision(cfg.SOLVER.AMP.ENABLED, cfg.SOLVER.AMP.DTYPE, self.device, training=True)
        logger.info(f"Training precision: {self.precision}")
        self.grad_scaler = torch.amp.GradScaler("cuda") if self.precision.grad_scaler else None

        self.iter = self.start_iter = 0
        self.epoch = 0
        self._loaded = False  # resume_or_load ran (train() runs it otherwise, as TRAIN.AUTO_RESUME says)
        self.stop_training = False
        self._stop_signal: int | None = None
        self._stop_signal_any_rank = 0
        self.nonfinite_skipped = 0
        self.last_step_seconds = 0.0
        self.last_data_seconds = 0.0
        self.storage: EventStorage | None = None
        self.hooks: list[TrainHook] = []
        self._hook_priorities: list[int] = []
        self._hooks_in_registration_order: list[TrainHook] = []
        self._dispatch = HookDispatcher([])
        if default_hooks:
            from pet.engine.hooks import build_train_hooks

            self.register_hooks(build_train_hooks(cfg, self))

    # ------------------------------------------------------------------ hooks
    def register_hook(self, hook: TrainHook, priority: int | str | None = None) -> None:
        """Insert ``hook`` by priority (its own, or ``priority``); equal priorities keep registration order."""
        value = get_priority(priority if priority is not None else hook.priority)
        if priority is not None:
            hook.priority = value
        position = sum(1 for p in self._hook_priorities if p <= value)
        self.hooks.insert(position, hook)
        self._hook_priorities.insert(position, value)
        self._hooks_in_registration_order.append(hook)
        self._dispatch = HookDispatcher(self.hooks)

    def register_hooks(self, hooks: Iterable[TrainHook | None]) -> None:
        for hook in hooks:
            if hook is not None:
                self.register_hook(hook)

    def call_hooks(self, point: str, **kwargs: Any) -> None:
        """Call mount point ``point`` on every hook with ``trainer``, ``storage`` (and epoch info)."""
        if self.max_epochs > 0:
            kwargs.setdefault("epoch", self.epoch)
            kwargs.setdefault("max_epochs", self.max_epochs)
        self._dispatch(point, trainer=self, storage=self.storage, **kwargs)

    def hook_order_table(self) -> str:
        from pet.utils.table import format_table

        return format_table(("priority", "hook"), [(p, repr(h)) for p, h in zip(self._hook_priorities, self.hooks)])

    @property
    def completed_iters(self) -> int:
        """Iterations completed so far (``storage.iter`` once training runs)."""
        return self.storage.iter if self.storage is not None else self.iter

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_state(self) -> dict[str, Any]:
        """Everything needed to resume exactly: weights, optimizer, schedule, counters, RNG, hook state."""
        state: dict[str, Any] = {
            "model": unwrap_model(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "iter": self.completed_iters,
            "epoch": self.epoch,
            "rng": get_rng_state(),
            "hooks": {},
        }
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        for key, hook in self._stateful_hooks():
            state["hooks"][key] = hook.state_dict()
        return state

    def _stateful_hooks(self) -> list[tuple[str, TrainHook]]:
        """``(key, hook)`` for each hook with a ``state_dict``: its class name, ``Name.1``, ... for repeats.

        Keys follow registration order, not priority, so changing one hook's priority
        does not swap the states of two hooks of the same class; the first hook of a
        class keeps the plain name, so checkpoints from before repeats were keyed load.
        """
        seen: dict[str, int] = {}
        keyed = []
        for hook in self._hooks_in_registration_order:
            if hasattr(hook, "state_dict"):
                name = type(hook).__name__
                repeat = seen.get(name, 0)
                seen[name] = repeat + 1
                keyed.append((f"{name}.{repeat}" if repeat else name, hook))
        return keyed

    def save_checkpoint(self, filename: str, *, state: dict[str, Any] | None = None, update_last: bool = True,
                        save_dir: str | None = None) -> str:
        """Write ``filename`` atomically (main process only); point ``last_checkpoint`` at it."""
        save_dir = save_dir or self.output_dir
        path = os.path.join(save_dir, filename)
        if not comm.is_main_process():
            return path
        state = state if state is not None else self.checkpoint_state()
        self.call_hooks("before_save_checkpoint", checkpoint=state)
        atomic_save(state, path)
        if update_last:
            write_last_checkpoint(save_dir, filename)
        logger.info(f"Saved checkpoint {path}")
        return path

    def resume_or_load(self, resume: bool = True, *, unsafe: bool = False) -> None:
        """Resume from ``last_checkpoint`` when ``resume`` and one exists; else load ``TRAIN.WEIGHTS``.

        :meth:`train` calls it with ``resume=TRAIN.AUTO_RESUME`` unless it was called before, so the
        key means the same from Python as from tools/train_net.py.
        """
        self._loaded = True
        last = read_last_checkpoint(self.output_dir) if resume else None
        if last is not None:
            self.load_resume_state(load_checkpoint(last, unsafe=unsafe))
            logger.info(f"Resumed from {last} at iteration {self.start_iter}")
        elif self.cfg.TRAIN.WEIGHTS:
            load_weights(self.model, self.cfg.TRAIN.WEIGHTS, unsafe=unsafe)
            logger.info(f"Initialised from {self.cfg.TRAIN.WEIGHTS} (not a resume: training starts at iteration 0)")

    def load_resume_state(self, state: dict[str, Any]) -> None:
        # With EMAHook, "model" holds the averaged weights (what test and deployment use)
        # and "model_raw" the ones training continues from.
        unwrap_model(self.model).load_state_dict(state.get("model_raw", state["model"]))
        if state.get("optimizer"):
            self.optimizer.load_state_dict(state["optimizer"])
        if state.get("scheduler") and self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if state.get("grad_scaler") and self.grad_scaler is not None:
            self.grad_scaler.load_state_dict(state["grad_scaler"])
        self.start_iter = self.iter = int(state["iter"])
        self.epoch = self.start_iter // self.iters_per_epoch if self.iters_per_epoch else 0
        if "rng" in state:
            set_rng_state(state["rng"])
        hook_states = state.get("hooks", {})
        for key, hook in self._stateful_hooks():
            if hook_states.get(key) is not None and hasattr(hook, "load_state_dict"):
                hook.load_state_dict(hook_states[key])
        self.call_hooks("after_load_checkpoint", checkpoint=state)

    # ------------------------------------------------------------------ the loop
    def train(self) -> None:
        """Run from ``start_iter`` to ``max_iter``; ``after_train`` runs even when a step fails."""
        if not self._loaded:
            self.resume_or_load(resume=self.cfg.TRAIN.AUTO_RESUME)
        logger.info(f"Hooks in call order:\n{self.hook_order_table()}")
        logger.info(f"Starting training from iteration {self.start_iter} to {self.max_iter}")
        self.model.train()
        with EventStorage(self.start_iter) as self.storage, self._stop_on_signals():
            try:
                self.call_hooks("before_train")
                if self.max_epochs > 0:
                    self._train_epochs()
                else:
                    self._train_iterations()
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
                    logger.info(f"Time spent in hooks:\n{self._dispatch.cost_table()}")

    def _train_iterations(self) -> None:
        self.call_hooks("before_epoch")
        self._data_iter = self._endless_batches(self.start_iter)
        while self.iter < self.max_iter and not self.stop_training:
            self._step()
        self.call_hooks("after_epoch")

    def _train_epochs(self) -> None:
        skip = self.start_iter - self.epoch * self.iters_per_epoch
        while self.epoch < self.max_epochs and not self.stop_training:
            self._set_sampler_epoch(self.epoch)
            self.call_hooks("before_epoch")
            self._data_iter = self._start_pass(skip)
            skip = 0
            end = (self.epoch + 1) * self.iters_per_epoch
            while self.iter < end and not self.stop_training:
                self._step()
            self.call_hooks("after_epoch")
            self.epoch += 1

    def _set_sampler_epoch(self, epoch: int) -> None:
        for holder in (getattr(self.data_loader, "batch_sampler", None), getattr(self.data_loader, "sampler", None)):
            if hasattr(holder, "set_epoch"):
                holder.set_epoch(epoch)

    def _endless_batches(self, start_iter: int) -> Iterator[Any]:
        """Iteration mode's batch stream from iteration ``start_iter`` on.

        Pet's loaders (``set_start_iter``) are infinite and skip by index arithmetic. Any other
        loader is cycled pass after pass, ``set_epoch(k)`` on its sampler before pass k, as
        MMEngine's iteration loop does; a resume drops the batches already consumed.
        """
        if hasattr(self.data_loader, "set_start_iter"):
            yield from self._start_pass(start_iter)
            return
        try:
            epoch, skip = divmod(start_iter, len(self.data_loader))  # type: ignore[arg-type]
        except (TypeError, ZeroDivisionError):  # no length (or 0, reported below): drop batch by batch
            epoch, skip = 0, start_iter
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

    def _step(self) -> None:
        self.storage.iter = self.iter + 1
        self.call_hooks("before_step")
        self.run_step()
        self.call_hooks("after_step")
        self.iter += 1
        # In a single process the signal is known at once; across processes, every rank learns it from
        # the step's one reduction (see run_step), so all stop after the same step with no extra collective.
        signum = self._stop_signal if comm.get_world_size() == 1 else self._stop_signal_any_rank
        if signum:
            self._stop_for_signal(signum)

    @contextlib.contextmanager
    def _stop_on_signals(self) -> Iterator[None]:
        """SIGTERM / SIGINT finish the current step, save a checkpoint and stop (a second one stops at once)."""
        self._stop_signal = None
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def request_stop(signum: int, frame: Any) -> None:
            if self._stop_signal is not None:
                raise KeyboardInterrupt
            self._stop_signal = signum
            logger.warning(f"Received {signal.Signals(signum).name}: stopping after the current iteration")

        previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _stop_for_signal(self, signum: int) -> None:
        # Through the CheckpointHook when there is one: its directory, its kept list and MAX_KEEP.
        checkpointer = next((hook for hook in self.hooks if isinstance(hook, CheckpointHook)), None)
        if checkpointer is not None:
            path = checkpointer.save_now(self)
        else:
            path = self.save_checkpoint(f"model_iter{self.completed_iters}.pth")
        name = signal.Signals(signum).name
        raise TrainingInterrupted(
            f"Training stopped by {name} after iteration {self.completed_iters}; checkpoint {path}. "
            "Run the same command to resume from it.",
            exit_code=128 + signum,
        )

    def run_step(self) -> None:
        """One iteration: fetch a batch, forward, check the loss is finite, backward, step.

        The loss terms are averaged over processes (data time: the slowest) before the
        finite check, so every process takes the same decision: one raising or skipping
        while the others wait in backward's all-reduce would hang a distributed run. The
        same reduction tells every process whether any of them was asked to stop (SIGTERM).
        """
        start = time.perf_counter()
        batch = next(self._data_iter)
        if self.device.type != "cpu":
            batch = move_to_device(batch, self.device)
        data_seconds = time.perf_counter() - start

        with self.precision.autocast():
            loss_dict = call_model(self.model, batch)
        if not isinstance(loss_dict, dict) or not loss_dict:
            raise TrainingError(
                f"The model's training forward must return a non-empty dict of losses, got {type(loss_dict).__name__}"
            )
        terms = list(loss_dict.values())
        losses = terms[0]
        for term in terms[1:]:
            losses = losses + term
        # One device sync for all terms (item() per term would sync once each on CUDA).
        values = [t.detach().item() for t in terms] if len(terms) == 1 or self.device.type == "cpu" else (
            torch.stack([t.detach().float() for t in terms]).tolist())
        local = dict(zip(loss_dict, values), total_loss=sum(values), data_time=data_seconds)
        # The one reduction of this step; _STOP carries the signal a rank received (0: none).
        reduced = comm.reduce_scalars({**local, _STOP: float(self._stop_signal or 0)}, maximum=("data_time", _STOP))
        self._stop_signal_any_rank = int(reduced[_STOP])
        metrics = {name: reduced[name] for name in local}  # in the model's order, for the log
        loss_values = {name: metrics[name] for name in loss_dict}

        if math.isfinite(metrics["total_loss"]):
            self.optimizer.zero_grad(set_to_none=True)
            if self.grad_scaler is not None:
                self.grad_scaler.scale(losses).backward()
                self.grad_scaler.unscale_(self.optimizer)
                self._clip_gradients()
                self.grad_scaler.step(self.optimizer)
                self.grad_scaler.update()
            else:
                losses.backward()
                self._clip_gradients()
                self.optimizer.step()
        else:
            self._on_nonfinite(loss_values)

        self.last_data_seconds = data_seconds
        self.last_step_seconds = time.perf_counter() - start
        self._put_metrics(metrics)

    def _clip_gradients(self) -> None:
        if self.cfg.SOLVER.CLIP_GRAD_NORM > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.SOLVER.CLIP_GRAD_NORM)

    def _on_nonfinite(self, loss_values: dict[str, float]) -> None:
        bad = ", ".join(f"{k}={v}" for k, v in loss_values.items() if not math.isfinite(v))
        if self.cfg.SOLVER.SKIP_NONFINITE:
            self.nonfinite_skipped += 1
            logger.warning(
                f"Non-finite loss at iteration {self.iter + 1} ({bad}); step skipped "
                f"({self.nonfinite_skipped} skipped so far)"
            )
            return
        raise TrainingError(
            f"Non-finite loss at iteration {self.iter + 1}: {bad}. The last good checkpoint is kept in "
            f"{self.output_dir}. Lower SOLVER.BASE_LR, raise SOLVER.WARMUP_ITERS or set SOLVER.CLIP_GRAD_NORM; "
            "SOLVER.SKIP_NONFINITE True skips such steps instead."
        )

    def _put_metrics(self, metrics: dict[str, float]) -> None:
        """Store this step's metrics, already reduced over processes."""
        storage = self.storage
        for name, value in metrics.items():
            storage.put_scalar(name, value)
        if self.nonfinite_skipped:
            storage.put_scalar("nonfinite_skipped", self.nonfinite_skipped, smoothing_hint=False)
