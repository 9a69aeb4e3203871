"""The Hungarian matcher: a one-to-one assignment of predictions to objects at the lowest total cost.

The cost of giving object j to prediction i is ``class_weight * focal class cost + bbox_weight * L1 distance
of the (cx, cy, w, h) boxes - giou_weight * GIoU``, solved per image with scipy's ``linear_sum_assignment``.
To try another matcher, subclass :class:`HungarianMatcher` (or write any module with the same call) and
register it in ``RTDETR_MATCHER_REGISTRY``; ``MODEL.RTDETR.MATCHER`` names it (docs/extending.md).
"""
from __future__ import annotations

import inspect
import logging

import torch
from fvcore.common.config import CfgNode
from torch import nn
from torchvision.ops import box_convert, generalized_box_iou

from pet.utils.registry import Registry

__all__ = ["HungarianMatcher", "RTDETR_MATCHER_REGISTRY", "Matches", "build_matcher"]

logger = logging.getLogger(__name__)

RTDETR_MATCHER_REGISTRY = Registry("RT-DETR matcher")
RTDETR_MATCHER_REGISTRY.__doc__ = ("RT-DETR matchers by name, for MODEL.RTDETR.MATCHER (and MODEL.DFINE.MATCHER): "
                                   "``Entry(cfg, node_name) -> nn.Module``, the costs in ``cfg.MODEL[node_name]``.")

# Per image: (prediction indices, object indices), int64, of equal length.
Matches = list[tuple[torch.Tensor, torch.Tensor]]


@RTDETR_MATCHER_REGISTRY.register()
class HungarianMatcher(nn.Module):
    """``forward(logits [B, Q, C], boxes [B, Q, 4], targets) -> Matches``; targets hold ``labels`` (0-based) and
    ``boxes`` (cx, cy, w, h in [0, 1]). Costs that are not finite are replaced by the largest float (matched last)."""

    def __init__(self, cfg: CfgNode, node_name: str = "RTDETR") -> None:
        """The costs are read from ``cfg.MODEL.<node_name>`` (``RTDETR``, or ``DFINE`` for D-FINE)."""
        super().__init__()
        node = cfg.MODEL[node_name]
        self.class_weight, self.bbox_weight, self.giou_weight = node.COST_CLASS, node.COST_BBOX, node.COST_GIOU
        self.alpha, self.gamma = node.MATCHER_ALPHA, node.MATCHER_GAMMA

    @torch.no_grad()
    def forward(self, logits: torch.Tensor, boxes: torch.Tensor, targets: list[dict[str, torch.Tensor]]) -> Matches:
        b, q = logits.shape[:2]
        labels = torch.cat([t["labels"] for t in targets])
        gt_boxes = torch.cat([t["boxes"] for t in targets])
        prob = logits.flatten(0, 1).sigmoid()[:, labels]
        # The focal loss of calling it the object's class minus that of calling it background.
        positive = self.alpha * (1 - prob) ** self.gamma * -(prob + 1e-8).log()
        negative = (1 - self.alpha) * prob**self.gamma * -(1 - prob + 1e-8).log()
        pred = boxes.flatten(0, 1)
        giou = generalized_box_iou(box_convert(pred, "cxcywh", "xyxy"), box_convert(gt_boxes, "cxcywh", "xyxy"))
        cost = (self.bbox_weight * torch.cdist(pred, gt_boxes, p=1) + self.class_weight * (positive - negative)
                - self.giou_weight * giou)
        big = torch.finfo(cost.dtype).max
        cost = torch.nan_to_num(cost, nan=big, posinf=big, neginf=big).view(b, q, -1).cpu()
        from scipy.optimize import linear_sum_assignment  # here: ~0.35 s to import, paid only by RT-DETR training

        matches = []
        for i, c in enumerate(cost.split([len(t["boxes"]) for t in targets], -1)):
            rows, cols = linear_sum_assignment(c[i])
            matches.append((torch.as_tensor(rows, dtype=torch.int64), torch.as_tensor(cols, dtype=torch.int64)))
        return matches


def build_matcher(cfg: CfgNode, node_name: str) -> nn.Module:
    """The matcher ``cfg.MODEL.<node_name>.MATCHER`` names, built as ``Matcher(cfg, node_name)``.

    A matcher written for Pet 0.2 takes ``(cfg)`` alone and reads ``MODEL.RTDETR``: until 0.4.0 it is still built
    that way, with a warning (CHANGELOG, Deprecated)."""
    name = cfg.MODEL[node_name].MATCHER
    entry = RTDETR_MATCHER_REGISTRY.get(name)
    parameters = inspect.signature(entry).parameters.values()
    if len(parameters) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in parameters):
        return entry(cfg, node_name)
    logger.warning(f"MODEL.{node_name}.MATCHER {name} takes (cfg) alone; matchers are now built as "
                   f"Matcher(cfg, node_name) with their costs in cfg.MODEL[node_name]. Add the node_name argument "
                   f"(and pass it to HungarianMatcher.__init__): the one-argument form goes in Pet 0.4.0.")
    return entry(cfg)
