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

That is transformers' layout (``MODEL.DFINE.LOSS_LAYOUT transformers``, the default, so that Pet's losses can be
proved equal to a public implementation). ``LOSS_LAYOUT original`` is the paper's, as the authors' repository
(Peterande/D-FINE) trains:

* ``loss_*``: the last layer's scores, boxes and distributions; varifocal, L1, GIoU and FGL (its DDF, the teacher
  distilled into itself, is 0 and left out).
* ``loss_*_aux_{k}``, k = 0..L-2: layer k's own scores, boxes and distributions (aligned, not shifted), all five
  terms; ``loss_*_pre``: the pre-box head's scores and boxes; ``loss_*_enc_0``: the encoder's candidates.
* with denoising, ``loss_*_dn_{k}``, k = 0..L-1, aligned the same way, and ``loss_*_dn_pre``.
* GO-LSD: the varifocal loss of each matched set keeps its own matching, but the box and distribution losses of every
  matched set (last layer, aux, pre-box and encoder) take the union of all their matchings (per image every (query,
  object) pair any set chose, a query keeping the object most sets gave it: :func:`dense_one_to_one`), normalised by
  the union's size, so that a query any layer matched is trained towards its object in every layer.
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
from pet.modeling.rtdetr.criterion import (
    RTDETRCriterion,
    denoising_matches,
    mean_over_processes,
    objects_per_process,
    prediction_index,
)
from pet.modeling.rtdetr.matcher import Matches
from pet.utils.comm import get_world_size
from pet.utils.errors import ConfigError

__all__ = ["DFineCriterion", "PredictionSet", "LOSS_LAYOUTS", "prediction_sets", "boxes_to_distances", "distance_bins",
           "fine_grained_localization", "decoupled_distillation", "edge_counts", "dense_one_to_one",
           "pairs_per_process"]

#: ``MODEL.DFINE.LOSS_LAYOUT``'s values: how the decoder's outputs are assembled into prediction sets.
LOSS_LAYOUTS = ("transformers", "original")


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


def prediction_sets(outputs: dict, layout: str = "transformers") -> tuple[list[PredictionSet], list[PredictionSet]]:
    """(matched sets, denoising sets) from the decoder's training outputs, in transformers' shifted ``layout`` or the
    ``original`` aligned one (see the module docstring). Boxes are clamped to [0, 1]; the denoising queries are split
    off the front."""
    pre = [outputs["pre_logits"], outputs["pre_boxes"].clamp(0, 1)]
    logits, boxes = list(outputs["logits"]), [b.clamp(0, 1) for b in outputs["boxes"]]
    corners, anchors = list(outputs["corners"]), outputs["anchors"]
    layers = len(corners)
    enc = (outputs["enc_logits"], outputs["enc_boxes"].clamp(0, 1))
    dn_sets: list[PredictionSet] = []
    denoising = outputs.get("denoising")
    if denoising is not None:
        split = denoising["split"]
        dn_pre, pre = _split(pre, split)
        (dn_anchors,), (anchors,) = _split([anchors], split)
        dn_logits, logits = _split(logits, split)
        dn_boxes, boxes = _split(boxes, split)
        dn_corners, corners = _split(corners, split)
        dn_sets = _layer_sets("_dn", layers, dn_pre, dn_logits, dn_boxes, dn_corners, dn_anchors, layout)
        if layout == "original":
            dn_sets.append(PredictionSet("_dn_pre", *dn_pre))
    aux = _layer_sets("_aux", layers - 1, pre, logits, boxes, corners, anchors, layout)
    if layout == "original":
        return [PredictionSet("", logits[-1], boxes[-1], corners[-1], anchors), *aux, PredictionSet("_pre", *pre),
                PredictionSet("_enc_0", *enc)], dn_sets
    return [PredictionSet("", logits[-1], boxes[-1]), *aux, PredictionSet(f"_aux_{layers - 1}", *enc)], dn_sets


