"""Validation metrics as hooks use them: flat names, which direction is better, and whether a value beat the best.

A root of ``pet/engine``'s import graph, as :mod:`pet.engine.models` is.
"""
from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping
from typing import Any

import torch

from pet.utils.errors import ConfigError, TrainingError

__all__ = ["flatten_metrics", "metric_rule", "is_better"]


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
