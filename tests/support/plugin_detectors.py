"""Detectors that live outside Pet: what a researcher's plugin module looks like
(tests/modeling/test_plugin_detectors.py trains, tests, predicts with, exports and quantizes each of them through the
tools).

Named in YAML by dotted path (``MODEL.META_ARCHITECTURE: support.plugin_detectors.CenterDetector``), this module is
imported while the config loads, and :func:`add_config` adds ``MODEL.CENTER`` to the defaults before the YAML is merged.
Nothing in pet/ knows about it: each detector answers what Pet asks through :class:`pet.modeling.Detector`'s
contract, and :class:`CenterGraph` is its ONNX export graph, registered for its class.

- :class:`KeypointPlugin`, :class:`FCOSPlugin`, :class:`RTDETRPlugin`: a subclass of one of Pet's families each
  (two-stage, one-stage, RT-DETR), inheriting the family's answers and export graph;
- :class:`CenterDetector`: a new family, CenterNet-like: one stride-8 feature map, per cell a sigmoid score per
  class and the distances from the cell's centre to the four sides of its box.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from fvcore.common.config import CfgNode
from torch import Tensor, nn
from torchvision.ops import clip_boxes_to_image, generalized_box_iou_loss, sigmoid_focal_loss

from pet.modeling import FCOS, RTDETR, Detector, KeypointRCNN
from pet.modeling.export_graph import DetectorGraph, clip_to_images, padded_topk, register_export_graph
from pet.modeling.postprocess import detections_to_original
from pet.modeling.preprocess import Normalizer, image_sizes

__all__ = ["add_config", "KeypointPlugin", "FCOSPlugin", "RTDETRPlugin", "CenterDetector", "CenterGraph"]


def add_config(cfg: CfgNode) -> None:
    """The keys of :class:`CenterDetector`, added to the defaults before the YAML is merged."""
    cfg.MODEL.CENTER = CfgNode()
    # Channels of the backbone's convolutions.
    cfg.MODEL.CENTER.CHANNELS = 32
    # A (cell, class) scoring at or below it is dropped inside the model (and its export).
    cfg.MODEL.CENTER.SCORE_THRESH_TEST = 0.05
    # The best (cell, class) pairs kept per image.
    cfg.MODEL.CENTER.DETECTIONS_PER_IMAGE = 100


# ------------------------------------------------------------------------------------------ Pet's families
class KeypointPlugin(KeypointRCNN):
    """Keypoint R-CNN under another name: the two-stage family, keypoints included (a subclass of the keypoint model
    must still learn, predict and name its keypoints)."""


class FCOSPlugin(FCOS):
    """FCOS under another name: the one-stage family."""


class RTDETRPlugin(RTDETR):
    """RT-DETR under another name: the RT-DETR family (sides padded to multiples of 32, no NMS)."""


# ------------------------------------------------------------------------------------------ a new family
class CenterBackbone(nn.Module):
    """Three stride-2 3x3 convolutions and one more, ReLU after each: ``{"0": feature}`` at stride 8."""

    stride = 8

    def __init__(self, channels: int) -> None:
        super().__init__()
        widths = [3, channels // 2, channels, channels, channels]
        strides = [2, 2, 2, 1]
        layers: list[nn.Module] = []
        for c_in, c_out, stride in zip(widths, widths[1:], strides):
            layers += [nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1), nn.ReLU(inplace=True)]
        self.body = nn.Sequential(*layers)
        self.out_channels = channels

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        return {"0": self.body(x)}


class CenterHead(nn.Module):
    """Per cell: ``cls`` one logit per class, ``box`` the log-distances (in strides) from the cell's centre to the
    box's left, top, right and bottom sides."""

    def __init__(self, channels: int, num_classes: int, prior: float = 0.01) -> None:
        super().__init__()
        self.cls = nn.Conv2d(channels, num_classes, 3, padding=1)
        self.box = nn.Conv2d(channels, 4, 3, padding=1)
        nn.init.normal_(self.cls.weight, std=0.01)
        nn.init.constant_(self.cls.bias, -math.log((1 - prior) / prior))
        nn.init.normal_(self.box.weight, std=0.01)
        nn.init.constant_(self.box.bias, 1.0)  # sides e strides (~22 px) from the centre to start with

    def forward(self, feature: Tensor) -> tuple[Tensor, Tensor]:
        return self.cls(feature), self.box(feature)


