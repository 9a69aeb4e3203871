"""The meta-architecture registry and :func:`build_model`, the one way Pet builds a detector from the config.

Kept in a module of its own (as detectron2's ``modeling/meta_arch/build.py``) so that the detectors can
register into it and :mod:`pet.modeling.registry` can list it with the part registries, without a cycle.
"""
from __future__ import annotations

from typing import Any

import torch
from fvcore.common.config import CfgNode

from pet.utils.registry import Registry

__all__ = ["META_ARCH_REGISTRY", "build_model"]

META_ARCH_REGISTRY = Registry("meta-architecture")
META_ARCH_REGISTRY.__doc__ = "Detector classes by name, for MODEL.META_ARCHITECTURE: ``Entry(cfg) -> nn.Module``."


def build_model(cfg: CfgNode) -> torch.nn.Module:
    """The detector named by ``MODEL.META_ARCHITECTURE``, built from ``cfg``, on the CPU.

    :func:`pet.engine.models.prepare_model` then places it on ``DEVICE`` for a run.
    """
    model: Any = META_ARCH_REGISTRY.get(cfg.MODEL.META_ARCHITECTURE)(cfg)
    return model
