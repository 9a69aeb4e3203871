"""Translate torchvision ``state_dict`` names to Pet's (``FasterRCNN.convert_state_dict``).

``pet.checkpoint.load_weights`` reads the file and calls this for Pet's detectors.
Recognised contents:

- a Pet checkpoint: a dict whose ``"model"`` entry is the state_dict;
- a plain detection ``state_dict`` with Pet's names, which are torchvision's
  (``backbone.body.*``, ``backbone.fpn.*``, ``rpn.head.*``, ``roi_heads.*``), e.g. the
  ``state_dict()`` of ``torchvision.models.detection.fasterrcnn_resnet50_fpn``;
- an ImageNet classification ResNet ``state_dict`` (``conv1.*``, ``layer1.*`` ... ``fc.*``),
  which initialises ``backbone.body`` (the classifier ``fc`` is dropped).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

__all__ = ["convert_state_dict"]

logger = logging.getLogger(__name__)

# Parameters of torchvision's ImageNet ResNets outside the detection backbone.
_CLASSIFIER_PREFIXES = ("fc.",)


def convert_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a foreign ``state_dict`` to Pet's module names.

    A classification ResNet goes under ``backbone.body`` without its classifier; a
    ``module.`` prefix left by (Distributed)DataParallel is removed; anything else is
    already in Pet's (= torchvision's detection) naming.
    """
    state = dict(state)
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    if "conv1.weight" in state and "layer1.0.conv1.weight" in state:
        return {f"backbone.body.{k}": v for k, v in state.items() if not k.startswith(_CLASSIFIER_PREFIXES)}
    return state
