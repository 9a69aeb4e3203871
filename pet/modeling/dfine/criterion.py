"""D-FINE's training losses: RT-DETR's varifocal, L1 and GIoU losses, plus two losses on the edge distributions,
fine-grained localisation (FGL) and decoupled distillation focal (DDF), on the prediction sets below.

The sets are assembled as transformers' ``DFineForObjectDetectionLoss`` assembles them, so the two can be compared
term by term (names and weights are its ``DFineLoss``'s). With L decoder layers, and every box clamped to [0, 1]
first (the matcher sees the clamped boxes too):

* ``loss_*``: the last layer's scores and boxes; varifocal, L1 and GIoU only (no FGL or DDF).
* ``loss_*_aux_{k}``, k = 0..L-2: all five terms, with the scores and boxes *one step before* layer k (the
  pre-box head's for k = 0, layer k-1's after) but layer k's edge distributions. transformers pairs the L + 1
  score/box outputs (pre-box head first) with the L distributions index by index, which shifts them by one; so
  layer L-2's own scores and boxes are never supervised, and FGL's IoU weights come from the previous layer's boxes.
* ``loss_*_aux_{L-1}``: the encoder's selected candidates; varifocal, L1 and GIoU.
* with denoising, ``loss_*_dn_{k}``, k = 0..L-1: the denoising queries, shifted as the aux sets, all five terms
  (the last layer's denoising scores and boxes are never supervised, and ``loss_ddf_dn_{L-1}``, the last layer
  distilled into itself, is 0).

Each matched set is matched on its own by the matcher; denoising sets are matched by construction to the object
each query was made from, and normalised by the object count times the number of denoising groups.

FGL: the object's edges, as distances from the matched query's anchor in W(n)'s units
(:func:`boxes_to_distances`), fall between two neighbouring bins of the weighting function; the loss is the
cross-entropy of the edge's logits against that two-bin target (weights by proximity, :func:`distance_bins`),
weighted by the IoU of the set's box with the object, summed and divided by the object count.

DDF: every query's edge distributions (the student) are pulled towards the last layer's (the teacher, detached) by
``T^2 * KL(teacher || student)`` at temperature T, weighted per query by the IoU with its object when matched and
by the teacher's highest class probability otherwise; the matched and unmatched means are averaged with weights
``sqrt(rows / batch size)`` of each side.

This is transformers' layout. The original D-FINE repository (Peterande/D-FINE) aligns each aux set's scores,
boxes and distributions on the same layer, gives the main set FGL too, has separate pre-box and encoder sets and
uses GO-LSD: the box and distribution losses of the matched sets take the union of all layers' matchings. That
layout is not implemented here.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from fvcore.common.config import CfgNode
from torch import nn
from torchvision.ops import box_convert, box_iou

from pet.modeling.dfine.distribution import weighting_function
from pet.modeling.rtdetr.criterion import RTDETRCriterion, denoising_matches, objects_per_process, prediction_index
from pet.modeling.rtdetr.matcher import Matches
from pet.utils.comm import get_world_size

__all__ = ["DFineCriterion", "PredictionSet", "prediction_sets", "boxes_to_distances", "distance_bins",
           "fine_grained_localization", "decoupled_distillation"]


class PredictionSet(NamedTuple):
    """One set the losses are computed on: ``suffix`` of its loss names, scores ``[B, Q, C]``, boxes ``[B, Q, 4]``
    (clamped), and for FGL/DDF its edge logits, the queries' anchors and the teacher's edge logits and scores."""

    suffix: str
    logits: torch.Tensor
    boxes: torch.Tensor
    corners: torch.Tensor | None = None
    anchors: torch.Tensor | None = None
    teacher_corners: torch.Tensor | None = None
    teacher_logits: torch.Tensor | None = None


def prediction_sets(outputs: dict) -> tuple[list[PredictionSet], list[PredictionSet]]:
    """(matched sets, denoising sets) from the decoder's training outputs, in transformers' shifted layout (see the
    module docstring). Boxes are clamped to [0, 1]; the denoising queries are split off the front."""
    logits = [outputs["pre_logits"], *outputs["logits"]]
    boxes = [b.clamp(0, 1) for b in (outputs["pre_boxes"], *outputs["boxes"])]
    corners, anchors = list(outputs["corners"]), outputs["anchors"]
    layers = len(corners)
    denoising = outputs.get("denoising")
    dn_sets: list[PredictionSet] = []
    if denoising is not None:
        dn_logits, logits = _split(logits, denoising["split"])
        dn_boxes, boxes = _split(boxes, denoising["split"])
        dn_corners, corners = _split(corners, denoising["split"])
        (dn_anchors,), (anchors,) = _split([anchors], denoising["split"])
        dn_sets = [PredictionSet(f"_dn_{k}", dn_logits[k], dn_boxes[k], dn_corners[k], dn_anchors, dn_corners[-1],
                                 dn_logits[-1]) for k in range(layers)]
    sets = [PredictionSet("", logits[-1], boxes[-1])]
    sets += [PredictionSet(f"_aux_{k}", logits[k], boxes[k], corners[k], anchors, corners[-1], logits[-1])
             for k in range(layers - 1)]
    sets.append(PredictionSet(f"_aux_{layers - 1}", outputs["enc_logits"], outputs["enc_boxes"].clamp(0, 1)))
    return sets, dn_sets


def _split(tensors: list[torch.Tensor], split: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each ``[B, D + Q, ...]`` tensor into its denoising part and the rest: (all the first parts, all the rest)."""
    parts = [t.split(split, dim=1) for t in tensors]
    return [p[0] for p in parts], [p[1] for p in parts]


