"""Detectors built from the config.

``build_model(cfg)`` builds the ``MODEL.META_ARCHITECTURE`` entry of
``META_ARCH_REGISTRY``; ``pet.checkpoint.load_weights(model, path)`` loads a Pet
checkpoint or a torchvision ``state_dict`` into it. Everything outside this package learns what it needs of a
detector through :class:`Detector` (:mod:`pet.modeling.detector`) and finds its ONNX graph with
:func:`build_export_graph`; docs/extending.md says how to add one. To add a backbone (or neck), RPN head,
RoI box, mask or keypoint head, or one-stage dense head, register it in the matching registry (see
:mod:`pet.modeling.registry`, which also says what each entry is called with and returns) and name it in YAML.
"""
from pet.modeling import registry
from pet.modeling.backbone import build_backbone
from pet.modeling.build import build_model
from pet.modeling.cascade_rcnn import CascadeMaskRCNN, CascadeRCNN
from pet.modeling.detector import Detector
from pet.modeling.dfine import DEIMV2, DFINE
from pet.modeling.export_graph import build_export_graph, register_export_graph
from pet.modeling.faster_rcnn import FasterRCNN
from pet.modeling.fcos import FCOS
from pet.modeling.hgnetv2 import HGNetV2
from pet.modeling.keypoint_rcnn import KeypointRCNN
from pet.modeling.mask_rcnn import MaskRCNN
from pet.modeling.registry import *  # noqa: F403 - the registries, as registry.__all__ lists them
from pet.modeling.retinanet import RetinaNet
from pet.modeling.rtdetr import RTDETR
from pet.modeling.state_dict_names import convert_state_dict

__all__ = [
    "build_model",
    "build_backbone",
    "convert_state_dict",
    "Detector",
    "build_export_graph",
    "register_export_graph",
    "FasterRCNN",
    "MaskRCNN",
    "KeypointRCNN",
    "RetinaNet",
    "FCOS",
    "CascadeRCNN",
    "CascadeMaskRCNN",
    "RTDETR",
    "DFINE",
    "DEIMV2",
    "HGNetV2",
]
__all__ += registry.__all__

