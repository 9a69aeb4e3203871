"""FCOS: ResNet + FPN (P3-P7) -> one point per feature-map cell -> a dense head (torchvision's FCOSHead).

The parts are torchvision's, assembled from ``MODEL.FCOS`` under the module names of
``torchvision.models.detection.fcos_resnet50_fpn`` (``backbone.body``, ``backbone.fpn``,
``anchor_generator``, ``head.classification_head``, ``head.regression_head``), so its weights
load as they are and, with the same input, give torchvision's detections
(tests/support/against_reference.py). Training uses torchvision's ``compute_loss`` (centre sampling, per-level size
ranges, focal, GIoU and centerness losses), testing its ``postprocess_detections``. The head is the
``MODEL.FCOS.HEAD_NAME`` entry of ``DENSE_HEAD_REGISTRY``.
"""
from __future__ import annotations

from fvcore.common.config import CfgNode
from torchvision.models.detection import fcos as tv_fcos
from torchvision.models.detection.anchor_utils import AnchorGenerator

from pet.modeling.backbone import fpn_strides
from pet.modeling.one_stage import OneStageDetector, torchvision_args
from pet.modeling.registry import DENSE_HEAD_REGISTRY, META_ARCH_REGISTRY

__all__ = ["FCOS", "FCOSHead"]


@DENSE_HEAD_REGISTRY.register()
class FCOSHead(tv_fcos.FCOSHead):
    """torchvision's FCOS head: classification and box towers of ``MODEL.FCOS.NUM_CONVS`` conv + GroupNorm + ReLU
    layers, a centerness output, and torchvision's focal, GIoU and centerness losses (``compute_loss``)."""

    def __init__(self, cfg: CfgNode, in_channels: int, num_anchors: int, num_classes: int) -> None:
        super().__init__(in_channels, num_anchors, num_classes, num_convs=cfg.MODEL.FCOS.NUM_CONVS)


@META_ARCH_REGISTRY.register()
class FCOS(OneStageDetector, tv_fcos.FCOS):
    """One-stage anchor-free detector following Pet's batch contract (see FasterRCNN).

    Training mode returns the losses ``loss_classification``, ``loss_bbox_regression`` and
    ``loss_bbox_ctrness`` (points matched to boxes by centre sampling and the per-level size ranges);
    eval mode returns per-image ``{"boxes", "scores", "labels"}`` with boxes in original-image pixels.
    """

    score_thresh_key = "MODEL.FCOS.SCORE_THRESH_TEST"
    loss_takes_anchors_per_level = True

    def __init__(self, cfg: CfgNode) -> None:
        # One square "anchor" per cell as large as its level's stride (torchvision's 8..128 on P3-P7):
        # compute_loss gives each box to the level whose 4x-8x stride range holds its regression distances.
        strides = fpn_strides(cfg)
        anchors = AnchorGenerator(tuple((s,) for s in strides), ((1.0,),) * len(strides))
        fcos = cfg.MODEL.FCOS
        super().__init__(**torchvision_args(cfg, fcos, anchors), center_sampling_radius=fcos.CENTER_SAMPLING_RADIUS)
        self.use_pet_inputs(cfg)
