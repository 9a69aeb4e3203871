"""What several parts of the engine need: devices, calling a model on a batch, metric names and rules.

Kept free of the loop, the hooks and the test loop so every one of them can import it
(``pet/engine`` is an acyclic graph of modules; this is one of its roots).

**The model and the evaluator.** DESIGN.md asks two things at once: ``Trainer(cfg)`` and the test
loop build the detector and the evaluator the config names, and ``pet/engine`` never imports
``pet.modeling`` or ``pet.evaluation`` (the models never see the engine; evaluation uses the engine's
callbacks). :func:`build_model` and :func:`build_evaluator` reconcile them: each finds the builder of
the package that owns the registry (:mod:`pet.modeling.build`, :mod:`pet.evaluation.build`) by its
dotted name on first use, as MMEngine finds a registry by its default scope. These two names are the
only place the engine names those packages, and no import statement does; passing builders in from
every entry point instead would leave ``Trainer(cfg)`` (DESIGN.md's contract) without one.
"""
from __future__ import annotations

import math
import numbers
import os
import re
from collections.abc import Mapping
from typing import Any

import torch

from pet.utils.errors import ConfigError, TrainingError
from pet.utils.registry import locate

__all__ = [
    "resolve_device",
    "model_device",
    "unwrap_model",
    "call_model",
    "flatten_metrics",
    "metric_rule",
    "is_better",
    "build_model",
    "build_evaluator",
]

# The builders of the packages above the engine, by name (see the module docstring).
MODEL_BUILDER = "pet.modeling.build.build_model"
EVALUATOR_BUILDER = "pet.evaluation.build.build_evaluator"


def build_model(cfg: Any) -> torch.nn.Module:
    """The ``MODEL.META_ARCHITECTURE`` detector built from ``cfg``, on the CPU (:func:`pet.modeling.build_model`)."""
    return locate(MODEL_BUILDER)(cfg)


def build_evaluator(cfg: Any, dataset: Any, output_dir: str) -> Any:
    """The ``TEST.EVALUATOR`` for ``dataset`` writing into ``output_dir`` (:func:`pet.evaluation.build_evaluator`)."""
    return locate(EVALUATOR_BUILDER)(cfg, dataset, output_dir)


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available (this process's local GPU), else CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise TrainingError("DEVICE is 'cuda' but no CUDA device is available; use DEVICE auto or cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device(name)


def model_device(model: torch.nn.Module) -> torch.device:
    """Where ``model`` runs: the device of its first parameter or buffer; CPU for a module without tensors
    (a wrapper around an external runtime, say)."""
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DistributedDataParallel / DataParallel wrappers."""
    return model.module if hasattr(model, "module") and isinstance(model.module, torch.nn.Module) else model


def call_model(model: torch.nn.Module, batch: Any) -> Any:
    """``model(*batch)`` for a tuple/list batch, ``model(**batch)`` for a dict, else ``model(batch)``."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def flatten_metrics(results: Any, prefix: str = "") -> dict[str, float]:
    """``{"bbox": {"AP": 1.0}}`` -> ``{"bbox/AP": 1.0}`` (``prefix`` goes in front of every name).

    Values must be real numbers (Python, numpy or one-element tensors); anything else is a
    :class:`TrainingError` naming the metric, since writers and SAVE_BEST could not use it.
    """
    if not isinstance(results, Mapping):
        raise TrainingError(f"Metrics must be a dict, got {type(results).__name__}")
    flat: dict[str, float] = {}
    for name, value in results.items():
        if isinstance(value, Mapping):
            flat.update(flatten_metrics(value, f"{prefix}{name}/"))
        elif isinstance(value, (numbers.Real, torch.Tensor)) and not isinstance(value, bool):
            flat[f"{prefix}{name}"] = float(value)
        else:
            raise TrainingError(f"Metric '{prefix}{name}' is a {type(value).__name__}, not a number")
    return flat


# Tokens of a metric name (split on "/", "_", "@", ...) that mean "larger is better":
# AP, AP50, APs, mAP, AR, AR100, ARl, acc, top1, precision, recall, (m)IoU, AUC, F1, dice.
_GREATER = re.compile(r"^(m?ap(\d+|[sml])?|ar(\d+|[sml])?|m?acc\w*|top\d*|precision|recall|m?iou|auc|f1|m?dice)$")


def metric_rule(metric: str, rule: str = "", key: str = "RULE") -> str:
    """``"greater"`` or ``"less"``: ``rule`` when given, else inferred from the name of ``metric``.

    Names with "loss" are "less"; AP/mAP/AR/acc/top/precision/recall/IoU names are
    "greater"; anything else is a :class:`ConfigError` asking for ``key`` to be set.
    """
    rule = (rule or "").lower()
    if rule in ("greater", "less"):
        return rule
    if rule:
        raise ConfigError(f"{key} must be 'greater', 'less' or empty (inferred from the metric name), got {rule!r}")
    if "loss" in metric.lower():
        return "less"
    if any(_GREATER.match(token) for token in re.split(r"[^a-z0-9]+", metric.lower()) if token):
        return "greater"
    raise ConfigError(
        f"Cannot tell whether a larger or a smaller '{metric}' is better; set {key} to 'greater' or 'less'"
    )


def is_better(value: float, best: float | None, rule: str, min_delta: float = 0.0) -> bool:
    """Strictly better than ``best`` by more than ``min_delta`` (any finite value beats None)."""
    if not math.isfinite(value):
        return False
    if best is None:
        return True
    return value - min_delta > best if rule == "greater" else value + min_delta < best
