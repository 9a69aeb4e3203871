"""Training and test hooks: the contract (TrainHook, Priority) and every built-in hook.

:func:`pet.engine.build.build_train_hooks` assembles the default set from the config, each
hook through its ``from_config(cfg, trainer)`` (None: not wanted); hooks named in
``HOOKS.CUSTOM`` (registry name or dotted path) are added with their priority.
Default order (lower priority value runs first; equal values keep this order):

    priority  hook                added when
    0         ProfilerHook        HOOKS.PROFILER.ENABLED (wraps the step only)
    10        IterationTimer      always
    30        LRScheduler         always
    40        PreciseBN           TEST.PRECISE_BN.ENABLED
    50        EMAHook             HOOKS.EMA.ENABLED (averages before validation uses it)
    50        SyncBuffersHook     HOOKS.SYNC_BUFFERS.ENABLED and more than one process
    50        EmptyCacheHook      HOOKS.EMPTY_CACHE.ENABLED
    60        EvalHook            TEST.EVAL_PERIOD > 0 and TEST.DATASETS
    70        EarlyStoppingHook   HOOKS.EARLY_STOPPING.ENABLED (acts in after_val)
    70        PeriodicWriter      main process (after EvalHook: writes include the metrics)
    90        CheckpointHook      always (late: a checkpoint holds the whole step)
    90        BestCheckpointHook  HOOKS.CHECKPOINT.SAVE_BEST
"""
from pet.engine.hooks.base import HOOKS, MOUNT_POINTS, HookList, Priority, TrainerLike, TrainHook, get_priority
from pet.engine.hooks.checkpoint import BestCheckpointHook, CheckpointHook
from pet.engine.hooks.early_stopping import EarlyStoppingHook
from pet.engine.hooks.ema import EMAHook
from pet.engine.hooks.evaluation import EvalHook, default_eval_function
from pet.engine.hooks.inference_speed import TestCallback, TestHook
from pet.engine.hooks.per_step import IterationTimer, LRScheduler, PeriodicWriter
from pet.engine.hooks.precise_bn import PreciseBN
from pet.engine.hooks.system import EmptyCacheHook, ProfilerHook, SyncBuffersHook

__all__ = [
    "HOOKS",
    "MOUNT_POINTS",
    "Priority",
    "get_priority",
    "TrainHook",
    "TrainerLike",
    "TestHook",
    "TestCallback",
    "HookList",
    "PeriodicWriter",
    "IterationTimer",
    "LRScheduler",
    "PreciseBN",
    "CheckpointHook",
    "BestCheckpointHook",
    "EvalHook",
    "EMAHook",
    "EarlyStoppingHook",
    "EmptyCacheHook",
    "SyncBuffersHook",
    "ProfilerHook",
    "default_eval_function",
]
