"""Mask R-CNN: Faster R-CNN plus torchvision's mask branch.

The mask branch is built from ``MODEL.ROI_MASK_HEAD`` under the module names of
``torchvision.models.detection.maskrcnn_resnet50_fpn`` (``roi_heads.mask_roi_pool``,
``roi_heads.mask_head``, ``roi_heads.mask_predictor``), so its weights load as they are.
torchvision's RoIHeads runs the branch: ``maskrcnn_loss`` in training, ``maskrcnn_inference``
in eval mode; :func:`pet.modeling.postprocess.detections_to_original` pastes the masks
into the original images.
"""
from __future__ import annotations

from fvcore.common.config import CfgNode

from pet.modeling.faster_rcnn import FasterRCNN
from pet.modeling.registry import META_ARCH_REGISTRY
from pet.utils.errors import ConfigError

__all__ = ["MaskRCNN"]


@META_ARCH_REGISTRY.register()
class MaskRCNN(FasterRCNN):
    """Two-stage detector with instance masks, following Pet's batch contract.

    Training targets also carry ``masks`` (uint8 ``[N, h, w]`` 0/1 in the resized, unpadded
    image, in the order of ``boxes``; the data loader adds them with ``MODEL.MASK_ON``), and
    the losses gain ``loss_mask``. Eval mode adds ``masks`` to each image's detections:
    uint8 ``[N, H, W]`` 0/1 in the original image, binarised at probability 0.5.
    """

    mask_on = True
    target_fields = (*FasterRCNN.target_fields, "masks")
    class_dependent_prefixes = (*FasterRCNN.class_dependent_prefixes, "roi_heads.mask_predictor.mask_fcn_logits.")
    float_parts = (*FasterRCNN.float_parts, "roi_heads.mask_predictor")

    def __init__(self, cfg: CfgNode) -> None:
        if not cfg.MODEL.MASK_ON:
            raise ConfigError(f"MODEL.META_ARCHITECTURE {type(self).__name__} needs MODEL.MASK_ON True, so that "
                              "training samples carry the instance masks it learns from.")
        super().__init__(cfg)