# exp() of at most this: a distance of e^8 strides is far beyond any image.
MAX_LOG_DISTANCE = 8.0


def cell_centres(height: int, width: int, stride: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """x ``[W]`` and y ``[H]`` of the cells' centres, in input pixels."""
    xs = (torch.arange(width, device=device, dtype=torch.float32) + 0.5) * stride
    ys = (torch.arange(height, device=device, dtype=torch.float32) + 0.5) * stride
    return xs, ys


def distances_to_boxes(distances: Tensor, x: Tensor, y: Tensor, stride: int) -> Tensor:
    """XYXY boxes ``[..., 4]`` of the head's ``box`` outputs ``[..., 4]`` at cell centres ``x``, ``y`` ``[...]``."""
    left, top, right, bottom = (distances.float().clamp(max=MAX_LOG_DISTANCE).exp() * stride).unbind(-1)
    return torch.stack([x - left, y - top, x + right, y + bottom], dim=-1)


class CenterDetector(Detector):
    """One box per cell of a stride-8 map: the cell holding a box's centre is positive for its class.

    Training returns ``loss_cls`` (sigmoid focal loss over every cell and class, per positive) and ``loss_box``
    (GIoU of the positive cells' boxes). Eval returns per image the ``DETECTIONS_PER_IMAGE`` best (cell, class)
    scores above ``SCORE_THRESH_TEST``, boxes clipped to the image: no NMS (a box has one centre cell).
    """

    score_thresh_key = "MODEL.CENTER.SCORE_THRESH_TEST"
    class_dependent_prefixes = ("head.cls.",)
    # The box distances go through exp(): int8 steps there would be steps of whole pixels. The head's classifier and
    # the backbone quantize.
    float_parts = ("head.box",)

    def __init__(self, cfg: CfgNode) -> None:
        super().__init__()
        node = cfg.MODEL.CENTER
        self.num_classes = cfg.MODEL.NUM_CLASSES
        self.score_thresh = float(node.SCORE_THRESH_TEST)
        self.detections_per_img = int(node.DETECTIONS_PER_IMAGE)
        self.normalizer = Normalizer(cfg)
        self.backbone = CenterBackbone(node.CHANNELS)
        self.stride = self.backbone.stride
        self.head = CenterHead(node.CHANNELS, self.num_classes)
        if cfg.MODEL.CHANNELS_LAST:
            self.to(memory_format=torch.channels_last)

    def forward(self, images: Tensor, targets: list[dict[str, Any]]) -> dict[str, Tensor] | list[dict[str, Tensor]]:
        if self.training:
            cls_logits, box_out = self.head(self.backbone(self.normalizer(images, image_sizes(targets)))["0"])
            return self.losses(cls_logits, box_out, targets)
        return detections_to_original(self.network_detections(images, targets), targets)

    def losses(self, cls_logits: Tensor, box_out: Tensor, targets: list[dict[str, Any]]) -> dict[str, Tensor]:
        num_images, num_classes, height, width = cls_logits.shape
        wanted = torch.zeros(num_images, num_classes, height, width, device=cls_logits.device)
        predicted, boxes = [], []
        xs, ys = cell_centres(height, width, self.stride, cls_logits.device)
        for i, target in enumerate(targets):
            gt = target["boxes"].float()
            if not len(gt):
                continue
            col = ((gt[:, 0] + gt[:, 2]) / 2 / self.stride).long().clamp(0, width - 1)
            row = ((gt[:, 1] + gt[:, 3]) / 2 / self.stride).long().clamp(0, height - 1)
            wanted[i, target["labels"] - 1, row, col] = 1.0
            distances = box_out[i][:, row, col].permute(1, 0)  # [N, 4]
            predicted.append(distances_to_boxes(distances, xs[col], ys[row], self.stride))
            boxes.append(gt)
        positives = max(1, sum(len(b) for b in boxes))
        loss_cls = sigmoid_focal_loss(cls_logits.float(), wanted, reduction="sum") / positives
        if boxes:
            loss_box = generalized_box_iou_loss(torch.cat(predicted), torch.cat(boxes), reduction="sum") / positives
        else:
            loss_box = box_out.sum() * 0.0
        return {"loss_cls": loss_cls, "loss_box": loss_box}

    def network_detections(self, images: Tensor, targets: list[dict[str, Any]]) -> list[dict[str, Tensor]]:
        sizes = image_sizes(targets)
        cls_logits, box_out = self.head(self.backbone(self.normalizer(images, sizes))["0"])
        num_classes, height, width = cls_logits.shape[1:]
        xs, ys = cell_centres(height, width, self.stride, cls_logits.device)
        detections = []
        for logits, distances, (h, w) in zip(cls_logits, box_out, sizes):
            # (cell, class) in (y, x, class) order; cells whose centre lies in the padding score 0.
            inside = (ys[:, None] < h) & (xs[None, :] < w)
            scores = (logits.float().sigmoid().permute(1, 2, 0) * inside[..., None]).reshape(-1)
            scores, index = scores.topk(min(self.detections_per_img, scores.numel()))
            keep = scores > self.score_thresh
            scores, index = scores[keep], index[keep]
            cell, labels = index // num_classes, index % num_classes + 1
            row, col = cell // width, cell % width
            boxes = distances_to_boxes(distances[:, row, col].permute(1, 0), xs[col], ys[row], self.stride)
            detections.append({"boxes": clip_boxes_to_image(boxes, (h, w)), "scores": scores, "labels": labels})
        return detections


@register_export_graph(CenterDetector)
class CenterGraph(DetectorGraph):
    """:class:`CenterDetector`'s eval computation on the whole batch: the top-k of each image padded to exactly
    ``DETECTIONS_PER_IMAGE``, then what scores above the threshold, grouped by image by decreasing score."""

    def __init__(self, model: CenterDetector, example_images: Tensor, example_sizes: list[tuple[int, int]]) -> None:
        super().__init__(model, example_images, example_sizes)
        self.head = model.head
        self.stride = model.stride
        self.score_thresh = model.score_thresh
        self.detections_per_img = model.detections_per_img

    def forward(self, images: Tensor, image_sizes: Tensor) -> tuple[Tensor, ...]:
        cls_logits, box_out = self.head(self.features(images, image_sizes)["0"])
        num_images, num_classes, height, width = cls_logits.shape
        xs, ys = cell_centres(height, width, self.stride, cls_logits.device)
        inside = ((ys[None, :, None] < image_sizes[:, 0, None, None])
                  & (xs[None, None, :] < image_sizes[:, 1, None, None]))
        scores = cls_logits.float().sigmoid().permute(0, 2, 3, 1) * inside[..., None]
        scores, index, exists = padded_topk(scores.reshape(num_images, -1), self.detections_per_img)
        cell = index // num_classes
        labels = index - cell * num_classes + 1
        row = cell // width
        col = cell - row * width  # not %: the ONNX exporter has no remainder by a symbolic size
        distances = box_out.permute(0, 2, 3, 1).reshape(num_images, -1, 4).gather(1, cell[..., None].expand(-1, -1, 4))
        boxes = clip_to_images(distances_to_boxes(distances, xs[col], ys[row], self.stride), image_sizes)
        image_index = torch.arange(num_images, device=scores.device)[:, None].expand_as(scores)
        keep = exists & (scores > self.score_thresh)
        return boxes[keep], scores[keep], labels[keep], image_index[keep]
