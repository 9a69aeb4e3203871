"""Cascade R-CNN's RoI heads (Cai & Vasconcelos, CVPR 2018): a sequence of box stages, each trained at a
higher IoU than the last on the boxes the previous stage regressed.

Built from ``MODEL.ROI_BOX_CASCADE_HEAD`` (``IOUS``, ``BBOX_REG_WEIGHTS``: one entry per stage) with the box
head of ``MODEL.ROI_BOX_HEAD`` repeated per stage. Module names: ``box_roi_pool`` (shared by every stage, as
RoIAlign has no parameters), ``box_head.{k}`` and ``box_predictor.{k}`` for stage ``k``, and the mask
branch's ``mask_roi_pool``, ``mask_head``, ``mask_predictor`` as Mask R-CNN's.

What Pet follows, and where the two public implementations differ:

- **Stages** (both): 3 stages at IoU 0.5 / 0.6 / 0.7 with box-coder weights (10, 10, 5, 5), (20, 20, 10, 10),
  (30, 30, 15, 15): the later stages regress smaller offsets, so larger weights keep their targets at unit
  scale. Regression is class-agnostic (one box per RoI, 4 outputs).
- **Training samples.** Stage 1 samples the RPN's proposals plus the ground-truth boxes as Faster R-CNN does
  (``BATCH_SIZE_PER_IMAGE`` RoIs, ``POSITIVE_FRACTION`` foreground at ``IOUS[0]``). Each later stage takes the
  previous stage's regressed boxes of those same RoIs (gradient stopped, clipped to the image, empty ones
  dropped) and only re-labels them at its own IoU, without adding ground truth again or re-sampling: this is
  detectron2's ``CascadeROIHeads``. MMDetection's ``CascadeRoIHead`` instead re-samples at every stage with
  the ground-truth boxes added again (and drops the regressed copies of earlier ground-truth proposals).
- **Loss weighting.** Each stage's losses count fully (``loss_classifier_stage{k}``, ``loss_box_reg_stage{k}``)
  and the gradient that stage ``k``'s head sends back into the shared features is scaled by ``1 / stages``:
  detectron2's choice (equivalent to averaging the stages' losses for the backbone while each head learns at
  full rate). MMDetection weights the stage losses 1, 0.5, 0.25 instead. The box loss is torchvision's
  (smooth L1 with beta 1/9, summed over foreground RoIs, divided by the number of sampled RoIs), the loss
  Pet's Faster R-CNN trains with; detectron2 uses plain L1 (beta 0).
- **Inference.** Stage ``k`` classifies and regresses stage ``k-1``'s boxes (none dropped, so the stages'
  scores stay aligned RoI for RoI); the score of a RoI is the mean of the stages' softmax probabilities, its
  box the last stage's: detectron2's ensemble. MMDetection averages the stages' logits before one softmax.
  Then torchvision's post-processing: per class score threshold, NMS, ``DETECTIONS_PER_IMAGE`` best.
- **Masks** (Cascade Mask R-CNN): one mask head, trained on the first stage's foreground samples and run on
  the final detections (the last stage's boxes), as detectron2's Cascade Mask R-CNN. MMDetection has a mask
  head per stage.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from fvcore.common.config import CfgNode
from torch import Tensor
from torchvision.models.detection import _utils as det_utils
from torchvision.models.detection.roi_heads import RoIHeads, maskrcnn_inference, maskrcnn_loss
from torchvision.ops import batched_nms, box_iou, clip_boxes_to_image, remove_small_boxes

from pet.modeling.poolers import MultiScaleRoIAlign
from pet.modeling.registry import ROI_BOX_HEAD_REGISTRY
from pet.modeling.roi_heads import build_mask_branch
from pet.utils.errors import ConfigError
from pet.utils.tensor import at_least_float32

__all__ = ["CascadeBoxPredictor", "CascadeRoIHeads", "build_cascade_roi_heads", "scale_gradient"]


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


def scale_gradient(x: Tensor, scale: float) -> Tensor:
    """``x`` unchanged, with the gradient flowing back through it multiplied by ``scale``."""
    return _ScaleGradient.apply(x, scale)


class CascadeBoxPredictor(torch.nn.Module):
    """One stage's class scores (``cls_score``: background + classes) and class-agnostic box deltas
    (``bbox_pred``: 4 per RoI), in float32 under autocast as :class:`pet.modeling.roi_heads.FastRCNNPredictor`."""

    def __init__(self, in_channels: int, num_classes: int) -> None:
        super().__init__()
        self.cls_score = torch.nn.Linear(in_channels, num_classes)
        self.bbox_pred = torch.nn.Linear(in_channels, 4)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        x = x.flatten(start_dim=1)
        return at_least_float32(self.cls_score(x)), at_least_float32(self.bbox_pred(x))


def cascade_stage_loss(class_logits: Tensor, box_deltas: Tensor, labels: list[Tensor],
                       regression_targets: list[Tensor]) -> tuple[Tensor, Tensor]:
    """torchvision's ``fastrcnn_loss`` for class-agnostic deltas ``[R, 4]``: cross-entropy over all RoIs, smooth
    L1 (beta 1/9) over the foreground ones, summed and divided by the number of RoIs."""
    labels_all, targets_all = torch.cat(labels), torch.cat(regression_targets)
    classification = F.cross_entropy(class_logits, labels_all)
    foreground = torch.where(labels_all > 0)[0]
    box = F.smooth_l1_loss(box_deltas[foreground], targets_all[foreground], beta=1 / 9, reduction="sum")
    return classification, box / max(labels_all.numel(), 1)


class CascadeRoIHeads(RoIHeads):
    """torchvision's RoIHeads with a cascade of box stages (see the module docstring for the rules).

    ``box_head`` and ``box_predictor`` are ``ModuleList``s, one entry per stage. The inherited
    ``proposal_matcher``, ``fg_bg_sampler`` and ``box_coder`` are the first stage's, so torchvision's
    ``select_training_samples`` samples its RoIs; ``stage_matchers`` and ``stage_coders`` hold every stage's.
    """

    def __init__(self, box_roi_pool: torch.nn.Module, box_heads: list[torch.nn.Module],
                 box_predictors: list[torch.nn.Module], ious: list[float],
                 reg_weights: list[tuple[float, float, float, float]], **kwargs: Any) -> None:
        if not len(box_heads) == len(box_predictors) == len(ious) == len(reg_weights):
            raise ValueError(f"one box head, predictor, IoU and box-coder weights per stage, got {len(box_heads)}, "
                             f"{len(box_predictors)}, {len(ious)} and {len(reg_weights)}")
        super().__init__(box_roi_pool, torch.nn.ModuleList(box_heads), torch.nn.ModuleList(box_predictors),
                         fg_iou_thresh=ious[0], bg_iou_thresh=ious[0], bbox_reg_weights=tuple(reg_weights[0]),
                         **kwargs)
        self.num_stages = len(box_heads)
        self.stage_ious = [float(iou) for iou in ious]
        # allow_low_quality_matches=False: a ground-truth box no RoI overlaps enough gets no forced match.
        self.stage_matchers = [det_utils.Matcher(iou, iou, allow_low_quality_matches=False) for iou in ious]
        self.stage_coders = [det_utils.BoxCoder(tuple(w)) for w in reg_weights]

    def forward(self, features: dict[str, Tensor], proposals: list[Tensor], image_shapes: list[tuple[int, int]],
                targets: list[dict[str, Tensor]] | None = None) -> tuple[list[dict[str, Tensor]], dict[str, Tensor]]:
        if self.training:
            return [], self.training_losses(features, proposals, image_shapes, targets)
        boxes, scores = self.cascade_inference(features, proposals, image_shapes)
        result = self.select_detections(boxes, scores, image_shapes)
        if self.has_mask():
            mask_logits = self.mask_predictor(self.mask_head(
                self.mask_roi_pool(features, [r["boxes"] for r in result], image_shapes)))
            for probs, r in zip(maskrcnn_inference(mask_logits, [r["labels"] for r in result]), result):
                r["masks"] = probs
        return result, {}

    def run_stage(self, stage: int, features: dict[str, Tensor], boxes: list[Tensor],
                  image_shapes: list[tuple[int, int]]) -> tuple[Tensor, Tensor]:
        """Stage ``stage``'s class logits ``[R, K+1]`` and box deltas ``[R, 4]`` for the RoIs ``boxes``."""
        pooled = self.box_roi_pool(features, boxes, image_shapes)
        if self.training:
            pooled = scale_gradient(pooled, 1.0 / self.num_stages)
        return self.box_predictor[stage](self.box_head[stage](pooled))

    def regress(self, stage: int, deltas: Tensor, boxes: list[Tensor],
                image_shapes: list[tuple[int, int]]) -> list[Tensor]:
        """Stage ``stage``'s boxes: ``deltas`` decoded with its weights on ``boxes``, clipped to each image and
        detached (the next stage's proposals carry no gradient, as the RPN's do not)."""
        decoded = self.stage_coders[stage].decode(deltas.detach(), boxes).reshape(-1, 4)
        per_image = decoded.split([len(b) for b in boxes])
        return [clip_boxes_to_image(b, shape) for b, shape in zip(per_image, image_shapes)]

    def label_stage(self, stage: int, boxes: list[Tensor],
                    targets: list[dict[str, Tensor]]) -> tuple[list[Tensor], list[Tensor]]:
        """Labels (0: background) and regression targets (stage ``stage``'s weights) of ``boxes``, matched to the
        ground truth at the stage's IoU: foreground at or above it, background below."""
        labels, regression_targets = [], []
        for rois, target in zip(boxes, targets):
            gt_boxes = target["boxes"].to(rois.dtype)
            if gt_boxes.numel() == 0:  # a background image
                labels.append(torch.zeros(len(rois), dtype=torch.int64, device=rois.device))
                regression_targets.append(torch.zeros_like(rois))
                continue
            matched = self.stage_matchers[stage](box_iou(gt_boxes, rois))
            image_labels = target["labels"][matched.clamp(min=0)].to(torch.int64)
            image_labels[matched < 0] = 0
            labels.append(image_labels)
            regression_targets.append(self.stage_coders[stage].encode_single(gt_boxes[matched.clamp(min=0)], rois))
        return labels, regression_targets

    def training_losses(self, features: dict[str, Tensor], proposals: list[Tensor],
                        image_shapes: list[tuple[int, int]],
                        targets: list[dict[str, Tensor]] | None) -> dict[str, Tensor]:
        """Every stage's ``loss_classifier_stage{k}`` and ``loss_box_reg_stage{k}`` (and ``loss_mask``)."""
        if targets is None:
            raise ValueError("CascadeRoIHeads needs targets in training")
        boxes, matched_idxs, labels, regression_targets = self.select_training_samples(proposals, targets)
        first_boxes, first_matched, first_labels = boxes, matched_idxs, labels
        losses: dict[str, Tensor] = {}
        for stage in range(self.num_stages):
            if stage > 0:
                boxes = [b[(b[:, 2] > b[:, 0]) & (b[:, 3] > b[:, 1])] for b in boxes]  # drop empty boxes
                labels, regression_targets = self.label_stage(stage, boxes, targets)
            class_logits, deltas = self.run_stage(stage, features, boxes, image_shapes)
            classification, box = cascade_stage_loss(class_logits, deltas, labels, regression_targets)
            losses[f"loss_classifier_stage{stage}"] = classification
            losses[f"loss_box_reg_stage{stage}"] = box
            if stage < self.num_stages - 1:
                boxes = self.regress(stage, deltas, boxes, image_shapes)
        if self.has_mask():
            losses["loss_mask"] = self.mask_loss(features, first_boxes, first_matched, first_labels, image_shapes,
                                                 targets)
        return losses

    def mask_loss(self, features: dict[str, Tensor], boxes: list[Tensor], matched_idxs: list[Tensor],
                  labels: list[Tensor], image_shapes: list[tuple[int, int]],
                  targets: list[dict[str, Tensor]]) -> Tensor:
        """torchvision's ``maskrcnn_loss`` on the first stage's foreground samples (detectron2's choice)."""
        foreground = [torch.where(image_labels > 0)[0] for image_labels in labels]
        rois = [b[i] for b, i in zip(boxes, foreground)]
        logits = self.mask_predictor(self.mask_head(self.mask_roi_pool(features, rois, image_shapes)))
        return maskrcnn_loss(logits, rois, [t["masks"] for t in targets], [t["labels"] for t in targets],
                             [m[i] for m, i in zip(matched_idxs, foreground)])

    def cascade_inference(self, features: dict[str, Tensor], proposals: list[Tensor],
                          image_shapes: list[tuple[int, int]]) -> tuple[list[Tensor], list[Tensor]]:
        """Per image, the last stage's boxes ``[R, 4]`` and the mean of the stages' probabilities ``[R, K+1]``."""
        boxes, total = proposals, None
        for stage in range(self.num_stages):
            class_logits, deltas = self.run_stage(stage, features, boxes, image_shapes)
            probabilities = F.softmax(class_logits, -1)
            total = probabilities if total is None else total + probabilities
            boxes = self.regress(stage, deltas, boxes, image_shapes)
        scores = (total / self.num_stages).split([len(b) for b in boxes])
        return boxes, list(scores)

    def select_detections(self, boxes: list[Tensor], scores: list[Tensor],
                          image_shapes: list[tuple[int, int]]) -> list[dict[str, Tensor]]:
        """torchvision's ``postprocess_detections`` on class-agnostic boxes: every (RoI, class) but background
        above ``score_thresh``, non-empty, NMS per class, the ``detections_per_img`` best per image."""
        result = []
        for image_boxes, image_scores, shape in zip(boxes, scores, image_shapes):
            num_rois, num_classes = image_scores.shape
            image_boxes = clip_boxes_to_image(image_boxes, shape)[:, None].expand(num_rois, num_classes - 1, 4)
            labels = torch.arange(1, num_classes, device=image_scores.device)[None].expand(num_rois, -1)
            image_boxes, image_scores = image_boxes.reshape(-1, 4), image_scores[:, 1:].reshape(-1)
            labels = labels.reshape(-1)
            keep = torch.where(image_scores > self.score_thresh)[0]
            image_boxes, image_scores, labels = image_boxes[keep], image_scores[keep], labels[keep]
            keep = remove_small_boxes(image_boxes, min_size=1e-2)
            image_boxes, image_scores, labels = image_boxes[keep], image_scores[keep], labels[keep]
            keep = batched_nms(image_boxes, image_scores, labels, self.nms_thresh)[: self.detections_per_img]
            result.append({"boxes": image_boxes[keep], "scores": image_scores[keep], "labels": labels[keep]})
        return result


