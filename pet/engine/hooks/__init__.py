"""Training and test hooks: the contract (TrainHook, Priority, HookList) and every built-in hook.

:func:`pet.engine.build.build_train_hooks` assembles the default set from the config, each hook
through its ``from_config(cfg, trainer)`` (None: not wanted), then the ``HOOKS.CUSTOM`` entries.
Each hook's priority is its class attribute (documented with the class); the trainer logs the
resulting order at the start of a run. Hooks are named ``...Hook``, except the four that Pet's and
detectron2's users know by name: IterationTimer, LRScheduler, PeriodicWriter and PreciseBN.
"""
from pet.engine.hooks.base import HOOKS, MOUNT_POINTS, HookList, Priority, TrainerLike, TrainHook, get_priority
from pet.engine.hooks.checkpoint import BestCheckpointHook, CheckpointHook
from pet.engine.hooks.early_stopping import EarlyStoppingHook
from pet.engine.hooks.ema import EMAHook
from pet.engine.hooks.evaluation import EvalHook, default_eval_function
from pet.engine.hooks.inference_speed import TestHook
from pet.engine.hooks.per_step import IterationTimer, LRScheduler, PeriodicWriter
from pet.engine.hooks.precise_bn import PreciseBN
from pet.engine.hooks.system import EmptyCacheHook, ProfilerHook, SyncBuffersHook
from pet.engine.inference import TestCallback

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
