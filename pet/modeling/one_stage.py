"""What Pet's one-stage detectors (RetinaNet, FCOS) share: the forward pass and torchvision's constructor arguments.

They subclass torchvision's ``RetinaNet`` / ``FCOS`` for its parts and for its loss and
post-processing methods (``compute_loss``, ``postprocess_detections``); only ``forward``
is replaced, by Pet's batch contract: the data loader has already resized and padded the
images, the model normalises them (:class:`~pet.modeling.preprocess.Normalizer`) and maps
its detections back to the original images
(:func:`~pet.modeling.postprocess.detections_to_original`).
"""
from __future__ import annotations

from typing import Any

import torch
from fvcore.common.config import CfgNode
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.image_list import ImageList

from pet.modeling.backbone import build_backbone
from pet.modeling.detector import Detector
from pet.modeling.postprocess import detections_to_original
from pet.modeling.preprocess import Normalizer, image_sizes
from pet.modeling.registry import DENSE_HEAD_REGISTRY
from pet.utils.tensor import at_least_float32
from pet.utils.timers import timed

__all__ = ["OneStageDetector", "torchvision_args"]


def torchvision_args(cfg: CfgNode, node: CfgNode, anchors: AnchorGenerator) -> dict[str, Any]:
    """The constructor arguments torchvision's ``RetinaNet`` and ``FCOS`` share, from the detector's config
    ``node`` (``MODEL.RETINANET`` / ``MODEL.FCOS``): the backbone, ``anchors``, the ``node.HEAD_NAME`` dense head
    and the test-time thresholds. Each detector adds its own (IoU thresholds, centre sampling).

    The head has ``NUM_CLASSES + 1`` outputs, like torchvision's COCO models (see :func:`_without_background`).
    """
    backbone = build_backbone(cfg)
    num_classes = cfg.MODEL.NUM_CLASSES + 1
    head = DENSE_HEAD_REGISTRY.get(node.HEAD_NAME)(cfg, backbone.out_channels,
                                                   anchors.num_anchors_per_location()[0], num_classes)
    return {
        "backbone": backbone,
        "num_classes": num_classes,
        "anchor_generator": anchors,
        "head": head,
        "score_thresh": node.SCORE_THRESH_TEST,
        "nms_thresh": node.NMS_THRESH_TEST,
        "detections_per_img": node.DETECTIONS_PER_IMAGE,
        "topk_candidates": node.TOPK_CANDIDATES,
    }


class OneStageDetector(Detector):
    """The :class:`~pet.modeling.detector.Detector` base listed before torchvision's detector class:
    ``forward(images, targets)`` in Pet's batch contract (see :class:`pet.modeling.FasterRCNN`) on top of
    torchvision's methods.

    Subclasses pass :func:`torchvision_args` to torchvision's ``__init__`` (which sets ``backbone``,
    ``anchor_generator`` and ``head``), then call :meth:`use_pet_inputs`. Training uses torchvision's
    ``compute_loss``. The test-time timers are ``backbone``, ``head`` (the head's convolutions and the
    anchors they refer to) and ``postprocess``.
    """

    normalizer: Normalizer
    num_classes: int  # MODEL.NUM_CLASSES (the head has one more output, see _without_background)
    backbone: torch.nn.Module
    anchor_generator: AnchorGenerator
    head: torch.nn.Module
    training: bool

    class_dependent_prefixes: tuple[str, ...] = ("head.classification_head.cls_logits.",)
    # torchvision's FCOS.compute_loss also takes the number of anchors of each level (its size ranges are per
    # level); RetinaNet's does not.
    loss_takes_anchors_per_level = False

    def use_pet_inputs(self, cfg: CfgNode) -> None:
        """Called at the end of ``__init__``: torchvision's resizing transform goes (the data loader
        resizes), the :class:`Normalizer` normalises, and the weights go channels-last when asked."""
        del self.transform
        self.num_classes = cfg.MODEL.NUM_CLASSES
        self.normalizer = Normalizer(cfg)
        if cfg.MODEL.CHANNELS_LAST:
            self.to(memory_format=torch.channels_last)  # type: ignore[attr-defined]

    def forward(
        self, images: torch.Tensor, targets: list[dict[str, Any]]
    ) -> dict[str, torch.Tensor] | list[dict[str, torch.Tensor]]:
        return self._forward(images, targets, to_original=True)

    def network_detections(self, images: torch.Tensor, targets: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return self._forward(images, targets, to_original=False)

    def _forward(self, images: torch.Tensor, targets: list[dict[str, Any]], to_original: bool) -> Any:
        sizes = image_sizes(targets)
        x = self.normalizer(images, sizes)
        with timed("backbone"):
            features = list(self.backbone(x).values())
        with timed("head"):
            # Box outputs in float32, as Pet's RPN and box predictor: under bfloat16 autocast the deltas would
            # be decoded in bfloat16, putting boxes on a whole-pixel grid. Class logits enter the training loss
            # in the autocast dtype, as torchvision's do (the focal loss casts to float32 where it matters;
            # float32 logits over every anchor and class cost RetinaNet ~9% of a bfloat16 step at 800x1333),
            # and are scored in float32 at test time.
            head_outputs = {name: out if self.training and name == "cls_logits" else at_least_float32(out)
                            for name, out in self.head(features).items()}
            anchors = self.anchor_generator(ImageList(x, sizes), [_float32_shape_of(f) for f in features])
        per_location = self.anchor_generator.num_anchors_per_location()
        num_anchors_per_level = [f.shape[-2] * f.shape[-1] * a for f, a in zip(features, per_location)]
        if self.training:
            gt = [{"boxes": t["boxes"], "labels": t["labels"]} for t in targets]
            # torchvision's names with Pet's "loss_" prefix, which writers and curves.png use to find the loss terms
            per_level = (num_anchors_per_level,) if self.loss_takes_anchors_per_level else ()
            losses = self.compute_loss(gt, head_outputs, anchors, *per_level)  # type: ignore[attr-defined]
            return {f"loss_{name}": value for name, value in losses.items()}
        with timed("postprocess"):
            split_outputs = {name: list(out.split(num_anchors_per_level, dim=1)) for name, out in head_outputs.items()}
            split_anchors = [list(a.split(num_anchors_per_level)) for a in anchors]
            detections = self.postprocess_detections(split_outputs, split_anchors, sizes)  # type: ignore[attr-defined]
            detections = [_without_background(d) for d in detections]
            return detections_to_original(detections, targets) if to_original else detections


def _float32_shape_of(feature: torch.Tensor) -> torch.Tensor:
    """An empty float32 tensor with ``feature``'s height and width.

    AnchorGenerator takes the anchors' dtype from the feature maps; given bfloat16 maps (autocast)
    it would round anchor corners, and so every decoded box, to 2 px at 256-511 px.
    """
    return feature.new_empty((0, 0, *feature.shape[-2:]), dtype=torch.float32)


def _without_background(detections: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``detections`` without label 0.

    torchvision's one-stage heads have ``NUM_CLASSES + 1`` sigmoid outputs, as its COCO models
    (91, the first for COCO's unused category 0), so that its weights load; output 0 is never a
    training positive, so trained models hardly ever score it, and COCO evaluation ignores it.
    Pet's labels are 1..NUM_CLASSES. Dropping after torchvision's top-k, NMS and per-image cap
    (rather than masking the output before) keeps the other detections exactly torchvision's.
    """
    keep = detections["labels"] > 0
    return {name: value[keep] for name, value in detections.items()}