def build_cascade_roi_heads(cfg: CfgNode, in_channels: int, featmap_names: list[str], *,
                            mask: bool = False) -> CascadeRoIHeads:
    """Cascade RoI heads pooling from the feature maps ``featmap_names`` (``in_channels`` each): one
    ``MODEL.ROI_BOX_HEAD.NAME`` head and one class-agnostic predictor per entry of
    ``MODEL.ROI_BOX_CASCADE_HEAD.IOUS``; with ``mask`` also the mask branch of Mask R-CNN."""
    heads, box, cascade = cfg.MODEL.ROI_HEADS, cfg.MODEL.ROI_BOX_HEAD, cfg.MODEL.ROI_BOX_CASCADE_HEAD
    ious, weights = list(cascade.IOUS), [tuple(w) for w in cascade.BBOX_REG_WEIGHTS]
    if not ious or len(ious) != len(weights) or any(len(w) != 4 for w in weights):
        raise ConfigError(f"MODEL.ROI_BOX_CASCADE_HEAD needs one IoU per stage in IOUS and one (wx, wy, ww, wh) per "
                          f"stage in BBOX_REG_WEIGHTS; got IOUS {ious} and BBOX_REG_WEIGHTS {weights}. Give both the "
                          "same number of stages.")
    return CascadeRoIHeads(
        MultiScaleRoIAlign(featmap_names, box.POOLER_RESOLUTION, box.POOLER_SAMPLING_RATIO),
        [ROI_BOX_HEAD_REGISTRY.get(box.NAME)(cfg, in_channels) for _ in ious],
        [CascadeBoxPredictor(box.MLP_DIM, cfg.MODEL.NUM_CLASSES + 1) for _ in ious],
        ious,
        weights,
        batch_size_per_image=heads.BATCH_SIZE_PER_IMAGE,
        positive_fraction=heads.POSITIVE_FRACTION,
        score_thresh=heads.SCORE_THRESH_TEST,
        nms_thresh=heads.NMS_THRESH_TEST,
        detections_per_img=heads.DETECTIONS_PER_IMAGE,
        **(build_mask_branch(cfg, in_channels, featmap_names) if mask else {}),
    )
