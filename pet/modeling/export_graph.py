"""Pet's detectors' inference as one batched tensor program, the form an ONNX graph can hold, and the registry
that finds a detector's graph.

A detector family registers its graph for its class (``@register_export_graph(MyDetector)``), and a subclass
inherits it: :func:`build_export_graph` takes the graph of the nearest class in the model's MRO that has one.
Every graph is built as ``Graph(model, example_images, example_sizes)``, has ``output_names`` and
``size_multiple``, and ``features(images, image_sizes)`` (the exporter finds the smallest input size with it).

The PyTorch models post-process image by image in Python (``for image in batch``), which an exporter
would unroll into a graph of one fixed batch size. :func:`build_graph` wraps the same modules, with the
same weights, in a module whose every step after the network (anchor decoding, per-level top-k,
thresholds, class-wise NMS, the per-image caps, the mask branch) works on the whole batch at once:
candidates of all images are flattened together, each with its image index, and NMS keeps images and
classes (or levels) apart by offsetting their boxes, as torchvision's ``batched_nms`` keeps classes apart.

Inputs are Pet's batch tensors: ``images`` uint8 ``[B, 3, H, W]`` (padded) and ``image_sizes`` int64
``[B, 2]`` (``(h, w)`` of each image before padding, the targets' ``image_size``). Outputs are the
detections of the whole batch, grouped by image in batch order, by decreasing score within an image:

- ``boxes`` float32 ``[N, 4]``: XYXY in the pixels of the network input (the resized image), clipped to
  its ``image_size``. :func:`pet.modeling.postprocess.detections_to_original` maps them to the original
  image (:class:`pet.deploy.onnxruntime_model.OnnxRuntimeModel` does);
- ``scores`` float32 ``[N]``; ``labels`` int64 ``[N]`` (1..NUM_CLASSES); ``image_index`` int64 ``[N]``;
- Mask R-CNN and Cascade Mask R-CNN only: ``masks`` float32 ``[N, 1, M, M]``, each detection's mask
  probabilities for its class (``M`` = 2 x ``MODEL.ROI_MASK_HEAD.POOLER_RESOLUTION``, 28 by default), to be
  pasted into its box (:func:`pet.modeling.postprocess.paste_masks`);
- Keypoint R-CNN only: ``keypoint_heatmaps`` float32 ``[N, K, H, H]``, each detection's heatmap logits
  (``H`` = 4 x ``MODEL.ROI_KEYPOINT_HEAD.POOLER_RESOLUTION``, 56 by default), to be decoded into keypoints in its
  box (:func:`pet.modeling.keypoint_head.decode_heatmaps`, torchvision's ``heatmaps_to_keypoints``). The decoding
  resizes each heatmap to its box's size in pixels, a size that differs per detection: torch.export, which Pet
  exports with, cannot hold that (torchvision's ONNX path for it is a TorchScript loop for the legacy tracer),
  and a batched form would need image-sized maps per keypoint. So the graph ends at the heatmaps, as it ends at
  the mask probabilities, and the runtime decodes them with the PyTorch model's own function.

For the same input the detections are the PyTorch model's up to float rounding: thresholds, top-k and
caps are applied in the same order and with the same comparisons (``>`` or ``>=``) as torchvision's code.
Only the anchors and boxes of the top-k candidates of each level are computed, not those of every anchor.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor
from torchvision.ops import nms, roi_align
from torchvision.ops.poolers import MultiScaleRoIAlign, _setup_scales

from pet.modeling.cascade_rcnn import CascadeRCNN
from pet.modeling.detector import Detector
from pet.modeling.faster_rcnn import FasterRCNN
from pet.modeling.fcos import FCOS
from pet.modeling.retinanet import RetinaNet

__all__ = ["DetectorGraph", "TwoStageGraph", "CascadeGraph", "OneStageGraph", "FCOSGraph", "build_export_graph",
           "register_export_graph"]

GraphClass = TypeVar("GraphClass", bound="type[DetectorGraph]")
_EXPORT_GRAPHS: dict[type, type[DetectorGraph]] = {}


def register_export_graph(detector: type[Detector]) -> Callable[[GraphClass], GraphClass]:
    """Class decorator: the decorated graph class exports ``detector`` and, unless they register their own, its
    subclasses."""
    def register(graph: GraphClass) -> GraphClass:
        _EXPORT_GRAPHS[detector] = graph
        return graph
    return register


def build_export_graph(model: torch.nn.Module, example_images: Tensor,
                       example_sizes: list[tuple[int, int]]) -> DetectorGraph:
    """The batched graph of ``model`` in eval mode: the one registered for the nearest class in its MRO.

    ``example_images`` and ``example_sizes`` (a batch as the test loader gives it) fix what torchvision infers on
    its first call (the two-stage RoI poolers' feature-map scales).
    """
    graph = next((_EXPORT_GRAPHS[cls] for cls in type(model).__mro__ if cls in _EXPORT_GRAPHS), None)
    if graph is None:
        raise TypeError(f"{type(model).__name__} has no ONNX export graph: register one for its class with "
                        "pet.modeling.export_graph.register_export_graph (a subclass of one of Pet's detectors "
                        "inherits its family's).")
    model.eval()
    return graph(model, example_images, example_sizes).eval()


class DetectorGraph(torch.nn.Module):
    """What the batched detectors share: the backbone and the normalisation. ``output_names`` names the outputs."""

    output_names: tuple[str, ...] = ("boxes", "scores", "labels", "image_index")
    # What the padded height and width must be a multiple of (1: any size above the smallest).
    size_multiple: int = 1

    def __init__(self, model: torch.nn.Module, example_images: Tensor, example_sizes: list[tuple[int, int]]) -> None:
        super().__init__()
        self.backbone = model.backbone
        self.register_buffer("mean", model.normalizer.mean.clone(), persistent=False)
        self.register_buffer("std", model.normalizer.std.clone(), persistent=False)

    def features(self, images: Tensor, image_sizes: Tensor) -> dict[str, Tensor]:
        """The backbone's feature maps of the images normalised as :class:`pet.modeling.preprocess.Normalizer`
        does: ``(x / 255 - mean) / std``, the padding set to 0."""
        x = (images.float() / 255 - self.mean) / self.std
        rows = torch.arange(x.shape[2], device=x.device)[None, :, None]
        cols = torch.arange(x.shape[3], device=x.device)[None, None, :]
        inside = (rows < image_sizes[:, 0, None, None]) & (cols < image_sizes[:, 1, None, None])
        return self.backbone(torch.where(inside[:, None], x, torch.zeros_like(x)))


@register_export_graph(FasterRCNN)
class TwoStageGraph(DetectorGraph):
    """Faster, Mask and Keypoint R-CNN: the RPN's proposals, then the RoI heads, batched. ``box_predictions`` is
    the box branch (the cascade's in :class:`CascadeGraph`), ``detections`` the post-processing they share."""

    def __init__(self, model: FasterRCNN, example_images: Tensor, example_sizes: list[tuple[int, int]]) -> None:
        super().__init__(model, example_images, example_sizes)
        with torch.no_grad():
            example_features = model.backbone(model.normalizer(example_images, example_sizes))
        self.rpn = model.rpn
        self.roi_heads = model.roi_heads
        self.box_pooler = BatchedRoIAlign(self.roi_heads.box_roi_pool, example_features, example_sizes)
        self.mask_on = self.roi_heads.has_mask()
        self.keypoint_on = self.roi_heads.has_keypoint()
        if self.mask_on:
            self.mask_pooler = BatchedRoIAlign(self.roi_heads.mask_roi_pool, example_features, example_sizes)
            self.output_names = (*self.output_names, "masks")
        if self.keypoint_on:
            self.keypoint_pooler = BatchedRoIAlign(self.roi_heads.keypoint_roi_pool, example_features, example_sizes)
            self.output_names = (*self.output_names, "keypoint_heatmaps")

    def forward(self, images: Tensor, image_sizes: Tensor) -> tuple[Tensor, ...]:
        features = self.features(images, image_sizes)
        rois = self.proposals(list(features.values()), images.shape[-2:], image_sizes)
        boxes, scores, labels, image_index = self.detections(features, rois, image_sizes, max(images.shape[-2:]))
        outputs: tuple[Tensor, ...] = (boxes, scores, labels, image_index)
        if self.mask_on:
            outputs = (*outputs, self.masks(features, boxes, labels, image_index))
        if self.keypoint_on:
            outputs = (*outputs, self.keypoint_heatmaps(features, boxes, image_index))
        return outputs

    def proposals(self, features: list[Tensor], padded_size: tuple[int, int], image_sizes: Tensor) -> Tensor:
        """The RPN's proposals as RoIs ``[R, 5]`` (image index, XYXY), as torchvision's ``filter_proposals``
        selects them: the ``PRE_NMS_TOPK_TEST`` best anchors of each level, clipped, small and low-scoring
        ones dropped, NMS per level, the ``POST_NMS_TOPK_TEST`` best of each image."""
        rpn = self.rpn
        pre_nms_top_n = rpn.pre_nms_top_n()
        levels = []
        for level, (logits, deltas, feature, cell_anchors) in enumerate(
                zip(*rpn.head(features), features, rpn.anchor_generator.cell_anchors)):
            num_images, num_cell_anchors, height, width = logits.shape
            count = height * width * num_cell_anchors
            # torchvision's concat_box_prediction_layers order: (y, x, anchor).
            logits = logits.permute(0, 2, 3, 1).reshape(num_images, count)
            deltas = deltas.view(num_images, num_cell_anchors, 4, height, width).permute(0, 3, 4, 1, 2)
            logits, top, exists = padded_topk(logits, pre_nms_top_n)
            anchors = anchors_at(top, cell_anchors, feature, padded_size)
            selected = deltas.reshape(num_images, count, 4).gather(1, top[..., None].expand(-1, -1, 4))
            boxes = rpn.box_coder.decode_single(selected.reshape(-1, 4), anchors.reshape(-1, 4))
            levels.append((boxes.view(num_images, pre_nms_top_n, 4), logits.sigmoid(), exists,
                           torch.full_like(top, level)))
        boxes, scores, exists, level = (torch.cat(parts, dim=1) for parts in zip(*levels))
        boxes = clip_to_images(boxes, image_sizes)
        image_index = torch.arange(boxes.shape[0], device=boxes.device)[:, None].expand_as(scores)

        widths, heights = boxes[..., 2] - boxes[..., 0], boxes[..., 3] - boxes[..., 1]
        valid = exists & (widths >= rpn.min_size) & (heights >= rpn.min_size) & (scores >= rpn.score_thresh)
        boxes, scores, level, image_index = boxes[valid], scores[valid], level[valid], image_index[valid]
        keep = nms_per_image(boxes, scores, level, image_index, image_sizes.shape[0], max(padded_size),
                             rpn.nms_thresh, rpn.post_nms_top_n())
        return torch.cat([image_index[keep, None].to(boxes.dtype), boxes[keep]], dim=1)

    def detections(self, features: dict[str, Tensor], rois: Tensor, image_sizes: Tensor,
                   max_coordinate: int) -> tuple[Tensor, ...]:
        """Boxes, scores, labels and image index, as torchvision's RoIHeads ``postprocess_detections`` selects
        them: every (RoI, class) above ``SCORE_THRESH_TEST``, clipped, empty ones dropped, NMS per class, the
        ``DETECTIONS_PER_IMAGE`` best of each image."""
        boxes, scores = self.box_predictions(features, rois, image_sizes)
        num_rois, num_classes = scores.shape
        roi_image = rois[:, 0].to(torch.int64)
        labels = torch.arange(num_classes, device=boxes.device)[None].expand(num_rois, -1)

        # Every (RoI, class) but the background is a candidate.
        boxes = boxes[:, 1:].reshape(-1, 4)
        scores, labels = scores[:, 1:].reshape(-1), labels[:, 1:].reshape(-1)
        image_index = roi_image[:, None].expand(-1, num_classes - 1).reshape(-1)
        heads = self.roi_heads
        valid = scores > heads.score_thresh
        boxes, scores, labels, image_index = boxes[valid], scores[valid], labels[valid], image_index[valid]
        widths, heights = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
        valid = (widths >= 1e-2) & (heights >= 1e-2)  # torchvision's remove_small_boxes(min_size=1e-2)
        boxes, scores, labels, image_index = boxes[valid], scores[valid], labels[valid], image_index[valid]
        keep = nms_per_image(boxes, scores, labels, image_index, image_sizes.shape[0], max_coordinate,
                             heads.nms_thresh, heads.detections_per_img)
        return boxes[keep], scores[keep], labels[keep], image_index[keep]

    def box_predictions(self, features: dict[str, Tensor], rois: Tensor, image_sizes: Tensor) -> tuple[Tensor, Tensor]:
        """Each RoI's box per class ``[R, K+1, 4]``, clipped to its image, and class probabilities ``[R, K+1]``."""
        heads = self.roi_heads
        class_logits, box_regression = heads.box_predictor(heads.box_head(self.box_pooler(features, rois)))
        num_rois, num_classes = class_logits.shape
        boxes = heads.box_coder.decode_single(box_regression, rois[:, 1:]).view(num_rois, num_classes, 4)
        return clip_to_images(boxes, image_sizes[rois[:, 0].to(torch.int64)]), torch.softmax(class_logits, -1)

    def masks(self, features: dict[str, Tensor], boxes: Tensor, labels: Tensor, image_index: Tensor) -> Tensor:
        """Each detection's mask probabilities for its class, ``[N, 1, M, M]``: torchvision's ``maskrcnn_inference``."""
        heads = self.roi_heads
        rois = torch.cat([image_index[:, None].to(boxes.dtype), boxes], dim=1)
        logits = heads.mask_predictor(heads.mask_head(self.mask_pooler(features, rois)))
        return logits.sigmoid()[torch.arange(labels.shape[0], device=labels.device), labels][:, None]

    def keypoint_heatmaps(self, features: dict[str, Tensor], boxes: Tensor, image_index: Tensor) -> Tensor:
        """Each detection's keypoint heatmap logits, ``[N, K, H, H]``, as torchvision's RoIHeads computes them."""
        heads = self.roi_heads
        rois = torch.cat([image_index[:, None].to(boxes.dtype), boxes], dim=1)
        return heads.keypoint_predictor(heads.keypoint_head(self.keypoint_pooler(features, rois)))


@register_export_graph(CascadeRCNN)
class CascadeGraph(TwoStageGraph):
    """Cascade (Mask) R-CNN: the RPN's proposals through every box stage, batched, as
    :class:`pet.modeling.cascade_roi_heads.CascadeRoIHeads` runs them in eval mode."""

    def box_predictions(self, features: dict[str, Tensor], rois: Tensor, image_sizes: Tensor) -> tuple[Tensor, Tensor]:
        """The last stage's class-agnostic box ``[R, K+1, 4]`` (the same for every class) and the mean of the
        stages' class probabilities ``[R, K+1]``; each stage regresses the previous stage's clipped boxes."""
        heads = self.roi_heads
        roi_image = rois[:, 0:1]
        roi_sizes = image_sizes[rois[:, 0].to(torch.int64)]
        boxes, total = rois[:, 1:], None
        for head, predictor, coder in zip(heads.box_head, heads.box_predictor, heads.stage_coders):
            class_logits, deltas = predictor(head(self.box_pooler(features, torch.cat([roi_image, boxes], dim=1))))
            probabilities = torch.softmax(class_logits, -1)
            total = probabilities if total is None else total + probabilities
            boxes = clip_to_images(coder.decode_single(deltas, boxes)[:, None], roi_sizes)[:, 0]
        return boxes[:, None].expand(-1, total.shape[1], -1), total / heads.num_stages


@register_export_graph(RetinaNet)
class OneStageGraph(DetectorGraph):
    """RetinaNet: per level, the top-k (anchor, class) pairs of each image; then NMS per image, batched. FCOS
    (:class:`FCOSGraph`) scores and decodes its own way.

    The head runs on one level at a time (torchvision's heads, and any head in ``DENSE_HEAD_REGISTRY`` that treats
    levels independently, give the same outputs), so no output of all levels is split back into levels.
    """

    def __init__(self, model: RetinaNet, example_images: Tensor, example_sizes: list[tuple[int, int]]) -> None:
        super().__init__(model, example_images, example_sizes)
        self.head = model.head
        self.anchor_generator = model.anchor_generator
        self.box_coder = model.box_coder
        self.score_thresh = model.score_thresh
        self.topk_candidates = model.topk_candidates
        self.nms_thresh = model.nms_thresh
        self.detections_per_img = model.detections_per_img

    def forward(self, images: Tensor, image_sizes: Tensor) -> tuple[Tensor, ...]:
        features = self.features(images, image_sizes).values()
        candidates = [self.level_candidates(feature, cell_anchors, images.shape[-2:], image_sizes)
                      for feature, cell_anchors in zip(features, self.anchor_generator.cell_anchors)]
        boxes, scores, labels, image_index = (torch.cat(parts) for parts in zip(*candidates))
        keep = nms_per_image(boxes, scores, labels, image_index, image_sizes.shape[0], max(images.shape[-2:]),
                             self.nms_thresh, self.detections_per_img)
        boxes, scores, labels, image_index = boxes[keep], scores[keep], labels[keep], image_index[keep]
        # Label 0 is COCO's unused category, dropped after the cap as pet.modeling.one_stage drops it.
        real = labels > 0
        return boxes[real], scores[real], labels[real], image_index[real]

    def level_candidates(self, feature: Tensor, cell_anchors: Tensor, padded_size: tuple[int, int],
                         image_sizes: Tensor) -> tuple[Tensor, ...]:
        """One level's ``TOPK_CANDIDATES`` best (anchor, class) pairs of each image above ``SCORE_THRESH_TEST``,
        decoded and clipped, as torchvision's ``postprocess_detections`` selects them.

        torchvision takes the top-k among the scores above the threshold; the top-k of all scores, less
        those at or below it, are the same candidates.
        """
        outputs = {name: out.float() for name, out in self.head([feature]).items()}
        logits = outputs["cls_logits"]
        num_images, num_anchors, num_classes = logits.shape
        scores = self.scores(outputs)
        scores, top, exists = padded_topk(scores.reshape(num_images, num_anchors * num_classes), self.topk_candidates)
        anchor_index, labels = top // num_classes, top % num_classes
        anchors = anchors_at(anchor_index, cell_anchors, feature, padded_size)
        regression = outputs["bbox_regression"].gather(1, anchor_index[..., None].expand(-1, -1, 4))
        boxes = clip_to_images(self.decode(regression, anchors).view(num_images, self.topk_candidates, 4), image_sizes)
        image_index = torch.arange(num_images, device=top.device)[:, None].expand_as(top)
        valid = exists & (scores > self.score_thresh)
        return boxes[valid], scores[valid], labels[valid], image_index[valid]


    def scores(self, outputs: dict[str, Tensor]) -> Tensor:
        """Each (anchor, class) pair's score ``[B, A, K]``, as the model's ``postprocess_detections`` scores it."""
        return torch.sigmoid(outputs["cls_logits"])

    def decode(self, regression: Tensor, anchors: Tensor) -> Tensor:
        """The boxes ``[B, k, 4]`` of the ``regression`` of the ``anchors`` ``[B, k, 4]``."""
        return self.box_coder.decode_single(regression.reshape(-1, 4), anchors.reshape(-1, 4))


@register_export_graph(FCOS)
class FCOSGraph(OneStageGraph):
    """FCOS: scores are the geometric mean of the class and centerness probabilities, boxes distances from the
    cell's point."""

    def scores(self, outputs: dict[str, Tensor]) -> Tensor:
        return torch.sqrt(torch.sigmoid(outputs["cls_logits"]) * torch.sigmoid(outputs["bbox_ctrness"]))

    def decode(self, regression: Tensor, anchors: Tensor) -> Tensor:
        return self.box_coder.decode(regression, anchors)


class BatchedRoIAlign(torch.nn.Module):
    """A :class:`MultiScaleRoIAlign` on RoIs ``[R, 5]`` (image index, XYXY) rather than a list of boxes per image.

    The scales and the level mapper are torchvision's, inferred as it infers them on its first call
    (``_setup_scales``), from the example batch's feature maps.
    """

    def __init__(self, pooler: MultiScaleRoIAlign, example_features: dict[str, Tensor],
                 example_sizes: list[tuple[int, int]]) -> None:
        super().__init__()
        self.featmap_names = list(pooler.featmap_names)
        self.output_size = pooler.output_size
        self.sampling_ratio = pooler.sampling_ratio
        self.scales, self.map_levels = _setup_scales([example_features[name] for name in self.featmap_names],
                                                     example_sizes, pooler.canonical_scale, pooler.canonical_level)

    def forward(self, features: dict[str, Tensor], rois: Tensor) -> Tensor:
        maps = [features[name] for name in self.featmap_names]
        if len(maps) == 1:
            return roi_align(maps[0], rois, self.output_size, self.scales[0], self.sampling_ratio)
        levels = self.map_levels([rois[:, 1:]])
        result = maps[0].new_zeros((rois.shape[0], maps[0].shape[1], *self.output_size))
        for level, (feature, scale) in enumerate(zip(maps, self.scales)):
            index = torch.where(levels == level)[0]
            result[index] = roi_align(feature, rois[index], self.output_size, scale, self.sampling_ratio)
        return result


def padded_topk(scores: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """``scores.topk(min(k, n), dim=1)`` for ``scores [B, n]``, padded to exactly ``k`` columns: values, indices
    (those of the padding point at the last real entry) and whether each entry exists.

    torchvision's ``min(k, n)`` would make every later size a ``Min`` expression of the input's height and
    width, which multiplies torch.export's symbolic work (and export time) several times over.
    """
    count = scores.shape[1]
    padding = scores.new_full((scores.shape[0], k), -math.inf)
    values, index = torch.cat([scores, padding], dim=1).topk(k, dim=1)
    exists = index < count
    return values, torch.minimum(index, torch.full_like(index, count - 1)), exists


def anchors_at(index: Tensor, cell_anchors: Tensor, feature: Tensor, padded_size: tuple[int, int]) -> Tensor:
    """The anchors ``[..., 4]`` at ``index`` in torchvision's AnchorGenerator's order for ``feature``'s level:
    cell (y, x) of the feature map, then cell anchor; strides are its (padded size // feature map size)."""
    height, width = feature.shape[-2:]
    stride_y, stride_x = padded_size[0] // height, padded_size[1] // width
    cell, anchor = index // cell_anchors.shape[0], index % cell_anchors.shape[0]
    row = cell // width
    column = cell - row * width  # not cell % width: the ONNX exporter has no remainder by a symbolic size
    x, y = column * stride_x, row * stride_y
    return torch.stack([x, y, x, y], dim=-1).to(cell_anchors.dtype) + cell_anchors[anchor]


def clip_to_images(boxes: Tensor, image_sizes: Tensor) -> Tensor:
    """``boxes [..., K, 4]`` clipped to their image's ``(h, w)`` (``image_sizes [..., 2]``, the same for all K),
    as torchvision's ``clip_boxes_to_image``."""
    height = image_sizes[..., 0, None].to(boxes.dtype)
    width = image_sizes[..., 1, None].to(boxes.dtype)
    zero = torch.zeros((), dtype=boxes.dtype, device=boxes.device)
    x1, y1, x2, y2 = boxes.unbind(-1)
    return torch.stack([torch.minimum(torch.maximum(x1, zero), width), torch.minimum(torch.maximum(y1, zero), height),
                        torch.minimum(torch.maximum(x2, zero), width), torch.minimum(torch.maximum(y2, zero), height)],
                       dim=-1)


def nms_per_image(boxes: Tensor, scores: Tensor, groups: Tensor, image_index: Tensor, num_images: int,
                  max_coordinate: int, iou_threshold: float, max_per_image: int) -> Tensor:
    """Indices of the boxes NMS keeps within each (image, group), at most ``max_per_image`` per image, ordered by
    image, then by decreasing score: torchvision's ``batched_nms(...)[:max_per_image]`` on each image.

    Boxes must lie within ``[0, max_coordinate]``: each group is moved ``max_coordinate + 1`` px right of the
    previous one and each image as far down, so boxes of two (image, group) pairs never overlap. The x offsets are
    those of torchvision's ``batched_nms`` (which separates classes the same way): a batch adds no rounding.
    """
    step = max_coordinate + 1
    dx, dy = groups.to(boxes.dtype) * step, image_index.to(boxes.dtype) * step
    keep = nms(boxes + torch.stack([dx, dy, dx, dy], dim=1), scores, iou_threshold)
    # torchvision declares no upper bound on NMS's output size to torch.export; without this one, the bounds it
    # derives for later sizes overflow int64 and the ONNX conversion fails on them.
    torch._check(keep.shape[0] <= boxes.shape[0])
    kept_image = image_index[keep]
    # The rank of each kept box within its image, in NMS's order (decreasing score).
    in_image = (kept_image[:, None] == torch.arange(num_images, device=keep.device)[None]).to(torch.int64)
    rank = (in_image.cumsum(0) * in_image).sum(1) - 1
    capped = rank < max_per_image
    keep, kept_image, rank = keep[capped], kept_image[capped], rank[capped]
    return keep[torch.argsort(kept_image * max_per_image + rank)]
