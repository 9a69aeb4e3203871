"""Detectors built from the config.

``build_model(cfg)`` builds the ``MODEL.META_ARCHITECTURE`` entry of
``META_ARCH_REGISTRY``; ``pet.utils.weights.load_weights(model, path)`` loads a Pet
checkpoint or a torchvision ``state_dict`` into it. To add a detector, backbone (or neck), RPN head,
RoI box or mask head, or one-stage dense head, register it in the matching registry (see
:mod:`pet.modeling.registry`, which also says what each entry is called with and returns) and name it in YAML.
"""
import torch
from fvcore.common.config import CfgNode

from pet.modeling.backbone import build_backbone
from pet.modeling.faster_rcnn import FasterRCNN
from pet.modeling.fcos import FCOS
from pet.modeling.mask_rcnn import MaskRCNN
from pet.modeling.registry import (
    BACKBONE_REGISTRY,
    DENSE_HEAD_REGISTRY,
    META_ARCH_REGISTRY,
    ROI_BOX_HEAD_REGISTRY,
    ROI_MASK_HEAD_REGISTRY,
    RPN_HEAD_REGISTRY,
)
from pet.modeling.retinanet import RetinaNet
from pet.modeling.weights import convert_state_dict

__all__ = [
    "META_ARCH_REGISTRY",
    "BACKBONE_REGISTRY",
    "RPN_HEAD_REGISTRY",
    "ROI_BOX_HEAD_REGISTRY",
    "ROI_MASK_HEAD_REGISTRY",
    "DENSE_HEAD_REGISTRY",
    "build_model",
    "build_backbone",
    "convert_state_dict",
    "FasterRCNN",
    "MaskRCNN",
    "RetinaNet",
    "FCOS",
]


def build_model(cfg: CfgNode) -> torch.nn.Module:
    """The detector named by ``MODEL.META_ARCHITECTURE``, on the CPU (the trainer moves it)."""
    return META_ARCH_REGISTRY.get(cfg.MODEL.META_ARCHITECTURE)(cfg)
