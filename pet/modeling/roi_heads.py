"""RoI heads from ``MODEL.ROI_HEADS`` / ``MODEL.ROI_BOX_HEAD`` (and ``MODEL.ROI_MASK_HEAD`` for
Mask R-CNN): torchvision's RoIHeads with a box head chosen from ``ROI_BOX_HEAD_REGISTRY``.

A new box head is a class registered there whose ``__init__(cfg, in_channels)`` builds it
and whose forward maps pooled features ``[R, in_channels, S, S]`` to
``[R, MODEL.ROI_BOX_HEAD.MLP_DIM]``; name it in YAML with ``MODEL.ROI_BOX_HEAD.NAME``.

The mask branch is torchvision's too (``mask_roi_pool``, ``mask_head``, ``mask_predictor``), its
``mask_head`` chosen from ``ROI_MASK_HEAD_REGISTRY`` by ``MODEL.ROI_MASK_HEAD.NAME``: RoIHeads runs
it, computes ``loss_mask`` in training and adds per-class-selected mask probabilities
``[N, 1, M, M]`` to each image's detections in eval mode.
"""
from __future__ import annotations

import torch
from fvcore.common.config import CfgNode
from torchvision.models.detection import faster_rcnn as tv_frcnn
from torchvision.models.detection import mask_rcnn as tv_mrcnn
from torchvision.models.detection.roi_heads import RoIHeads

from pet.modeling.poolers import MultiScaleRoIAlign
from pet.modeling.registry import ROI_BOX_HEAD_REGISTRY, ROI_MASK_HEAD_REGISTRY
from pet.utils.tensor import at_least_float32

__all__ = ["TwoMLPHead", "FastRCNNPredictor", "MaskRCNNHeads", "MaskRCNNPredictor", "build_roi_heads"]


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
        return at_least_float32(scores), at_least_float32(deltas)


@ROI_MASK_HEAD_REGISTRY.register()
class MaskRCNNHeads(tv_mrcnn.MaskRCNNHeads):
    """torchvision's mask head, ``NUM_CONV`` 3x3 convolutions + ReLU of ``CONV_DIM`` channels, under its
    module names (``0``, ``1``, ...) so its weights load.

    ``out_channels`` is what the mask predictor receives: ``CONV_DIM``, or ``in_channels`` without convolutions.
    """

    def __init__(self, cfg: CfgNode, in_channels: int) -> None:
        mask = cfg.MODEL.ROI_MASK_HEAD
        dims = [mask.CONV_DIM] * mask.NUM_CONV
        super().__init__(in_channels, dims, dilation=1)
        self.out_channels = dims[-1] if dims else in_channels


class MaskRCNNPredictor(tv_mrcnn.MaskRCNNPredictor):
    """torchvision's 2x up-sampling deconvolution and per-class mask logits, with float32 outputs.

    Under bfloat16 autocast the logits would otherwise reach the sigmoid, the bilinear pasting
    and the 0.5 threshold in bfloat16, which moves mask borders by whole pixels.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return at_least_float32(super().forward(x))


def build_mask_branch(cfg: CfgNode, in_channels: int, featmap_names: list[str]) -> dict[str, torch.nn.Module]:
    """``mask_roi_pool``, ``mask_head`` and ``mask_predictor`` for torchvision's RoIHeads.

    The head is the ``MODEL.ROI_MASK_HEAD.NAME`` entry; the predictor takes its ``out_channels``. With
    ``MODEL.ROI_MASK_HEAD``'s defaults these are exactly ``maskrcnn_resnet50_fpn``'s: 14x14 RoIAlign,
    four 3x3 convolutions of 256 channels, a 2x deconvolution and 28x28 logits per class.
    """
    mask = cfg.MODEL.ROI_MASK_HEAD
    head = ROI_MASK_HEAD_REGISTRY.get(mask.NAME)(cfg, in_channels)
    return {
        "mask_roi_pool": MultiScaleRoIAlign(featmap_names, mask.POOLER_RESOLUTION, mask.POOLER_SAMPLING_RATIO),
        "mask_head": head,
        "mask_predictor": MaskRCNNPredictor(head.out_channels, mask.CONV_DIM, cfg.MODEL.NUM_CLASSES + 1),
    }


def build_roi_heads(cfg: CfgNode, in_channels: int, featmap_names: list[str], *, mask: bool = False) -> RoIHeads:
    """RoI heads pooling from the feature maps ``featmap_names`` (``in_channels`` each); with
    ``mask`` they also have the mask branch of :func:`build_mask_branch`."""
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
        **(build_mask_branch(cfg, in_channels, featmap_names) if mask else {}),
    )
