"""The model as the engine sees it: building it, where it runs, unwrapping it (:func:`pet.utils.comm.unwrap_model`,
re-exported here), calling it on a batch.

Kept free of the loop, the hooks and the test loop so every one of them can import it
(``pet/engine`` is an acyclic graph of modules; this is one of its roots, with :mod:`pet.engine.metrics`).

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

import os
from typing import Any

import torch

from pet.utils.comm import unwrap_model
from pet.utils.errors import TrainingError
from pet.utils.registry import locate

__all__ = [
    "resolve_device",
    "model_device",
    "unwrap_model",
    "call_model",
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


def call_model(model: torch.nn.Module, batch: Any) -> Any:
    """``model(*batch)`` for a tuple/list batch, ``model(**batch)`` for a dict, else ``model(batch)``."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)
