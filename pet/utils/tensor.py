"""Helpers for nested batches of tensors."""
from __future__ import annotations

from typing import Any

import torch


def move_to_device(obj: Any, device: torch.device | str, non_blocking: bool = True) -> Any:
    """``obj`` with every tensor inside (dicts, lists, tuples) moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, dict):
        return {k: move_to_device(v, device, non_blocking) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(move_to_device(v, device, non_blocking) for v in obj)
    return obj

