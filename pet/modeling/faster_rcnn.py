"""Faster R-CNN: ResNet + FPN -> region proposal network -> RoI box head.

The parts are torchvision's, assembled from the config under the module names of
``torchvision.models.detection.fasterrcnn_resnet50_fpn`` (``backbone.body``,
``backbone.fpn``, ``rpn.head``, ``roi_heads.box_head``, ``roi_heads.box_predictor``), so
its weights load as they are and, with the same input, give torchvision's detections (bit-identical
to its model run channels-last, as Pet runs by default; tests/parity.py).
"""
from __future__ import annotations

from typing import Any

import torch
from fvcore.common.config import CfgNode
from torchvision.models.detection.image_list import ImageList

from pet.modeling.backbone import build_backbone, num_fpn_levels
from pet.modeling.postprocess import detections_to_original
from pet.modeling.preprocess import Normalizer, image_sizes
from pet.modeling.registry import META_ARCH_REGISTRY
from pet.modeling.roi_heads import build_roi_heads
from pet.modeling.rpn import build_rpn
from pet.modeling.state_dict_names import convert_state_dict
from pet.utils.timers import timed

__all__ = ["FasterRCNN"]


@META_ARCH_REGISTRY.register()
class FasterRCNN(torch.nn.Module):
    """Two-stage detector following Pet's batch contract.

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
    # state_dict prefixes of the parameters whose shapes follow MODEL.NUM_CLASSES: weights for another number
    # of classes re-initialise them when fine-tuning (pet.checkpoint.load_weights).
    class_dependent_prefixes: tuple[str, ...] = ("roi_heads.box_predictor.",)
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

    # Used by the weight loaders to rename torchvision classification weights.
    convert_state_dict = staticmethod(convert_state_dict)

    def forward(
        self, images: torch.Tensor, targets: list[dict[str, Any]]
    ) -> dict[str, torch.Tensor] | list[dict[str, torch.Tensor]]:
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
        return detections_to_original(detections, targets)
