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
most sets gave it (:func:`dense_one_to_one`), then supervises the boxes (L1, GIoU) and distributions (FGL, DDF) of
the last layer, aux and encoder sets alike, normalised by the union's size instead of the object count. A query any
layer matched is so trained towards its object in every layer, which gives the early layers more positives. MAL
keeps each set's own matching and the object count; the denoising sets keep their matching by construction. Off,
every term uses each set's own matching, as D-FINE.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from fvcore.common.config import CfgNode
from torch import nn

from pet.modeling.dfine.criterion import DFineCriterion, PredictionSet, prediction_sets
from pet.modeling.rtdetr.criterion import mean_over_processes, objects_per_process
from pet.modeling.rtdetr.matcher import Matches

__all__ = ["Deimv2Criterion", "matching_aware_loss", "dense_one_to_one", "pairs_per_process"]


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


def dense_one_to_one(matchings: list[Matches]) -> Matches:
    """Per image the union of several sets' matchings: every (query, object) pair any set chose, a query chosen for
    several objects keeping the one the most sets chose it for (an object may keep several queries). The queries come
    in the order of their pairs' counts, most first.

    Ties between counts are broken as the reference breaks them: ``torch.unique(..., dim=0)`` (pairs sorted) then a
    descending ``torch.argsort`` of the counts, which is not stable; the same calls on the same pairs give the same
    order, so the same choice and the same summation order downstream."""
    union = []
    for per_set in zip(*matchings):
        pairs = torch.cat([torch.stack([src, dst], 1) for src, dst in per_set])
        unique, counts = torch.unique(pairs, return_counts=True, dim=0)
        ordered = unique[torch.argsort(counts, descending=True)]
        first = _first_occurrences(ordered[:, 0])
        union.append((ordered[first, 0], ordered[first, 1]))
    return union


def _first_occurrences(values: torch.Tensor) -> torch.Tensor:
    """Mask of the positions where each value of ``values`` ``[n]`` occurs for the first time."""
    _, inverse = torch.unique(values, return_inverse=True)
    position = torch.arange(len(values), device=values.device)
    first = torch.full_like(position, len(values)).scatter_reduce(0, inverse, position, "amin")
    return first[inverse] == position


def pairs_per_process(matches: Matches, device: torch.device) -> float:
    """Matched pairs per process averaged over processes (at least 1): the union's normaliser, averaged for the
    same reason as the object count (:func:`~pet.modeling.rtdetr.criterion.objects_per_process`)."""
    return mean_over_processes(sum(len(src) for src, _ in matches), device)


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
        self.dense_one_to_one = node.DENSE_ONE_TO_ONE
        self.losses = [self.loss_mal, self.loss_boxes]

    def loss_mal(self, logits: torch.Tensor, boxes: torch.Tensor, targets: list[dict], matches: Matches,
                 num_boxes: float) -> dict[str, torch.Tensor]:
        """:func:`matching_aware_loss` of a set under ``matches``, the IoU of each matched box with its object."""
        onehot, matched_ious = self.matched_classes_and_ious(logits, boxes, targets, matches)
        return {"loss_mal": matching_aware_loss(logits, onehot, matched_ious, self.gamma, self.mal_alpha, num_boxes)}

    def _weighted(self, terms: dict[str, torch.Tensor], suffix: str) -> dict[str, torch.Tensor]:
        return {name + suffix: value * self.weights[name] for name, value in terms.items()}

    def dense_set_losses(self, pset: PredictionSet, targets: list[dict], matches: Matches, num_boxes: float,
                         union: Matches, num_pairs: float) -> dict[str, torch.Tensor]:
        """A matched set's terms under dense one-to-one: MAL with the set's own ``matches`` and the object count,
        boxes and distributions with the ``union`` and its size."""
        out = self._weighted(self.loss_mal(pset.logits, pset.boxes, targets, matches, num_boxes), pset.suffix)
        out.update(self._weighted(self.loss_boxes(pset.logits, pset.boxes, targets, union, num_pairs), pset.suffix))
        if pset.corners is not None:
            out.update(self._weighted(self.loss_local(pset, targets, union, num_pairs), pset.suffix))
        return out

    def forward(self, outputs: dict, targets: list[dict[str, torch.Tensor]], matcher: nn.Module
                ) -> dict[str, torch.Tensor]:
        if not self.dense_one_to_one:
            return super().forward(outputs, targets, matcher)
        device = outputs["logits"][-1].device
        num_boxes = objects_per_process(targets, device)
        sets, dn_sets = prediction_sets(outputs)
        matches = [matcher(pset.logits, pset.boxes, targets) for pset in sets]
        union = dense_one_to_one(matches)
        num_pairs = pairs_per_process(union, device)
        losses: dict[str, torch.Tensor] = {}
        for pset, own in zip(sets, matches):
            losses.update(self.dense_set_losses(pset, targets, own, num_boxes, union, num_pairs))
        losses.update(self.denoising_losses(outputs, dn_sets, targets, num_boxes))
        return self.keep_unsupervised_in_graph(losses, outputs)
