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



def at_least_float32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float32 when autocast left it in a reduced precision (bfloat16, float16); a float32 or
    float64 tensor as it is, so a model moved to float64 (``model.double()``) computes in float64 throughout."""
    return tensor.float() if tensor.dtype in (torch.bfloat16, torch.float16) else tensor
