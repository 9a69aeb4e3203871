"""The registries a model is assembled from; each is selected by a config key.

==============================  ================================  =====================================================
registry                        config key                        an entry is called as
==============================  ================================  =====================================================
``META_ARCH_REGISTRY``          ``MODEL.META_ARCHITECTURE``       ``Entry(cfg) -> nn.Module``
``BACKBONE_REGISTRY``           ``MODEL.BACKBONE.TYPE``           ``entry(cfg) -> nn.Module``
``RPN_HEAD_REGISTRY``           ``MODEL.RPN.HEAD_NAME``           ``Entry(cfg, in_channels, num_anchors) -> nn.Module``
``ROI_BOX_HEAD_REGISTRY``       ``MODEL.ROI_BOX_HEAD.NAME``       ``Entry(cfg, in_channels) -> nn.Module``
``ROI_MASK_HEAD_REGISTRY``      ``MODEL.ROI_MASK_HEAD.NAME``      ``Entry(cfg, in_channels) -> nn.Module``
``ROI_KEYPOINT_HEAD_REGISTRY``  ``MODEL.ROI_KEYPOINT_HEAD.NAME``  ``Entry(cfg, in_channels) -> nn.Module``
``DENSE_HEAD_REGISTRY``         ``MODEL.RETINANET.HEAD_NAME``,    ``Entry(cfg, in_channels, num_anchors, num_classes)``
                                ``MODEL.FCOS.HEAD_NAME``          ``-> nn.Module``
==============================  ================================  =====================================================

What each entry must return (``in_channels`` is the backbone's ``out_channels``; ``A`` = ``num_anchors``
anchors per feature-map cell; ``R`` RoIs):

- **meta-architecture**: a detector following Pet's batch contract (see :class:`pet.modeling.FasterRCNN`).
- **backbone**: a module mapping normalised images ``[B, 3, H, W]`` to an ordered dict of feature maps
  with an ``out_channels`` attribute (channels of every map). The built-in ``resnet_fpn`` returns
  torchvision's ``BackboneWithFPN``: the ResNet as ``body``, the FPN as ``fpn``.
- **RPN head**: ``forward(features: list[Tensor]) -> (objectness, box_deltas)``, per level
  ``[B, A, h, w]`` and ``[B, 4 * A, h, w]``, as torchvision's ``RPNHead``. The default ``RPNHead`` returns them
  in float32 so that proposals are not decoded in bfloat16 under autocast; a new head should too.
- **RoI box head**: pooled features ``[R, in_channels, S, S]`` (S = ``MODEL.ROI_BOX_HEAD.POOLER_RESOLUTION``)
  to ``[R, MODEL.ROI_BOX_HEAD.MLP_DIM]``; the box predictor follows it.
- **RoI mask head**: pooled features ``[R, in_channels, M, M]`` (M = ``MODEL.ROI_MASK_HEAD.POOLER_RESOLUTION``)
  to ``[R, out_channels, M, M]``, with an ``out_channels`` attribute: the mask predictor (2x deconvolution
  and per-class logits) is built on it.
- **RoI keypoint head**: pooled features ``[R, in_channels, P, P]`` (P = ``MODEL.ROI_KEYPOINT_HEAD.POOLER_RESOLUTION``)
  to ``[R, out_channels, P, P]``, with an ``out_channels`` attribute: the keypoint predictor (2x deconvolution
  to one heatmap logit map per keypoint, then 2x bilinear up-sampling) is built on it.
- **dense head** (one-stage detectors): ``forward(features: list[Tensor]) -> dict`` of tensors over all
  levels' anchors concatenated, ``"cls_logits"`` ``[B, sum(h * w * A), num_classes]`` and
  ``"bbox_regression"`` ``[B, sum(h * w * A), 4]`` (FCOS also ``"bbox_ctrness"`` ``[B, sum(h * w * A), 1]``),
  plus ``compute_loss(targets, head_outputs, anchors, matched_idxs) -> dict`` of losses, which the
  detector calls after matching anchors to boxes. Subclassing torchvision's ``RetinaNetHead`` / ``FCOSHead``
  provides both. The heads of the two detectors are not interchangeable (different outputs and losses), so
  each detector has its own key; they share the registry because they are called the same way.

Any entry may also be named in YAML by a dotted import path (``my_pkg.heads.MyHead``).

**Swapping the neck.** There is no separate neck registry: the backbone entry builds the ResNet and its
FPN together, because the FPN's inputs are ResNet stages and its levels must match the anchors'
(``MODEL.FPN.RETURNED_LAYERS`` and ``MODEL.FPN.TOP_BLOCK`` set both). A new neck is a backbone entry that
reuses :func:`pet.modeling.backbone.build_resnet` and :func:`~pet.modeling.backbone.freeze_stages` and
returns a module that keeps the ResNet under the name ``body`` (ImageNet ResNet weights load into
``backbone.body``), has ``out_channels``, and returns as many levels as ``MODEL.FPN.RETURNED_LAYERS`` and
``TOP_BLOCK`` describe, finest first (``tests/modeling/test_modeling.py`` has a complete one)::

    @BACKBONE_REGISTRY.register()
    def resnet_my_neck(cfg):
        resnet, channels = build_resnet(cfg.MODEL.BACKBONE.NAME, cfg.MODEL.BACKBONE.NORM)
        freeze_stages(resnet, cfg.MODEL.BACKBONE.FREEZE_AT)
        return ResNetWithMyNeck(resnet, channels, cfg.MODEL.FPN.OUT_CHANNELS)  # .body, .neck, .out_channels
"""
from pet.modeling.build import META_ARCH_REGISTRY
from pet.utils.registry import Registry

__all__ = [
    "META_ARCH_REGISTRY",
    "BACKBONE_REGISTRY",
    "RPN_HEAD_REGISTRY",
    "ROI_BOX_HEAD_REGISTRY",
    "ROI_MASK_HEAD_REGISTRY",
    "ROI_KEYPOINT_HEAD_REGISTRY",
    "DENSE_HEAD_REGISTRY",
]

BACKBONE_REGISTRY = Registry("backbone")
RPN_HEAD_REGISTRY = Registry("RPN head")
ROI_BOX_HEAD_REGISTRY = Registry("RoI box head")
ROI_MASK_HEAD_REGISTRY = Registry("RoI mask head")
ROI_KEYPOINT_HEAD_REGISTRY = Registry("RoI keypoint head")
DENSE_HEAD_REGISTRY = Registry("dense head")
