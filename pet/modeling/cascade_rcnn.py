"""Cascade R-CNN and Cascade Mask R-CNN: Faster / Mask R-CNN whose RoI heads are a cascade of box stages
(:mod:`pet.modeling.cascade_roi_heads`, which says where Pet follows detectron2 and where MMDetection differs).

The backbone, RPN and mask branch are Faster / Mask R-CNN's, under the same module names; the box branch is
``roi_heads.box_head.{k}`` and ``roi_heads.box_predictor.{k}`` per stage ``k``. Training losses are the RPN's
plus ``loss_classifier_stage{k}`` and ``loss_box_reg_stage{k}`` per stage (and ``loss_mask``); eval mode returns
Pet's detections as Faster R-CNN does.
"""
from __future__ import annotations

from pet.modeling.cascade_roi_heads import build_cascade_roi_heads
from pet.modeling.faster_rcnn import FasterRCNN
from pet.modeling.mask_rcnn import MaskRCNN
from pet.modeling.registry import META_ARCH_REGISTRY

__all__ = ["CascadeRCNN", "CascadeMaskRCNN"]


@META_ARCH_REGISTRY.register()
class CascadeRCNN(FasterRCNN):
    """Faster R-CNN with ``MODEL.ROI_BOX_CASCADE_HEAD``'s stages in place of its single box head."""

    roi_heads_builder = staticmethod(build_cascade_roi_heads)


@META_ARCH_REGISTRY.register()
class CascadeMaskRCNN(CascadeRCNN, MaskRCNN):
    """Cascade R-CNN with Mask R-CNN's mask branch (needs ``MODEL.MASK_ON True``), run on the last stage's boxes.

    Its ``mask_on``, ``class_dependent_prefixes`` and ``MODEL.MASK_ON`` check are MaskRCNN's (next in the MRO).
    """