def _layer_sets(prefix: str, count: int, pre: list[torch.Tensor], logits: list[torch.Tensor],
                boxes: list[torch.Tensor], corners: list[torch.Tensor], anchors: torch.Tensor,
                layout: str) -> list[PredictionSet]:
    """Sets ``{prefix}_{k}``, k < ``count``: layer k's edge distributions with its own scores and boxes (original
    layout) or those one step before (transformers': the pre-box head's for k = 0), the last layer the teacher."""
    if layout != "original":
        logits, boxes = [pre[0], *logits], [pre[1], *boxes]
    return [PredictionSet(f"{prefix}_{k}", logits[k], boxes[k], corners[k], anchors, corners[-1], logits[-1])
            for k in range(count)]


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
                           matched: torch.Tensor, temperature: float, *, whole_batch: bool = True,
                           balance: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """DDF of edge logits ``corners`` ``[B, Q, 4 * (N + 1)]`` towards ``teacher``'s (same shape; not differentiated):
    per edge ``T^2 * KL(softmax(teacher / T) || softmax(corners / T))`` times the query's weight ``[B, Q]``; the means
    over the ``matched`` ``[B, Q]`` edges and over the rest, averaged with weights sqrt(edges / B) of each side (so
    the many unmatched queries do not drown the matched ones; a side without edges, as the matched one in a batch
    without objects, gives 0, not the NaN of an empty mean). The teacher itself gives 0 (still in the graph).

    ``whole_batch``: the means and side weights are the whole batch's, over every process (all-reduced: each
    process's share of the sums over the batch's counts, times the processes, which DDP averages), so two processes
    of one image train as one of two; in one process this is the reference's per-batch mean. Every process must then
    call it alike; the denoising sets, which a process without objects has none of, use their own process's counts.
    ``balance``: the side weights' (edge counts, images) from elsewhere (:func:`edge_counts`; the original layout
    weighs the denoising sets by the matched sets' counts)."""
    per_edge = corners.shape[-1] // 4
    student, target = corners.reshape(-1, per_edge), teacher.reshape(-1, per_edge)
    if torch.equal(student, target):
        return student.sum() * 0
    kl = F.kl_div(F.log_softmax(student / temperature, dim=1), F.softmax(target.detach() / temperature, dim=1),
                  reduction="none").sum(-1)
    loss = weights.detach().flatten().repeat_interleave(4) * temperature**2 * kl
    mask = matched.flatten().repeat_interleave(4)
    counts, batch = edge_counts(matched, whole_batch)
    rows_pos, rows_neg = counts.to(loss.dtype)
    (side_pos, side_neg), side_batch = balance or (counts, batch)
    num_pos, num_neg = (side_pos.to(loss.dtype) / side_batch) ** 0.5, (side_neg.to(loss.dtype) / side_batch) ** 0.5
    processes = get_world_size() if whole_batch else 1
    pos = loss[mask].sum() / rows_pos * processes if rows_pos > 0 else 0
    neg = loss[~mask].sum() / rows_neg * processes if rows_neg > 0 else 0
    return (pos * num_pos + neg * num_neg) / (num_pos + num_neg)


def edge_counts(matched: torch.Tensor, whole_batch: bool = True) -> tuple[torch.Tensor, float]:
    """The (matched, unmatched) edge counts of ``matched`` ``[B, Q]`` and its images: of the whole batch, summed over
    the processes (all-reduced), or of this process alone."""
    counts = torch.stack([matched.sum(), (~matched).sum()]) * 4
    images = len(matched)
    if whole_batch and get_world_size() > 1:
        dist.all_reduce(counts)
        images *= get_world_size()
    return counts, float(images)


