"""Keypoint R-CNN: Faster R-CNN plus torchvision's keypoint branch.

The branch (:mod:`pet.modeling.keypoint_head`) is attached to the RoI heads under the module names of
``torchvision.models.detection.keypointrcnn_resnet50_fpn`` (``roi_heads.keypoint_roi_pool``,
``roi_heads.keypoint_head``, ``roi_heads.keypoint_predictor``), as torchvision's ``KeypointRCNN`` attaches it, so
its weights load as they are and torchvision's RoIHeads runs it: ``keypointrcnn_loss`` in training,
``heatmaps_to_keypoints`` in eval mode. :func:`pet.modeling.postprocess.detections_to_original` scales the
keypoints to the original images as torchvision's ``resize_keypoints`` does (no clipping).
"""
from __future__ import annotations

from typing import Any

import torch
from fvcore.common.config import CfgNode

from pet.modeling.faster_rcnn import FasterRCNN
from pet.modeling.keypoint_head import build_keypoint_branch
from pet.modeling.registry import META_ARCH_REGISTRY
from pet.utils.errors import DataError

__all__ = ["KeypointRCNN"]


@META_ARCH_REGISTRY.register()
class KeypointRCNN(FasterRCNN):
    """Two-stage detector with per-instance keypoints, following Pet's batch contract.

    Training targets also carry ``keypoints``: float32 ``[N, K, 3]`` (x, y, visibility 0/1/2) in the resized
    image's pixels, in the order of ``boxes``, K = ``MODEL.ROI_KEYPOINT_HEAD.NUM_KEYPOINTS`` (torchvision's
    convention; an instance without keypoints has visibility-0 rows); the losses gain ``loss_keypoint``. Eval mode
    adds to each image's detections ``keypoints`` float32 ``[N, K, 3]`` (x, y, 1) in the original image and
    ``keypoints_scores`` float32 ``[N, K]`` (the heatmap logit at each keypoint, not a probability).
    """

    target_fields = (*FasterRCNN.target_fields, "keypoints")
    # The keypoint branch stays float under int8: the export gate measures box (and mask) AP, which cannot see
    # keypoints degrade.
    float_parts = (*FasterRCNN.float_parts, "roi_heads.keypoint_head", "roi_heads.keypoint_predictor")

    @classmethod
    def keypoint_count(cls, cfg: CfgNode) -> int:
        return int(cfg.MODEL.ROI_KEYPOINT_HEAD.NUM_KEYPOINTS)

    def __init__(self, cfg: CfgNode) -> None:
        super().__init__(cfg)
        self.num_keypoints = cfg.MODEL.ROI_KEYPOINT_HEAD.NUM_KEYPOINTS
        # The keypoint RoIAlign pools the levels the box RoIAlign pools, as torchvision's does.
        featmap_names = list(self.roi_heads.box_roi_pool.featmap_names)
        for name, module in build_keypoint_branch(cfg, self.backbone.out_channels, featmap_names).items():
            setattr(self.roi_heads, name, module)
        if cfg.MODEL.CHANNELS_LAST:
            self.to(memory_format=torch.channels_last)

    def forward(
        self, images: torch.Tensor, targets: list[dict[str, Any]]
    ) -> dict[str, torch.Tensor] | list[dict[str, torch.Tensor]]:
        if self.training:
            self._check_keypoint_targets(targets)
        return super().forward(images, targets)

    def _check_keypoint_targets(self, targets: list[dict[str, Any]]) -> None:
        """One readable error for a batch the keypoint loss cannot use, instead of torchvision's KeyError or an
        index error deep inside ``keypointrcnn_loss``."""
        for target in targets:
            keypoints = target.get("keypoints")
            image = target.get("image_id", "?")
            if keypoints is None:
                raise DataError(f"KeypointRCNN trains on target['keypoints'], which image {image}'s target lacks: "
                                "train on a dataset with keypoints (COCO person keypoints, a YOLO pose set), or "
                                "use MODEL.META_ARCHITECTURE FasterRCNN for boxes only")
            expected = (len(target["boxes"]), self.num_keypoints, 3)
            if tuple(keypoints.shape) != expected:
                raise DataError(f"image {image}: target['keypoints'] has shape {tuple(keypoints.shape)}, expected "
                                f"{list(expected)} (boxes, MODEL.ROI_KEYPOINT_HEAD.NUM_KEYPOINTS, x/y/visibility): "
                                "set NUM_KEYPOINTS to the dataset's number of keypoints")
