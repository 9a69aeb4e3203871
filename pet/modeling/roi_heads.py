"""RoI heads from ``MODEL.ROI_HEADS`` / ``MODEL.ROI_BOX_HEAD``: torchvision's RoIHeads with a
box head chosen from ``ROI_BOX_HEAD_REGISTRY``.

A new box head is a class registered there whose ``__init__(cfg, in_channels)`` builds it
and whose forward maps pooled features ``[R, in_channels, S, S]`` to
``[R, MODEL.ROI_BOX_HEAD.MLP_DIM]``; name it in YAML with ``MODEL.ROI_BOX_HEAD.NAME``.
"""
from __future__ import annotations

import torch
from fvcore.common.config import CfgNode
from torchvision.models.detection import faster_rcnn as tv_frcnn
from torchvision.models.detection.roi_heads import RoIHeads
from torchvision.ops import MultiScaleRoIAlign

from pet.modeling.registry import ROI_BOX_HEAD_REGISTRY

__all__ = ["TwoMLPHead", "FastRCNNPredictor", "build_roi_heads"]


@ROI_BOX_HEAD_REGISTRY.register()
class TwoMLPHead(tv_frcnn.TwoMLPHead):
    """torchvision's two fully-connected layers (``fc6``, ``fc7``) of width ``MLP_DIM``."""

    def __init__(self, cfg: CfgNode, in_channels: int) -> None:
        box = cfg.MODEL.ROI_BOX_HEAD
        super().__init__(in_channels * box.POOLER_RESOLUTION**2, box.MLP_DIM)


class FastRCNNPredictor(tv_frcnn.FastRCNNPredictor):
    """torchvision's class-score and box-delta layers, with float32 outputs.

    Under bfloat16 autocast box deltas decoded in bfloat16 would put final boxes on a
    whole-pixel (or coarser) grid and cost AP at strict IoU thresholds.
    """

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores, deltas = super().forward(x)
        return scores.float(), deltas.float()


def build_roi_heads(cfg: CfgNode, in_channels: int, featmap_names: list[str]) -> RoIHeads:
    """Box RoI heads pooling from the feature maps ``featmap_names`` (``in_channels`` each)."""
    heads, box = cfg.MODEL.ROI_HEADS, cfg.MODEL.ROI_BOX_HEAD
    return RoIHeads(
        MultiScaleRoIAlign(featmap_names, box.POOLER_RESOLUTION, box.POOLER_SAMPLING_RATIO),
        ROI_BOX_HEAD_REGISTRY.get(box.NAME)(cfg, in_channels),
        FastRCNNPredictor(box.MLP_DIM, cfg.MODEL.NUM_CLASSES + 1),
        fg_iou_thresh=heads.FG_IOU_THRESH,
        bg_iou_thresh=heads.BG_IOU_THRESH,
        batch_size_per_image=heads.BATCH_SIZE_PER_IMAGE,
        positive_fraction=heads.POSITIVE_FRACTION,
        bbox_reg_weights=None,  # torchvision's (10, 10, 5, 5)
        score_thresh=heads.SCORE_THRESH_TEST,
        nms_thresh=heads.NMS_THRESH_TEST,
        detections_per_img=heads.DETECTIONS_PER_IMAGE,
    )
