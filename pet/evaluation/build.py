"""The evaluator registry and :func:`build_evaluator`, which builds the ``TEST.EVALUATOR`` for a dataset."""
from __future__ import annotations

from typing import Any

from fvcore.common.config import CfgNode

from pet.utils.registry import Registry

__all__ = ["EVALUATOR_REGISTRY", "build_evaluator"]

EVALUATOR_REGISTRY = Registry("evaluator")
EVALUATOR_REGISTRY.__doc__ = "Evaluator classes by name, for TEST.EVALUATOR."


def build_evaluator(cfg: CfgNode, dataset: Any, output_dir: str) -> Any:
    """The ``TEST.EVALUATOR`` (a registry name or dotted path) for ``dataset``, writing into ``output_dir``.

    A class with ``from_config(cfg, dataset, output_dir)`` is built through it (so it can read its
    own keys); any other is called as ``cls(dataset, output_dir)``. What it must offer:
    :class:`pet.engine.inference.Evaluator`.
    """
    cls = EVALUATOR_REGISTRY.get(cfg.TEST.EVALUATOR)
    if hasattr(cls, "from_config"):
        return cls.from_config(cfg, dataset, output_dir)
    return cls(dataset, output_dir)
