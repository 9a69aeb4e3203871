"""Everything set up from the config before a run: the model's placement, the test model, the hooks,
the test callbacks.

:class:`pet.engine.trainer.Trainer` builds what it is not given through these functions, and so do
tools/train_net.py, tools/test_net.py and :class:`pet.predict.Predictor`, so a config key means the
same on every path.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from fvcore.common.config import CfgNode

from pet.checkpoint import load_weights
from pet.config import default_weights
from pet.engine.events import writer_class
from pet.engine.hooks import (
    HOOKS,
    BestCheckpointHook,
    CheckpointHook,
    EarlyStoppingHook,
    EMAHook,
    EmptyCacheHook,
    EvalHook,
    IterationTimer,
    LRScheduler,
    PeriodicWriter,
    PreciseBN,
    ProfilerHook,
    SyncBuffersHook,
    TestCallback,
    TestHook,
    TrainerLike,
    TrainHook,
    get_priority,
)
from pet.engine.models import default_model_builder, prepare_model
from pet.utils import comm
from pet.utils.errors import ConfigError
from pet.utils.model_summary import log_model_summary
from pet.utils.registry import build_from_spec

__all__ = [
    "DEFAULT_TRAIN_HOOKS",
    "build_test_model",
    "build_train_hooks",
    "build_custom_hooks",
    "build_test_hooks",
]

# The built-in hooks in registration order. Kept as one list, not derived from registration: equal
# priorities run in this order (EarlyStoppingHook before PeriodicWriter, CheckpointHook before
# BestCheckpointHook), which is behaviour, and import order should not decide it. A hook's settings
# stay in pet/config/defaults.py, which docs/design.md makes the one place listing every key, commented;
# a user's own hook declares its keys next to it with ``add_config`` (docs/extending.md).
DEFAULT_TRAIN_HOOKS: tuple[type[TrainHook], ...] = (
    IterationTimer,
    LRScheduler,
    PreciseBN,
    EMAHook,
    SyncBuffersHook,
    EmptyCacheHook,
    EvalHook,
    EarlyStoppingHook,
    CheckpointHook,
    BestCheckpointHook,
    ProfilerHook,
    PeriodicWriter,
)


def build_test_model(cfg: CfgNode, *, weights: str = "", unsafe: bool = False,
                     checkpoint: Any = None) -> torch.nn.Module:
    """The model of ``cfg`` with ``weights`` (default: :func:`pet.config.default_weights`) loaded,
    on ``DEVICE``, as tools/test_net.py evaluates it; ``checkpoint``: the file's contents when the caller
    has read them already (:func:`pet.checkpoint.load_checkpoint`), so the file is read once.

    Weights that leave part of the model at its initial values are a :class:`ConfigError` naming the part,
    unless ``TEST.ALLOW_RANDOM_WEIGHTS`` (:func:`pet.checkpoint.load_weights` with ``for_inference``)."""
    model = prepare_model(default_model_builder()(cfg), cfg)
    load_weights(model, weights or default_weights(cfg), unsafe=unsafe, for_inference=True,
                 allow_random=cfg.TEST.ALLOW_RANDOM_WEIGHTS, checkpoint=checkpoint)
    if comm.is_main_process():
        log_model_summary(model, cfg)
    return model


def build_train_hooks(cfg: CfgNode, trainer: TrainerLike) -> list[TrainHook]:
    """The default hooks for ``cfg``, each from its ``from_config``, then ``HOOKS.CUSTOM``.

    ``TRAIN.WRITERS`` names are resolved here on every process, so a typo fails all of
    them together, before anything is written.
    """
    for spec in cfg.TRAIN.WRITERS:
        writer_class(spec)
    hooks = [hook_class.from_config(cfg, trainer) for hook_class in DEFAULT_TRAIN_HOOKS]
    return [hook for hook in hooks if hook is not None] + build_custom_hooks(cfg.HOOKS.CUSTOM, cfg.CKPT)


def build_custom_hooks(specs: Iterable[dict[str, Any]], output_dir: str) -> list[TrainHook]:
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


def build_test_hooks(cfg: CfgNode, cfg_filename: str | None = None) -> tuple[TestHook, list[TestCallback]]:
    """The timing TestHook and the ``TEST.HOOKS`` callbacks."""
    timer = TestHook(cfg_filename, logperiod=cfg.TEST.LOG_PERIOD, num_warmup=cfg.TEST.NUM_WARMUP)
    callbacks = []
    for spec in cfg.TEST.HOOKS:
        hook = build_from_spec(HOOKS, spec, output_dir=cfg.CKPT)
        if not isinstance(hook, TestCallback):
            raise ConfigError(f"TEST.HOOKS entry {dict(spec)} built {type(hook).__name__}, which is not a "
                              "TestCallback (or TestHook) subclass")
        callbacks.append(hook)
    return timer, callbacks
