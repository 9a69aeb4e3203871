"""Training and test hooks: the contract (TrainHook, Priority) and every built-in hook.

``build_train_hooks(cfg, trainer)`` assembles the default set from the config; hooks
named in ``HOOKS.CUSTOM`` (registry name or dotted path) are added with their priority.
"""
from __future__ import annotations

import os
from typing import Any

from fvcore.common.config import CfgNode

from pet.engine.events import CommonMetricPrinter, EventWriter, JSONWriter, TensorboardXWriter
from pet.engine.hooks.base import HOOKS, MOUNT_POINTS, HookDispatcher, Priority, TrainHook, get_priority
from pet.engine.hooks.checkpoint import CheckpointHook
from pet.engine.hooks.common import IterationTimer, LRScheduler, PeriodicWriter, PreciseBN, TrainingCurves
from pet.engine.hooks.test_hook import TestHook
from pet.utils import comm
from pet.utils.registry import Registry, build_from_spec

__all__ = [
    "HOOKS",
    "WRITERS",
    "MOUNT_POINTS",
    "Priority",
    "get_priority",
    "TrainHook",
    "TestHook",
    "HookDispatcher",
    "PeriodicWriter",
    "IterationTimer",
    "LRScheduler",
    "PreciseBN",
    "CheckpointHook",
    "TrainingCurves",
    "build_train_hooks",
    "build_writers",
    "build_custom_hooks",
]

WRITERS = Registry("event writer")
for _writer in (CommonMetricPrinter, JSONWriter, TensorboardXWriter):
    WRITERS.register(_writer)


def build_writers(cfg: CfgNode, max_iter: int, start_iter: int = 0) -> list[EventWriter]:
    """Terminal printer, metrics.json, TensorBoard (as configured) and ``TRAIN.WRITERS`` entries."""
    writers: list[EventWriter] = [CommonMetricPrinter(max_iter)]
    if cfg.TRAIN.SAVE_AS_JSON:
        writers.append(JSONWriter(os.path.join(cfg.CKPT, "metrics.json"), start_iter=start_iter))
    if cfg.TRAIN.USE_TENSORBOARD:
        writers.append(TensorboardXWriter(cfg.CKPT, start_iter=start_iter))
    for spec in cfg.TRAIN.WRITERS:
        writer = build_from_spec(WRITERS, spec, output_dir=cfg.CKPT)
        if not isinstance(writer, EventWriter):
            raise TypeError(f"TRAIN.WRITERS entry {dict(spec)} built {type(writer).__name__}, not an EventWriter")
        writers.append(writer)
    return writers


def build_custom_hooks(specs: list[dict[str, Any]], output_dir: str) -> list[TrainHook]:
    """Hooks from ``HOOKS.CUSTOM``-style entries ``{type, priority, <kwargs>}``."""
    hooks = []
    for spec in specs:
        spec = dict(spec)
        priority = spec.pop("priority", spec.pop("PRIORITY", None))
        hook = build_from_spec(HOOKS, spec, output_dir=output_dir)
        if priority is not None:
            hook.priority = get_priority(priority)
        hooks.append(hook)
    return hooks


def build_train_hooks(cfg: CfgNode, trainer: Any) -> list[TrainHook]:
    """The default hooks for ``cfg``. Only the main process writes logs and files."""
    hooks: list[TrainHook] = [IterationTimer(), LRScheduler()]
    if cfg.TEST.PRECISE_BN.ENABLED:
        hooks.append(PreciseBN(cfg.TEST.PRECISE_BN.PERIOD, cfg.TEST.PRECISE_BN.NUM_ITER))
    checkpoint = cfg.HOOKS.CHECKPOINT
    hooks.append(CheckpointHook(checkpoint.INTERVAL, checkpoint.SAVE_LAST, checkpoint.OUT_DIR))
    if comm.is_main_process():
        hooks.append(
            PeriodicWriter(lambda t: build_writers(cfg, t.max_iter, t.start_iter), period=cfg.DISPLAY_ITER)
        )
        if cfg.TRAIN.SAVE_AS_JSON:
            hooks.append(TrainingCurves(cfg.CKPT))
    hooks.extend(build_custom_hooks(cfg.HOOKS.CUSTOM, cfg.CKPT))
    return hooks

