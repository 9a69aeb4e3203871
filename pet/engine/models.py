"""The model as the engine sees it: building it, where it runs, unwrapping it (:func:`pet.utils.comm.unwrap_model`,
re-exported here), calling it on a batch.

Kept free of the loop, the hooks and the test loop so every one of them can import it
(``pet/engine`` is an acyclic graph of modules; this is one of its roots, with :mod:`pet.engine.metrics`).

**The default builders.** ``Trainer(cfg)`` and the test loop build the detector and the evaluator the
config names, yet ``pet/engine`` never imports ``pet.modeling`` or ``pet.evaluation`` (docs/design.md,
the layer rule). So the engine keeps a slot for each builder and the package fills both when it is
imported: ``pet/__init__.py`` imports :mod:`pet.modeling` and :mod:`pet.evaluation` and calls
:func:`register_default_builders` with their ``build_model`` and ``build_evaluator``. Every import of
an engine module runs ``pet/__init__.py`` first, so ``from pet.engine.trainer import Trainer`` always
finds them, and the dependency is an import statement in the import graph, not a name in a string.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from fvcore.common.config import CfgNode

from pet.utils.comm import unwrap_model
from pet.utils.compile import compile_submodules
from pet.utils.errors import TrainingError

__all__ = [
    "ModelBuilder",
    "EvaluatorBuilder",
    "register_default_builders",
    "default_model_builder",
    "default_evaluator_builder",
    "prepare_model",
    "resolve_device",
    "model_device",
    "unwrap_model",
    "call_model",
    "model_keypoint_count",
]

# ``build_model(cfg)``: the ``MODEL.META_ARCHITECTURE`` detector on the CPU (:func:`pet.modeling.build_model`).
ModelBuilder = Callable[[CfgNode], torch.nn.Module]
# ``build_evaluator(cfg, dataset, output_dir)``: the ``TEST.EVALUATOR`` (:func:`pet.evaluation.build_evaluator`).
EvaluatorBuilder = Callable[[CfgNode, Any, str], Any]

_DEFAULT_BUILDERS: dict[str, Callable[..., Any]] = {}


def register_default_builders(*, model: ModelBuilder, evaluator: EvaluatorBuilder) -> None:
    """Set what builds the model and the evaluator when ``Trainer`` or the test loop is given none.

    ``pet/__init__.py`` calls it once with Pet's own builders (see the module docstring).
    """
    _DEFAULT_BUILDERS.update(model=model, evaluator=evaluator)


def default_model_builder() -> ModelBuilder:
    """The builder of the config's detector (:func:`pet.modeling.build_model` once ``pet`` is imported)."""
    return _default_builder("model")


def default_evaluator_builder() -> EvaluatorBuilder:
    """The builder of the config's evaluator (:func:`pet.evaluation.build_evaluator` once ``pet`` is imported)."""
    return _default_builder("evaluator")


def _default_builder(kind: str) -> Callable[..., Any]:
    if kind not in _DEFAULT_BUILDERS:  # only while pet/__init__.py is still running
        raise TrainingError(f"No default {kind} builder yet: the engine was used before pet/__init__.py "
                            f"registered pet's builders (register_default_builders)")
    return _DEFAULT_BUILDERS[kind]


def prepare_model(model: torch.nn.Module, cfg: CfgNode, device: torch.device | None = None) -> torch.nn.Module:
    """``model`` (from :func:`pet.modeling.build_model`, or the caller's) on ``device`` (default:
    ``DEVICE``) with ``MODEL.COMPILE`` applied."""
    model.to(device if device is not None else resolve_device(cfg.DEVICE))
    compile_submodules(model, cfg.MODEL.COMPILE)
    return model


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


def model_keypoint_count(model: torch.nn.Module, cfg: CfgNode) -> int:
    """How many keypoints per object ``model`` learns under ``cfg``: its detector contract's ``keypoint_count``
    (:class:`pet.modeling.Detector`, which the engine does not import), 0 for a model without one."""
    count = getattr(unwrap_model(model), "keypoint_count", None)
    return int(count(cfg)) if callable(count) else 0