def boxes_to_distances(anchors: torch.Tensor, boxes: torch.Tensor, reg_scale: float) -> torch.Tensor:
    """Edge distances (left, top, right, bottom) ``[..., 4]`` of ``boxes`` from ``anchors`` (both cx, cy, w, h), in
    the units of :func:`~pet.modeling.dfine.distribution.distances_to_boxes`, whose inverse this is: an edge
    ``reg_scale / 2 + d`` units of ``anchor size / reg_scale`` from the anchor's centre has distance d. The unit gets
    1e-16 added (as the reference does), so a zero-size anchor gives huge distances (clamped to the end bins), not
    a division by zero."""
    scale = abs(reg_scale)
    cx, cy, w, h = anchors.unbind(-1)
    x0, y0, x1, y1 = box_convert(boxes, "cxcywh", "xyxy").unbind(-1)
    unit_w, unit_h = w / scale + 1e-16, h / scale + 1e-16
    return torch.stack([(cx - x0) / unit_w - 0.5 * scale, (cy - y0) / unit_h - 0.5 * scale,
                        (x1 - cx) / unit_w - 0.5 * scale, (y1 - cy) / unit_h - 0.5 * scale], -1)


def distance_bins(distances: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each target distance (flattened) as a distribution over two neighbouring bins of W (``values``, increasing,
    ``[N + 1]``): ``(left bin k in [0, N - 1] (int64), weight of bin k, weight of bin k + 1)``, with W_k <= d < W_k+1
    and weights linear in the distance to each bin (d on a bin gives it weight 1). Distances beyond W's range go
    whole to the end bin: below W_0 to bin 0, from W_N on to bin N (as left bin N - 1 with weights (0, 1)).
    The reference encodes that last case as the float index N - 0.1 that the loss truncates to N - 1: the same."""
    d = distances.detach().reshape(-1)
    n = values.numel() - 1
    left = (values[None] <= d[:, None]).sum(1) - 1  # -1 below W_0, n from W_n on
    inside = (left >= 0) & (left < n)
    k = left.clamp(0, n - 1)
    to_left, to_right = (d - values[k]).abs(), (values[k + 1] - d).abs()
    right_weight = torch.where(inside, to_left / (to_left + to_right), (left >= n).to(d.dtype))
    left_weight = torch.where(inside, 1.0 - right_weight, (left < 0).to(d.dtype))
    return k, left_weight, right_weight


def fine_grained_localization(corners: torch.Tensor, bins: torch.Tensor, left_weight: torch.Tensor,
                              right_weight: torch.Tensor, ious: torch.Tensor, num_boxes: float) -> torch.Tensor:
    """FGL of the matched queries' edge logits ``[n, 4 * (N + 1)]`` against the two-bin targets of
    :func:`distance_bins` (``4 n`` rows, edges in order), each query's four rows weighted by its IoU ``[n]``: the
    sum over rows divided by ``num_boxes``. Weighting by IoU lets well-placed boxes sharpen their distributions."""
    rows = corners.reshape(-1, corners.shape[-1] // 4)
    loss = (F.cross_entropy(rows, bins, reduction="none") * left_weight
            + F.cross_entropy(rows, bins + 1, reduction="none") * right_weight)
    return (loss * ious.repeat_interleave(4)).sum() / num_boxes


def decoupled_distillation(corners: torch.Tensor, teacher: torch.Tensor, weights: torch.Tensor,
                           matched: torch.Tensor, temperature: float) -> torch.Tensor:
    """DDF of edge logits ``corners`` ``[B, Q, 4 * (N + 1)]`` towards ``teacher``'s (same shape; not differentiated):
    per edge ``T^2 * KL(softmax(teacher / T) || softmax(corners / T))`` times the query's weight ``[B, Q]``; the means
    over the ``matched`` ``[B, Q]`` edges and over the rest, averaged with weights sqrt(edges / B) of each side (so
    the many unmatched queries do not drown the matched ones; a side without edges, as the matched one in a batch
    without objects, gives 0, not the NaN of an empty mean). The teacher itself gives 0 (still in the graph)."""
    size, per_edge = len(corners), corners.shape[-1] // 4
    student, target = corners.reshape(-1, per_edge), teacher.reshape(-1, per_edge)
    if torch.equal(student, target):
        return student.sum() * 0
    kl = F.kl_div(F.log_softmax(student / temperature, dim=1), F.softmax(target.detach() / temperature, dim=1),
                  reduction="none").sum(-1)
    loss = weights.detach().flatten().repeat_interleave(4) * temperature**2 * kl
    mask = matched.flatten().repeat_interleave(4)
    # The means and weights are the whole batch's: with several processes, each process's share of the sums over
    # the batch's counts (all-reduced), times the processes (DDP averages the gradients), so two processes of one
    # image train as one of two; in one process this is the reference's per-batch mean.
    counts = torch.stack([mask.sum(), (~mask).sum()]).to(loss.dtype)
    batch = torch.tensor(float(size), dtype=loss.dtype, device=loss.device)
    world = get_world_size()
    if world > 1:
        dist.all_reduce(counts)
        batch = batch * world
    rows_pos, rows_neg = counts
    num_pos, num_neg = (rows_pos * (1 / batch)) ** 0.5, (rows_neg * (1 / batch)) ** 0.5
    pos = loss[mask].sum() / rows_pos * world if rows_pos > 0 else 0
    neg = loss[~mask].sum() / rows_neg * world if rows_neg > 0 else 0
    return (pos * num_pos + neg * num_neg) / (num_pos + num_neg)


class DFineCriterion(RTDETRCriterion):
    """``forward(outputs, targets, matcher) -> dict of losses`` on the sets of :func:`prediction_sets`; ``outputs``
    as D-FINE's decoder returns them in training (``pre_logits``, ``pre_boxes``, per layer ``logits``, ``boxes``,
    ``corners``, the ``anchors`` the distances are measured from, ``enc_logits``, ``enc_boxes``, ``denoising``),
    ``targets`` per image ``labels`` (0-based) and ``boxes`` (cx, cy, w, h in [0, 1])."""

    #: The classification term's name (a subclass with another classification loss renames it).
    label_loss = "loss_vfl"

    def __init__(self, cfg: CfgNode, num_classes: int) -> None:
        super().__init__(cfg, num_classes, node_name="DFINE")
        node = cfg.MODEL.DFINE
        self.weights.update(loss_fgl=node.LOSS_FGL, loss_ddf=node.LOSS_DDF)
        # The config's values, not the model's buffers (as the reference): W of the loss follows the config.
        self.num_bins, self.reg_scale, self.up = node.NUM_BINS, node.REG_SCALE, node.UP
        self.temperature = node.DDF_TEMPERATURE

    def bin_values(self, device: torch.device) -> torch.Tensor:
        """W(n) ``[NUM_BINS + 1]`` for the config's ``UP`` and ``REG_SCALE``."""
        return weighting_function(self.num_bins, torch.tensor([self.up], device=device),
                                  torch.tensor([self.reg_scale], device=device))

    def loss_local(self, pset: PredictionSet, targets: list[dict], matches: Matches,
                   num_boxes: float) -> dict[str, torch.Tensor]:
        """FGL and DDF of a set with edge distributions; both weighted by the IoU of the set's matched boxes."""
        idx = prediction_index(matches)
        gt_boxes = torch.cat([t["boxes"][j] for t, (_, j) in zip(targets, matches)])
        with torch.no_grad():
            ious = torch.diag(box_iou(box_convert(pset.boxes[idx], "cxcywh", "xyxy"),
                                      box_convert(gt_boxes, "cxcywh", "xyxy")))
            distances = boxes_to_distances(pset.anchors[idx], gt_boxes, self.reg_scale)
            bins, left_weight, right_weight = distance_bins(distances, self.bin_values(distances.device))
            weights = pset.teacher_logits.sigmoid().max(-1).values
            weights[idx] = ious.to(weights.dtype)
            matched = torch.zeros_like(weights, dtype=torch.bool)
            matched[idx] = True
        fgl = fine_grained_localization(pset.corners[idx], bins, left_weight, right_weight, ious, num_boxes)
        ddf = decoupled_distillation(pset.corners, pset.teacher_corners, weights, matched, self.temperature)
        return {"loss_fgl": fgl, "loss_ddf": ddf}

    def set_losses(self, pset: PredictionSet, targets: list[dict], matches: Matches,
                   num_boxes: float) -> dict[str, torch.Tensor]:
        """Every weighted term of one set, named with its suffix."""
        out = self._terms(pset.logits, pset.boxes, targets, matches, num_boxes, pset.suffix)
        if pset.corners is not None:
            for name, value in self.loss_local(pset, targets, matches, num_boxes).items():
                out[name + pset.suffix] = value * self.weights[name]
        return out

    def forward(self, outputs: dict, targets: list[dict[str, torch.Tensor]], matcher: nn.Module
                ) -> dict[str, torch.Tensor]:
        num_boxes = objects_per_process(targets, outputs["logits"][-1].device)
        sets, dn_sets = prediction_sets(outputs)
        losses: dict[str, torch.Tensor] = {}
        for pset in sets:
            losses.update(self.set_losses(pset, targets, matcher(pset.logits, pset.boxes, targets), num_boxes))
        losses.update(self.denoising_losses(outputs, dn_sets, targets, num_boxes))
        return self.keep_unsupervised_in_graph(losses, outputs)

    def denoising_losses(self, outputs: dict, dn_sets: list[PredictionSet], targets: list[dict],
                         num_boxes: float) -> dict[str, torch.Tensor]:
        """The denoising sets' terms: matched by construction, normalised by ``num_boxes`` times the groups."""
        if not dn_sets:
            return {}
        denoising = outputs["denoising"]
        matches = denoising_matches(denoising, targets)
        losses: dict[str, torch.Tensor] = {}
        for pset in dn_sets:
            losses.update(self.set_losses(pset, targets, matches, num_boxes * denoising["groups"]))
        return losses

    def keep_unsupervised_in_graph(self, losses: dict[str, torch.Tensor], outputs: dict) -> dict[str, torch.Tensor]:
        """``losses`` with the never supervised scores joined to its :attr:`label_loss` term with weight 0.

        The shifted layout supervises the scores of layer L-2 (of the pre-box head with one layer) only through the
        denoising queries, which a process without objects (or NUM_DENOISING 0) has none of: their class head and
        quality head join the graph with weight 0, so that DistributedDataParallel, which all-reduces every
        parameter's gradient at every step, finds one in every process (as RT-DETR's label embedding)."""
        unsupervised = ([outputs["pre_logits"], *outputs["logits"]])[-2]
        losses[self.label_loss] = losses[self.label_loss] + 0.0 * unsupervised.sum()
        return losses
