"""The keypoint branch of Keypoint R-CNN, from ``MODEL.ROI_KEYPOINT_HEAD``: torchvision's modules under its names.

``keypoint_roi_pool`` (RoIAlign of the box levels), ``keypoint_head`` (chosen from ``ROI_KEYPOINT_HEAD_REGISTRY``
by ``MODEL.ROI_KEYPOINT_HEAD.NAME``) and ``keypoint_predictor`` (2x deconvolution to one logit map per keypoint,
then 2x bilinear up-sampling: 56x56 heatmaps from 14x14 RoIs). torchvision's RoIHeads runs the branch: in training
``keypointrcnn_loss`` (a softmax cross-entropy over each visible keypoint's heatmap, on the positive proposals), in
eval mode ``heatmaps_to_keypoints`` (each heatmap resized bicubically to its box, its arg-max the keypoint, the
logit there its score). Pet keeps both as torchvision has them, so that weights and outputs are torchvision's.
"""
from __future__ import annotations

import torch
from fvcore.common.config import CfgNode
from torchvision.models.detection import keypoint_rcnn as tv_kprcnn
from torchvision.models.detection.roi_heads import heatmaps_to_keypoints

from pet.modeling.poolers import MultiScaleRoIAlign
from pet.modeling.registry import ROI_KEYPOINT_HEAD_REGISTRY
from pet.utils.errors import ConfigError
from pet.utils.tensor import at_least_float32

__all__ = ["KeypointRCNNHeads", "KeypointRCNNPredictor", "build_keypoint_branch", "decode_heatmaps"]


@ROI_KEYPOINT_HEAD_REGISTRY.register()
class KeypointRCNNHeads(tv_kprcnn.KeypointRCNNHeads):
    """torchvision's keypoint head: one 3x3 convolution + ReLU per entry of ``CONV_DIMS``, under its module names
    (``0``, ``2``, ... for the convolutions) so its weights load.

    ``out_channels`` is what the keypoint predictor receives: ``CONV_DIMS[-1]``, or ``in_channels`` without
    convolutions.
    """

    def __init__(self, cfg: CfgNode, in_channels: int) -> None:
        dims = list(cfg.MODEL.ROI_KEYPOINT_HEAD.CONV_DIMS)
        super().__init__(in_channels, dims)
        self.out_channels = dims[-1] if dims else in_channels


class KeypointRCNNPredictor(tv_kprcnn.KeypointRCNNPredictor):
    """torchvision's deconvolution (``kps_score_lowres``) and 2x bilinear up-sampling, the up-sampling in float32.

    Under bfloat16 autocast the heatmap logits would otherwise be up-sampled and arg-maxed in bfloat16, whose
    8-bit mantissa turns near-equal peaks into ties and moves keypoints by whole heatmap cells. In float32 and
    float64 this is torchvision's forward, operation for operation. The heatmaps are returned contiguous whatever
    the model's memory format: torchvision's ``keypointrcnn_loss`` ``view``s them, which a channels-last tensor
    refuses (torchvision's own model cannot train channels-last for that reason).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = at_least_float32(self.kps_score_lowres(x))
        heatmaps = torch.nn.functional.interpolate(logits, scale_factor=float(self.up_scale), mode="bilinear",
                                                   align_corners=False, recompute_scale_factor=False)
        return heatmaps.contiguous()


def build_keypoint_branch(cfg: CfgNode, in_channels: int, featmap_names: list[str]) -> dict[str, torch.nn.Module]:
    """``keypoint_roi_pool``, ``keypoint_head`` and ``keypoint_predictor`` for torchvision's RoIHeads.

    With ``MODEL.ROI_KEYPOINT_HEAD``'s defaults these are exactly ``keypointrcnn_resnet50_fpn``'s: 14x14 RoIAlign
    (sampling ratio 2) on ``featmap_names``, eight 3x3 convolutions of 512 channels, a 2x deconvolution to 17
    heatmaps, then 2x bilinear up-sampling to 56x56.
    """
    head_cfg = cfg.MODEL.ROI_KEYPOINT_HEAD
    if head_cfg.NUM_KEYPOINTS < 1:
        raise ConfigError(f"MODEL.ROI_KEYPOINT_HEAD.NUM_KEYPOINTS must be >= 1, got {head_cfg.NUM_KEYPOINTS}: "
                          "set it to the number of keypoints of the dataset's instances (COCO person: 17)")
    head = ROI_KEYPOINT_HEAD_REGISTRY.get(head_cfg.NAME)(cfg, in_channels)
    return {
        "keypoint_roi_pool": MultiScaleRoIAlign(featmap_names, head_cfg.POOLER_RESOLUTION,
                                                head_cfg.POOLER_SAMPLING_RATIO),
        "keypoint_head": head,
        "keypoint_predictor": KeypointRCNNPredictor(head.out_channels, head_cfg.NUM_KEYPOINTS),
    }


def decode_heatmaps(heatmaps: torch.Tensor, boxes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keypoints float32 ``[N, K, 3]`` (x, y, 1) and their scores float32 ``[N, K]`` from heatmap logits
    ``[N, K, H, H]`` of the detections ``boxes`` (XYXY, the keypoints come in their frame): torchvision's
    ``heatmaps_to_keypoints``, which the PyTorch model's RoIHeads calls, for the exported graph's heatmaps."""
    return heatmaps_to_keypoints(heatmaps, boxes)