def dense_one_to_one(matchings: list[Matches]) -> Matches:
    """Per image the union of several sets' matchings: every (query, object) pair any set chose, a query chosen for
    several objects keeping the one the most sets chose it for (an object may keep several queries). The queries come
    in the order of their pairs' counts, most first. D-FINE's GO-LSD and DEIM's dense one-to-one matching are this.

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


class DFineCriterion(RTDETRCriterion):
    """``forward(outputs, targets, matcher) -> dict of losses`` on the sets of :func:`prediction_sets`; ``outputs``
    as D-FINE's decoder returns them in training (``pre_logits``, ``pre_boxes``, per layer ``logits``, ``boxes``,
    ``corners``, the ``anchors`` the distances are measured from, ``enc_logits``, ``enc_boxes``, ``denoising``),
    ``targets`` per image ``labels`` (0-based) and ``boxes`` (cx, cy, w, h in [0, 1]). Reads ``cfg.MODEL.DFINE``: the
    loss weights, W's ``NUM_BINS``, ``REG_SCALE`` and ``UP``, ``DDF_TEMPERATURE`` and ``LOSS_LAYOUT``."""

    #: The classification term's name (a subclass with another classification loss renames it).
    label_loss = "loss_vfl"

    def __init__(self, cfg: CfgNode, num_classes: int) -> None:
        super().__init__(cfg, num_classes, node_name="DFINE")
        node = cfg.MODEL.DFINE
        self.weights.update(loss_fgl=node.LOSS_FGL, loss_ddf=node.LOSS_DDF)
        # The config's values, not the model's buffers (as the reference): W of the loss follows the config.
        self.num_bins, self.reg_scale, self.up = node.NUM_BINS, node.REG_SCALE, node.UP
        self.temperature = node.DDF_TEMPERATURE
        if node.LOSS_LAYOUT not in LOSS_LAYOUTS:
            raise ConfigError(f"MODEL.DFINE.LOSS_LAYOUT {node.LOSS_LAYOUT!r} is not one of {', '.join(LOSS_LAYOUTS)}: "
                              "transformers (the default, equal to transformers' losses) or original (the paper's "
                              "aligned sets with GO-LSD's union matching).")
        self.layout = node.LOSS_LAYOUT
        # Whether the box and distribution losses take the union of the matched sets' matchings (GO-LSD).
        self.union_matching = self.layout == "original"

    def bin_values(self, device: torch.device) -> torch.Tensor:
        """W(n) ``[NUM_BINS + 1]`` for the config's ``UP`` and ``REG_SCALE``."""
        return weighting_function(self.num_bins, torch.tensor([self.up], device=device),
                                  torch.tensor([self.reg_scale], device=device))

    def loss_local(self, pset: PredictionSet, targets: list[dict], matches: Matches, num_boxes: float,
                   whole_batch: bool = True,
                   balance: tuple[torch.Tensor, float] | None = None) -> dict[str, torch.Tensor]:
        """FGL and (for a set with a teacher) DDF of a set with edge distributions; both weighted by the IoU of the
        set's matched boxes (``whole_batch``, ``balance``: :func:`decoupled_distillation`'s)."""
        idx = prediction_index(matches)
        gt_boxes = torch.cat([t["boxes"][j] for t, (_, j) in zip(targets, matches)])
        with torch.no_grad():
            ious = torch.diag(box_iou(box_convert(pset.boxes[idx], "cxcywh", "xyxy"),
                                      box_convert(gt_boxes, "cxcywh", "xyxy")))
            distances = boxes_to_distances(pset.anchors[idx], gt_boxes, self.reg_scale)
            bins, left_weight, right_weight = distance_bins(distances, self.bin_values(distances.device))
        out = {"loss_fgl": fine_grained_localization(pset.corners[idx], bins, left_weight, right_weight, ious,
                                                     num_boxes)}
        if pset.teacher_corners is not None:
            with torch.no_grad():
                weights = pset.teacher_logits.sigmoid().max(-1).values
                weights[idx] = ious.to(weights.dtype)
                matched = torch.zeros_like(weights, dtype=torch.bool)
                matched[idx] = True
            out["loss_ddf"] = decoupled_distillation(pset.corners, pset.teacher_corners, weights, matched,
                                                     self.temperature, whole_batch=whole_batch, balance=balance)
        return out

    def set_losses(self, pset: PredictionSet, targets: list[dict], matches: Matches, num_boxes: float,
                   union: Matches | None = None, num_pairs: float = 1.0, whole_batch: bool = True,
                   balance: tuple[torch.Tensor, float] | None = None) -> dict[str, torch.Tensor]:
        """Every weighted term of one set, named with its suffix: the first of :attr:`losses` (the classification
        term) under the set's own ``matches`` and ``num_boxes``, the others and the distribution terms under the
        ``union`` of the matched sets' matchings and its size where given (GO-LSD, dense one-to-one), under
        ``matches`` otherwise."""
        boxes_matches, boxes_norm = (matches, num_boxes) if union is None else (union, num_pairs)
        label, *others = self.losses
        terms = label(pset.logits, pset.boxes, targets, matches, num_boxes)
        for loss in others:
            terms.update(loss(pset.logits, pset.boxes, targets, boxes_matches, boxes_norm))
        if pset.corners is not None:
            terms.update(self.loss_local(pset, targets, boxes_matches, boxes_norm, whole_batch, balance))
        return {name + pset.suffix: value * self.weights[name] for name, value in terms.items()}

    def forward(self, outputs: dict, targets: list[dict[str, torch.Tensor]], matcher: nn.Module
                ) -> dict[str, torch.Tensor]:
        device = outputs["logits"][-1].device
        num_boxes = objects_per_process(targets, device)
        sets, dn_sets = prediction_sets(outputs, self.layout)
        matchings = [matcher(pset.logits, pset.boxes, targets) for pset in sets]
        union, num_pairs = None, 1.0
        if self.union_matching:
            union = dense_one_to_one(matchings)
            num_pairs = pairs_per_process(union, device)
        losses: dict[str, torch.Tensor] = {}
        for pset, matches in zip(sets, matchings):
            losses.update(self.set_losses(pset, targets, matches, num_boxes, union, num_pairs))
        balance = None
        if self.layout == "original" and union is not None:
            # The authors weigh the denoising sets' DDF sides by the union's counts. Counted in every process, with
            # denoising sets or without: it is an all-reduce.
            matched = torch.zeros(sets[0].logits.shape[:2], dtype=torch.bool, device=device)
            matched[prediction_index(union)] = True
            balance = edge_counts(matched)
        losses.update(self.denoising_losses(outputs, dn_sets, targets, num_boxes, balance))
        if self.layout == "transformers":
            self.keep_unsupervised_in_graph(losses, outputs)
        return losses

    def denoising_losses(self, outputs: dict, dn_sets: list[PredictionSet], targets: list[dict], num_boxes: float,
                         balance: tuple[torch.Tensor, float] | None = None) -> dict[str, torch.Tensor]:
        """The denoising sets' terms: matched by construction, normalised by ``num_boxes`` times the groups; their
        DDF means are the process's own (a process without objects has no denoising sets; ``balance``:
        :func:`decoupled_distillation`'s)."""
        if not dn_sets:
            return {}
        denoising = outputs["denoising"]
        matches = denoising_matches(denoising, targets)
        losses: dict[str, torch.Tensor] = {}
        for pset in dn_sets:
            losses.update(self.set_losses(pset, targets, matches, num_boxes * denoising["groups"],
                                          whole_batch=False, balance=balance))
        return losses

    def keep_unsupervised_in_graph(self, losses: dict[str, torch.Tensor], outputs: dict) -> None:
        """Join the never supervised scores to ``losses``' :attr:`label_loss` term with weight 0.

        transformers' shifted layout supervises the scores of layer L-2 (of the pre-box head with one layer) only
        through the denoising queries, which a process without objects (or NUM_DENOISING 0) has none of: their class
        head and quality head join the graph with weight 0, so that DistributedDataParallel, which all-reduces every
        parameter's gradient at every step, finds one in every process (as RT-DETR's label embedding)."""
        unsupervised = ([outputs["pre_logits"], *outputs["logits"]])[-2]
        losses[self.label_loss] = losses[self.label_loss] + 0.0 * unsupervised.sum()
