"""``MODEL.COMPILE``: torch.compile parts of a model, in place.

``nn.Module.compile`` keeps the module object and its parameters where they are, so
state_dict keys, checkpoints, weight loading, hooks and DistributedDataParallel see the
same model as without it. Detectors are compiled part by part (typically the backbone):
their proposal and post-processing stages have data-dependent shapes, which would break
the graph at every step.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from pet.utils.errors import ConfigError

__all__ = ["compile_submodules"]

logger = logging.getLogger(__name__)


def compile_submodules(model: torch.nn.Module, names: Sequence[str]) -> None:
    """Compile each submodule named in ``names`` (dotted attribute paths; ``""`` is the whole model).

    Shapes are treated as dynamic from the start, as detection inputs change size from batch to batch.
    The first steps are slow while torch compiles; the log says when.
    """
    for name in names:
        try:
            module = model.get_submodule(name)
        except AttributeError as exc:
            raise ConfigError(
                f"MODEL.COMPILE names '{name}', which is not a submodule of {type(model).__name__} ({exc}). "
                "Use a dotted attribute path such as 'backbone', or '' for the whole model."
            ) from None
        module.compile(dynamic=True)
        logger.info(f"torch.compile: {name or type(model).__name__} is compiled at its first call (slow once).")
