"""DEIMv2's training losses: D-FINE's (:mod:`pet.modeling.dfine.criterion`) with the matching aware loss (MAL) in
place of the varifocal one, and, by default, dense one-to-one matching for the box and distribution losses.

The sets, their names and their layout are D-FINE's (:func:`~pet.modeling.dfine.criterion.prediction_sets`, as
transformers' ``Deimv2ForObjectDetectionLoss`` assembles them), the terms per set ``loss_mal``, ``loss_bbox``,
``loss_giou`` and, for the sets with edge distributions, ``loss_fgl`` and ``loss_ddf``: names and weights are
transformers' ``Deimv2Loss``'s, so the two can be compared term by term.

MAL: binary cross-entropy whose target for a matched prediction's class is ``IoU^gamma`` (VFL's is the IoU), with
weight 1 for it (VFL's is the IoU) and ``p^gamma`` (``alpha * p^gamma`` when ``MAL_ALPHA`` is set) for every other
(query, class): a poorly placed match is asked for a low score but not trained less than a good one.

Dense one-to-one (``DENSE_ONE_TO_ONE``; DEIM's "uni set"): every matched set (the last layer, each aux set and the
encoder's) is matched on its own; per image the union of their (query, object) pairs, each query keeping the object
most sets gave it (D-FINE's GO-LSD union, :func:`~pet.modeling.dfine.criterion.dense_one_to_one`), then supervises the
boxes (L1, GIoU) and distributions (FGL, DDF) of the last layer, aux and encoder sets alike, normalised by the union's
size instead of the object count. A query any layer matched is so trained towards its object in every layer, which
gives the early layers more positives. MAL keeps each set's own matching and the object count; the denoising sets
keep their matching by construction. Off, every term uses each set's own matching.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from fvcore.common.config import CfgNode

from pet.modeling.dfine.criterion import DFineCriterion
from pet.modeling.rtdetr.matcher import Matches

__all__ = ["Deimv2Criterion", "matching_aware_loss"]


def matching_aware_loss(logits: torch.Tensor, onehot: torch.Tensor, ious: torch.Tensor, gamma: float,
                        alpha: float | None, num_boxes: float) -> torch.Tensor:
    """MAL of scores ``[B, Q, C]`` for the matched classes ``onehot`` ``[B, Q, C]`` (int, all 0 for an unmatched
    query) whose boxes have ``ious`` ``[B, Q]`` with their objects (not differentiated; any value where unmatched):
    target ``IoU^gamma`` and weight 1 on the matched class, target 0 and weight ``(alpha *) sigmoid(logit)^gamma``
    elsewhere; summed over queries and classes, averaged over images, times the queries, divided by ``num_boxes``
    (as the reference writes it: the sum over everything divided by ``num_boxes``)."""
    target = (ious.detach().unsqueeze(-1) * onehot).pow(gamma)
    focus = logits.detach().sigmoid().pow(gamma)
    if alpha is not None:
        focus = alpha * focus
    weight = focus * (1 - onehot) + onehot
    loss = F.binary_cross_entropy_with_logits(logits, target, weight=weight, reduction="none")
    return loss.mean(1).sum() * logits.shape[1] / num_boxes


class Deimv2Criterion(DFineCriterion):
    """``forward(outputs, targets, matcher) -> dict of losses``: ``outputs`` and ``targets`` as
    :class:`~pet.modeling.dfine.criterion.DFineCriterion`'s. Reads ``cfg.MODEL.DFINE``: D-FINE's keys, the MAL
    weight ``LOSS_MAL``, ``MAL_ALPHA`` (0 for none: the negatives weighted by ``p^gamma`` alone; gamma is
    ``FOCAL_GAMMA``, ``FOCAL_ALPHA`` is unused) and ``DENSE_ONE_TO_ONE``."""

    label_loss = "loss_mal"

    def __init__(self, cfg: CfgNode, num_classes: int) -> None:
        super().__init__(cfg, num_classes)
        node = cfg.MODEL.DFINE
        self.weights = {"loss_mal": node.LOSS_MAL, **{k: v for k, v in self.weights.items() if k != "loss_vfl"}}
        # 0 stands for the reference's None (an alpha of 0 would leave the negatives untrained).
        self.mal_alpha = node.MAL_ALPHA or None
        self.union_matching = node.DENSE_ONE_TO_ONE
        self.losses = [self.loss_mal, self.loss_boxes]

    def loss_mal(self, logits: torch.Tensor, boxes: torch.Tensor, targets: list[dict], matches: Matches,
                 num_boxes: float) -> dict[str, torch.Tensor]:
        """:func:`matching_aware_loss` of a set under ``matches``, the IoU of each matched box with its object."""
        onehot, matched_ious = self.matched_classes_and_ious(logits, boxes, targets, matches)
        return {"loss_mal": matching_aware_loss(logits, onehot, matched_ious, self.gamma, self.mal_alpha, num_boxes)}
