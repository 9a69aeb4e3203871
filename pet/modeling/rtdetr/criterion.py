"""RT-DETR's training losses: varifocal classification, L1 and GIoU box losses, on every prediction set.

The sets are the last decoder layer's (``loss_*``), each earlier layer's (``loss_*_aux_{i}``), the selected
encoder candidates' (``loss_*_aux_{L-1}``, L decoder layers), each matched by the matcher, and with denoising
each layer's denoising queries (``loss_*_dn_{i}``), matched by construction to the object they were made from.
The names and weights are transformers' ``RTDetrLoss``'s, so the two can be compared term by term.

Varifocal loss (VarifocalNet): binary cross-entropy whose target for a matched prediction's class is the IoU of
its box with the object's, weighted by that IoU for positives and by ``alpha * p^gamma`` for the rest.
A new loss is a method named in ``losses`` returning weighted terms (docs/extending.md).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from fvcore.common.config import CfgNode
from torch import nn
from torchvision.ops import box_convert, box_iou, generalized_box_iou

from pet.modeling.rtdetr.matcher import Matches
from pet.utils.comm import get_world_size

__all__ = ["RTDETRCriterion", "prediction_index", "denoising_matches", "objects_per_process", "mean_over_processes"]


def _matched_giou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """GIoU of the i-th box of ``a`` with the i-th of ``b`` (both xyxy); without boxes, empty but in the graph."""
    return torch.diag(generalized_box_iou(a, b))


class RTDETRCriterion(nn.Module):
    """``forward(outputs, targets, matcher) -> dict of losses``; ``outputs`` as :class:`RTDETRDecoder` returns them,
    ``targets`` per image ``labels`` (0-based) and ``boxes`` (cx, cy, w, h in [0, 1])."""

    def __init__(self, cfg: CfgNode, num_classes: int, node_name: str = "RTDETR") -> None:
        """The focal parameters and loss weights are read from ``cfg.MODEL.<node_name>`` (``DFINE`` for D-FINE)."""
        super().__init__()
        node = cfg.MODEL[node_name]
        self.num_classes = num_classes
        self.alpha, self.gamma = node.FOCAL_ALPHA, node.FOCAL_GAMMA
        self.weights = {"loss_vfl": node.LOSS_VFL, "loss_bbox": node.LOSS_BBOX, "loss_giou": node.LOSS_GIOU}
        self.losses = [self.loss_vfl, self.loss_boxes]

    def matched_classes_and_ious(self, logits: torch.Tensor, boxes: torch.Tensor, targets: list[dict],
                                 matches: Matches) -> tuple[torch.Tensor, torch.Tensor]:
        """The one-hot matched class of every prediction ``[B, Q, C]`` (all 0 when unmatched) and the IoU of each
        matched (detached) box with its object ``[B, Q]`` (0 when unmatched): the targets of the IoU-aware losses."""
        idx = prediction_index(matches)
        gt_boxes = torch.cat([t["boxes"][j] for t, (_, j) in zip(targets, matches)])
        ious = box_iou(box_convert(boxes[idx].detach(), "cxcywh", "xyxy"), box_convert(gt_boxes, "cxcywh", "xyxy"))
        classes = torch.full(logits.shape[:2], self.num_classes, dtype=torch.int64, device=logits.device)
        classes[idx] = torch.cat([t["labels"][j] for t, (_, j) in zip(targets, matches)])
        matched_ious = torch.zeros(logits.shape[:2], dtype=logits.dtype, device=logits.device)
        matched_ious[idx] = torch.diag(ious).to(logits.dtype)
        return F.one_hot(classes, self.num_classes + 1)[..., :-1], matched_ious

    def loss_vfl(self, logits: torch.Tensor, boxes: torch.Tensor, targets: list[dict], matches: Matches,
                 num_boxes: float) -> dict[str, torch.Tensor]:
        onehot, ious = self.matched_classes_and_ious(logits, boxes, targets, matches)
        score = ious.unsqueeze(-1) * onehot
        weight = self.alpha * logits.detach().sigmoid().pow(self.gamma) * (1 - onehot) + score
        loss = F.binary_cross_entropy_with_logits(logits, score, weight=weight.to(logits.dtype), reduction="none")
        return {"loss_vfl": loss.mean(1).sum() * logits.shape[1] / num_boxes}

    def loss_boxes(self, logits: torch.Tensor, boxes: torch.Tensor, targets: list[dict], matches: Matches,
                   num_boxes: float) -> dict[str, torch.Tensor]:
        src = boxes[prediction_index(matches)]
        gt = torch.cat([t["boxes"][j] for t, (_, j) in zip(targets, matches)])
        giou = _matched_giou(box_convert(src, "cxcywh", "xyxy"), box_convert(gt, "cxcywh", "xyxy"))
        return {"loss_bbox": F.l1_loss(src, gt, reduction="sum") / num_boxes, "loss_giou": (1 - giou).sum() / num_boxes}

    def _terms(self, logits: torch.Tensor, boxes: torch.Tensor, targets: list[dict], matches: Matches,
               num_boxes: float, suffix: str) -> dict[str, torch.Tensor]:
        out = {}
        for loss in self.losses:
            for name, value in loss(logits, boxes, targets, matches, num_boxes).items():
                out[name + suffix] = value * self.weights.get(name, 1.0)
        return out

    def forward(self, outputs: dict, targets: list[dict[str, torch.Tensor]], matcher: nn.Module
                ) -> dict[str, torch.Tensor]:
        num_boxes = objects_per_process(targets, outputs["logits"][-1].device)
        denoising = outputs.get("denoising")
        logits, boxes = outputs["logits"], outputs["boxes"]
        if denoising is not None:
            split = denoising["split"]
            dn_logits, logits = zip(*(t.split(split, dim=1) for t in logits))
            dn_boxes, boxes = zip(*(t.split(split, dim=1) for t in boxes))
        sets = [(logits[-1], boxes[-1], "")]
        sets += [(lg, bx, f"_aux_{i}") for i, (lg, bx) in enumerate(zip(logits[:-1], boxes[:-1]))]
        sets.append((outputs["enc_logits"], outputs["enc_boxes"], f"_aux_{len(logits) - 1}"))
        losses: dict[str, torch.Tensor] = {}
        for lg, bx, suffix in sets:
            losses.update(self._terms(lg, bx, targets, matcher(lg, bx, targets), num_boxes, suffix))
        if denoising is not None:
            matches = denoising_matches(denoising, targets)
            for i, (lg, bx) in enumerate(zip(dn_logits, dn_boxes)):
                losses.update(self._terms(lg, bx, targets, matches, num_boxes * denoising["groups"], f"_dn_{i}"))
        return losses


def prediction_index(matches: Matches) -> tuple[torch.Tensor, torch.Tensor]:
    batch = torch.cat([torch.full_like(src, i) for i, (src, _) in enumerate(matches)])
    return batch, torch.cat([src for src, _ in matches])


def denoising_matches(denoising: dict, targets: list[dict]) -> Matches:
    """Each image's positive denoising queries, group after group, matched to its objects in order."""
    out = []
    for positive, t in zip(denoising["positive"], targets):
        objects = torch.arange(len(t["labels"]), dtype=torch.int64, device=positive.device)
        out.append((positive, objects.tile(denoising["groups"])))
    return out


def objects_per_process(targets: list[dict], device: torch.device) -> float:
    """Objects per process averaged over processes (at least 1): each process normalises its losses by it, so
    the gradient averaged by DDP is that of the whole batch's loss (DETR's normalisation)."""
    return mean_over_processes(sum(len(t["labels"]) for t in targets), device)


def mean_over_processes(count: float, device: torch.device) -> float:
    """``count`` averaged over the processes (all-reduced; as it is in one process), at least 1."""
    total = torch.tensor([float(count)], device=device)
    if get_world_size() > 1:
        dist.all_reduce(total)
        total /= get_world_size()
    return max(total.item(), 1.0)
