"""RetinaNet: ResNet + FPN (P3-P7) -> anchors on every level -> a dense head (torchvision's RetinaNetHead).

The parts are torchvision's, assembled from ``MODEL.RETINANET`` under the module names of
``torchvision.models.detection.retinanet_resnet50_fpn`` (``backbone.body``, ``backbone.fpn``,
``anchor_generator``, ``head.classification_head``, ``head.regression_head``), so its weights
load as they are and, with the same input, give torchvision's detections
(tests/support/against_reference.py). Training uses torchvision's ``compute_loss`` (IoU matching, sigmoid focal loss, L1
box loss), testing its ``postprocess_detections`` (per-level top-k, class-wise NMS). The head is the
``MODEL.RETINANET.HEAD_NAME`` entry of ``DENSE_HEAD_REGISTRY``.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from fvcore.common.config import CfgNode
from torchvision.models.detection import retinanet as tv_retinanet

from pet.modeling.anchors import build_anchor_generator
from pet.modeling.backbone import num_fpn_levels
from pet.modeling.one_stage import OneStageDetector, torchvision_args
from pet.modeling.registry import DENSE_HEAD_REGISTRY, META_ARCH_REGISTRY
from pet.utils.errors import ConfigError

__all__ = ["RetinaNet", "RetinaNetHead"]


@DENSE_HEAD_REGISTRY.register()
class RetinaNetHead(tv_retinanet.RetinaNetHead):
    """torchvision's RetinaNet head: classification and box towers of four 3x3 convolutions each, normalised
    as ``MODEL.RETINANET.HEAD_NORM`` says, and torchvision's focal and L1 losses (``compute_loss``)."""

    def __init__(self, cfg: CfgNode, in_channels: int, num_anchors: int, num_classes: int) -> None:
        super().__init__(in_channels, num_anchors, num_classes, norm_layer=_head_norm(cfg.MODEL.RETINANET.HEAD_NORM))


@META_ARCH_REGISTRY.register()
class RetinaNet(OneStageDetector, tv_retinanet.RetinaNet):
    """One-stage anchor-based detector following Pet's batch contract (see FasterRCNN).

    Training mode returns the losses ``loss_classification`` and ``loss_bbox_regression`` (anchors matched
    to boxes by IoU: ``FG_IOU_THRESH`` / ``BG_IOU_THRESH``); eval mode returns per-image
    ``{"boxes", "scores", "labels"}`` with boxes in original-image pixels.
    """

    score_thresh_key = "MODEL.RETINANET.SCORE_THRESH_TEST"

    def __init__(self, cfg: CfgNode) -> None:
        retina = cfg.MODEL.RETINANET
        anchors = build_anchor_generator(retina.ANCHOR_SIZES, retina.ASPECT_RATIOS, num_fpn_levels(cfg),
                                         "MODEL.RETINANET.ANCHOR_SIZES")
        super().__init__(**torchvision_args(cfg, retina, anchors), fg_iou_thresh=retina.FG_IOU_THRESH,
                         bg_iou_thresh=retina.BG_IOU_THRESH)
        self.use_pet_inputs(cfg)


def _head_norm(name: str) -> Callable[[int], torch.nn.Module] | None:
    """``MODEL.RETINANET.HEAD_NORM`` as the ``norm_layer`` of torchvision's RetinaNetHead."""
    if name == "":
        return None
    if name == "GN":
        return partial(torch.nn.GroupNorm, 32)
    raise ConfigError(f"MODEL.RETINANET.HEAD_NORM must be '' or 'GN', got {name!r}.")
