"""Load initial weights into a model (not a resume): one place for every caller.

Accepts a Pet checkpoint (a dict with ``"model"``) or a plain ``state_dict``, read with
``torch.load(weights_only=True)`` unless ``unsafe``. A model translates foreign names
(torchvision classification or detection weights) by defining
``convert_state_dict(state_dict) -> state_dict``. Keys that do not fit are reported in
one table grouped by module, not one line per tensor.
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Mapping

import torch

from pet.utils.errors import ConfigError
from pet.utils.table import format_table

__all__ = ["load_weights"]

logger = logging.getLogger(__name__)

# Buffers whose absence or presence says nothing about the weights (BN vs FrozenBN).
_IGNORED_SUFFIXES = ("num_batches_tracked",)


def load_weights(model: torch.nn.Module, path: str, *, unsafe: bool = False) -> dict[str, list[str]]:
    """Load the weights file ``path`` into ``model`` (initialisation, not a resume).

    Returns ``{"missing": [...], "unexpected": [...], "mismatched": [...]}``: keys of the
    model the file lacks, keys of the file the model lacks, and keys whose shapes differ
    (left at the model's values). ``num_batches_tracked`` buffers are never reported.
    """
    if not os.path.isfile(path):
        raise ConfigError(
            f"Weights file not found: {path} (train first, or point TEST.WEIGHTS / TRAIN.WEIGHTS at a file)"
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=not unsafe)
    except Exception as exc:  # noqa: BLE001 - torch raises many types for unreadable files
        hint = " If you trust its source, load it with --unsafe-load." if "weights_only" in str(exc) else ""
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        raise ConfigError(f"Cannot load weights from {path}: {type(exc).__name__}: {first_line}.{hint}") from exc
    state = checkpoint.get("model", checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"{path} holds no state_dict: expected a dict of tensors or a Pet checkpoint with 'model'")
    model = model.module if isinstance(getattr(model, "module", None), torch.nn.Module) else model
    convert = getattr(model, "convert_state_dict", None)
    state = convert(state) if callable(convert) else dict(state)

    own = model.state_dict()
    mismatched = {k: (tuple(v.shape), tuple(own[k].shape)) for k, v in state.items()
                  if k in own and v.shape != own[k].shape}
    result = model.load_state_dict({k: v for k, v in state.items() if k not in mismatched}, strict=False)
    report = {
        "missing": [k for k in result.missing_keys if k not in mismatched and not k.endswith(_IGNORED_SUFFIXES)],
        "unexpected": [k for k in result.unexpected_keys if not k.endswith(_IGNORED_SUFFIXES)],
        "mismatched": list(mismatched),
    }
    loaded = sum(1 for k in state if k in own and k not in mismatched)
    logger.info(f"Loaded {loaded} of the model's {len(own)} tensors from {path}")
    if any(report.values()):
        logger.warning(f"Weights in {path} that did not load:\n{_report_table(report, mismatched)}")
    return report


def _report_table(report: dict[str, list[str]], shapes: dict[str, tuple[tuple, tuple]]) -> str:
    """One row per (status, module) with a tensor count; shape mismatches show one example."""
    rows = []
    for status, keys in report.items():
        groups: OrderedDict[str, list[str]] = OrderedDict()
        for key in keys:
            groups.setdefault(_group(key), []).append(key)
        for group, members in groups.items():
            row = [status, group, len(members)]
            if shapes:
                example = members[0]
                row.append(f"{example}: file {list(shapes[example][0])}, model {list(shapes[example][1])}"
                           if status == "mismatched" else "")
            rows.append(row)
    header = ["status", "module", "tensors"] + (["example"] if shapes else [])
    return format_table(header, rows)


def _group(key: str) -> str:
    """``backbone.fpn.inner_blocks.0.0.weight`` -> ``backbone.fpn.*``; short keys stay whole."""
    parts = key.split(".")
    return ".".join(parts[:2]) + ".*" if len(parts) > 3 else key
