"""Faster R-CNN: ResNet + FPN -> region proposal network -> RoI box head.

The parts are torchvision's, assembled from the config under the module names of
``torchvision.models.detection.fasterrcnn_resnet50_fpn`` (``backbone.body``,
``backbone.fpn``, ``rpn.head``, ``roi_heads.box_head``, ``roi_heads.box_predictor``), so
its weights load as they are and, with the same input, give torchvision's detections (bit-identical
to its model run channels-last, as Pet runs by default; tests/support/against_reference.py).
"""
from __future__ import annotations

from typing import Any

import torch
from fvcore.common.config import CfgNode
from torchvision.models.detection.image_list import ImageList

from pet.modeling.backbone import build_backbone, num_fpn_levels
from pet.modeling.detector import Detector
from pet.modeling.postprocess import detections_to_original
from pet.modeling.preprocess import Normalizer, image_sizes
from pet.modeling.registry import META_ARCH_REGISTRY
from pet.modeling.roi_heads import build_roi_heads
from pet.modeling.rpn import build_rpn
from pet.utils.timers import timed

__all__ = ["FasterRCNN"]


@META_ARCH_REGISTRY.register()
class FasterRCNN(Detector):
    """Two-stage detector following Pet's batch contract (:class:`pet.modeling.detector.Detector`).

    ``forward(images, targets)``: ``images`` uint8 ``[B, 3, H, W]`` (padded), ``targets``
    per-image dicts with ``image_size`` / ``orig_size`` (and ``boxes`` / ``labels`` when
    training). Training mode returns the losses ``loss_objectness``, ``loss_rpn_box_reg``,
    ``loss_classifier`` and ``loss_box_reg``; eval mode returns per-image
    ``{"boxes", "scores", "labels"}`` with boxes in original-image pixels.
    """

    # Whether the RoI heads get torchvision's mask branch and learn from target["masks"] (MaskRCNN).
    mask_on: bool = False
    # The target fields the training forward hands to the RPN and RoI heads (MaskRCNN adds masks, KeypointRCNN
    # keypoints).
    target_fields: tuple[str, ...] = ("boxes", "labels")
    class_dependent_prefixes: tuple[str, ...] = ("roi_heads.box_predictor.",)
    score_thresh_key = "MODEL.ROI_HEADS.SCORE_THRESH_TEST"
    # The final box predictor (a few outputs per RoI) stays float under int8: int8 made the demo slower there (the
    # quantize / dequantize steps cost more than the small matrix products save; docs/deploy.md).
    float_parts: tuple[str, ...] = ("roi_heads.box_predictor",)
    # Builds roi_heads: (cfg, in_channels, featmap_names, mask=mask_on) -> module called as torchvision's RoIHeads
    # (CascadeRCNN swaps in its cascade).
    roi_heads_builder = staticmethod(build_roi_heads)

    def __init__(self, cfg: CfgNode) -> None:
        super().__init__()
        self.num_classes = cfg.MODEL.NUM_CLASSES
        self.normalizer = Normalizer(cfg)
        self.backbone = build_backbone(cfg)
        channels = self.backbone.out_channels
        self.rpn = build_rpn(cfg, channels, num_fpn_levels(cfg))
        featmap_names = [str(i) for i in range(len(cfg.MODEL.FPN.RETURNED_LAYERS))]
        self.roi_heads = self.roi_heads_builder(cfg, channels, featmap_names, mask=self.mask_on)
        if cfg.MODEL.CHANNELS_LAST:
            self.to(memory_format=torch.channels_last)

    @property
    def score_thresh(self) -> float:  # type: ignore[override]
        return self.roi_heads.score_thresh

    @score_thresh.setter
    def score_thresh(self, value: float) -> None:
        self.roi_heads.score_thresh = value

    @property
    def detections_per_img(self) -> int:  # type: ignore[override]
        return self.roi_heads.detections_per_img

    @detections_per_img.setter
    def detections_per_img(self, value: int) -> None:
        self.roi_heads.detections_per_img = value

    def forward(
        self, images: torch.Tensor, targets: list[dict[str, Any]]
    ) -> dict[str, torch.Tensor] | list[dict[str, torch.Tensor]]:
        return self._forward(images, targets, to_original=True)

    def network_detections(self, images: torch.Tensor, targets: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return self._forward(images, targets, to_original=False)

    def _forward(self, images: torch.Tensor, targets: list[dict[str, Any]], to_original: bool) -> Any:
        sizes = image_sizes(targets)
        x = self.normalizer(images, sizes)
        gt = [{k: t[k] for k in self.target_fields} for t in targets] if self.training else None
        with timed("backbone"):
            features = self.backbone(x)
        with timed("rpn"):
            proposals, rpn_losses = self.rpn(ImageList(x, sizes), features, gt)
        with timed("roi_heads"):
            detections, head_losses = self.roi_heads(features, proposals, sizes, gt)
        if self.training:
            return {**rpn_losses, **head_losses}
        return detections_to_original(detections, targets) if to_original else detections
