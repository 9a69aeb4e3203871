"""Training and test hooks: the contract (TrainHook, Priority) and every built-in hook.

``build_train_hooks(cfg, trainer)`` assembles the default set from the config; hooks
named in ``HOOKS.CUSTOM`` (registry name or dotted path) are added with their priority.
Default order (lower priority value runs first; equal values keep this order):

    priority  hook               added when
    0         ProfilerHook       HOOKS.PROFILER.ENABLED (wraps the step only)
    10        IterationTimer     always
    30        LRScheduler        always
    40        PreciseBN          TEST.PRECISE_BN.ENABLED
    50        EMAHook            HOOKS.EMA.ENABLED (averages before validation uses it)
    50        SyncBuffersHook    HOOKS.SYNC_BUFFERS.ENABLED and more than one process
    50        EmptyCacheHook     HOOKS.EMPTY_CACHE.ENABLED
    60        EvalHook           TEST.EVAL_PERIOD > 0 and TEST.DATASETS
    70        EarlyStoppingHook  HOOKS.EARLY_STOPPING.ENABLED (acts in after_val)
    70        PeriodicWriter     main process (after EvalHook: writes include the metrics)
    90        CheckpointHook     always (last: a checkpoint holds the whole step)
    100       TrainingCurves     main process with TRAIN.SAVE_AS_JSON
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from fvcore.common.config import CfgNode

from pet.engine.events import WRITERS, CommonMetricPrinter, EventWriter, JSONWriter, TensorboardXWriter
from pet.engine.hooks.base import HOOKS, MOUNT_POINTS, HookDispatcher, Priority, TrainHook, get_priority
from pet.engine.hooks.checkpoint import CheckpointHook
from pet.engine.hooks.common import IterationTimer, LRScheduler, PeriodicWriter, PreciseBN, TrainingCurves
from pet.engine.hooks.early_stopping import EarlyStoppingHook
from pet.engine.hooks.ema import EMAHook
from pet.engine.hooks.evaluation import EvalHook, default_eval_function, metric_rule
from pet.engine.hooks.misc import EmptyCacheHook, ProfilerHook, SyncBuffersHook
from pet.engine.hooks.test_hook import TestHook
from pet.utils import comm
from pet.utils.errors import ConfigError
from pet.utils.registry import build_from_spec, resolve_spec

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
    "EvalHook",
    "EMAHook",
    "EarlyStoppingHook",
    "EmptyCacheHook",
    "SyncBuffersHook",
    "ProfilerHook",
    "default_eval_function",
    "metric_rule",
    "build_train_hooks",
    "build_writers",
    "writer_class",
    "build_custom_hooks",
]

def build_writers(cfg: CfgNode, max_iter: int, start_iter: int = 0) -> list[EventWriter]:
    """Terminal printer, metrics.json, TensorBoard (as configured) and ``TRAIN.WRITERS`` entries."""
    writers: list[EventWriter] = [CommonMetricPrinter(max_iter)]
    if cfg.TRAIN.SAVE_AS_JSON:
        writers.append(JSONWriter(os.path.join(cfg.CKPT, "metrics.json"), start_iter=start_iter))
    if cfg.TRAIN.USE_TENSORBOARD:
        writers.append(TensorboardXWriter(cfg.CKPT, start_iter=start_iter))
    for spec in cfg.TRAIN.WRITERS:
        writer_class(spec)
        writers.append(build_from_spec(WRITERS, spec, output_dir=cfg.CKPT))
    return writers


def writer_class(spec: Mapping[str, Any]) -> type[EventWriter]:
    """The EventWriter subclass a ``TRAIN.WRITERS`` entry names, imported but not built.

    Writers open their files when built, at the start of training; resolving the names
    first turns a typo or a dotted path that does not import into a ConfigError before
    anything is written.
    """
    cls = resolve_spec(WRITERS, spec)
    if not (isinstance(cls, type) and issubclass(cls, EventWriter)):
        raise ConfigError(f"TRAIN.WRITERS entry {dict(spec)} names {cls!r}, which is not an EventWriter subclass")
    return cls


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
    """The default hooks for ``cfg`` (order: see the module docstring). Only the main process writes."""
    hooks: list[TrainHook] = [IterationTimer(), LRScheduler()]
    if cfg.TEST.PRECISE_BN.ENABLED:  # on the caller's data when the caller gave the trainer a loader
        precise_bn = cfg.TEST.PRECISE_BN
        hooks.append(PreciseBN.from_config(cfg) if getattr(trainer, "data_loader_from_cfg", True)
                     else PreciseBN(precise_bn.PERIOD, precise_bn.NUM_ITER))
    h = cfg.HOOKS
    if h.EMA.ENABLED:
        hooks.append(EMAHook(h.EMA.MOMENTUM, h.EMA.INTERVAL, h.EMA.BEGIN_ITER, h.EMA.BEGIN_EPOCH, h.EMA.ANNEAL_ITERS))
    if h.SYNC_BUFFERS.ENABLED and comm.get_world_size() > 1:
        hooks.append(SyncBuffersHook())
    if h.EMPTY_CACHE.ENABLED:
        hooks.append(EmptyCacheHook(h.EMPTY_CACHE.AFTER_ITER, h.EMPTY_CACHE.AFTER_EPOCH))
    if cfg.TEST.EVAL_PERIOD > 0 and cfg.TEST.DATASETS:
        hooks.append(EvalHook(cfg.TEST.EVAL_PERIOD, default_eval_function(cfg)))
    if h.EARLY_STOPPING.ENABLED:
        e = h.EARLY_STOPPING
        hooks.append(EarlyStoppingHook(e.MONITOR, e.RULE, e.MIN_DELTA, e.PATIENCE, e.STOPPING_THRESHOLD,
                                       e.CHECK_FINITE, e.STRICT))
    c = h.CHECKPOINT
    hooks.append(CheckpointHook(
        c.INTERVAL, by_epoch=c.BY_EPOCH, save_optimizer=c.SAVE_OPTIMIZER, save_scheduler=c.SAVE_SCHEDULER,
        out_dir=c.OUT_DIR, max_keep=c.MAX_KEEP, save_last=c.SAVE_LAST, save_best=c.SAVE_BEST, rule=c.RULE,
        save_begin=c.SAVE_BEGIN, published_keys=c.PUBLISHED_KEYS,
    ))
    if h.PROFILER.ENABLED:
        p = h.PROFILER
        hooks.append(ProfilerHook(p.START_ITER, p.END_ITER, p.OUTPUT, cfg.CKPT))
    for spec in cfg.TRAIN.WRITERS:  # on every process: all must fail together, before anything is written
        writer_class(spec)
    if comm.is_main_process():
        hooks.append(
            PeriodicWriter(lambda t: build_writers(cfg, t.max_iter, t.start_iter), period=cfg.DISPLAY_ITER)
        )
        if cfg.TRAIN.SAVE_AS_JSON:
            hooks.append(TrainingCurves(cfg.CKPT))
    hooks.extend(build_custom_hooks(cfg.HOOKS.CUSTOM, cfg.CKPT))
    return hooks
