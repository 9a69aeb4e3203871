"""What a COCO evaluation says about a detector's mistakes: PR curves, a confusion matrix, an error breakdown.

:func:`write_diagnostics` writes, for one task (``bbox`` or ``segm``; ``keypoints`` gets the PR curves
alone, at OKS instead of IoU), next to ``bbox.json``:

- ``{task}_pr_curves.png`` / ``.json``: per class, COCO's interpolated precision at its 101 recall
  points, at IoU 0.5 and averaged over IoU 0.5:0.95 (the mean of a curve is the class's AP50 / AP),
  with the score reached at each recall (IoU 0.5);
- ``{task}_confusion_matrix.png`` / ``.json``: ground-truth class (rows, plus background: false
  positives) against predicted class (columns, plus background: missed ground truth) at one IoU and
  one score threshold;
- ``{task}_errors.png`` / ``.json``: the error breakdown, in the spirit of TIDE (Bolya et al. 2020)
  and COCO's analyze(): how many detections fall in each error type, and how many AP points fixing
  each type would add (dAP).

The curves come from COCOeval's own ``precision`` array, so they are exactly what the AP numbers
average. The confusion matrix and the error breakdown are computed here from the detections and the
ground truth, for three reasons: COCOeval matches a detection only to ground truth of its own class,
so it never sees a confusion between classes; the faster backend does not keep per-image matches; and
one implementation makes the diagnostics independent of the backend. The same-class matching below is
COCOeval's rule, so the AP this module computes at the chosen IoU equals COCOeval's (a test checks it).

Definitions (``t`` = ``iou_threshold``, ``t_b`` = ``background_iou``; IoU is box IoU for ``bbox``, mask
IoU for ``segm``):

- **Scored detections**: as COCOeval, the 100 highest-scoring detections of each class in each image.
- **True positive (COCO matching)**: detections of an image are visited in decreasing score; each takes
  the not-yet-taken ground truth of its class with the highest IoU >= t (crowd regions last and never
  used up; a detection matched to a crowd region is *ignored*: neither right nor wrong).
- Every other detection gets the first error type that applies, in this order (crowd regions never
  explain an error):

  1. ``duplicate``: IoU >= t with a ground truth of its class, already taken by a higher-scoring detection;
  2. ``classification``: IoU >= t with a ground truth of another class;
  3. ``localization``: t_b <= IoU < t with a ground truth of its class;
  4. ``both``: t_b <= IoU < t with a ground truth of another class;
  5. ``background``: IoU < t_b with every ground truth.

- ``missed``: a (non-crowd) ground truth that no true positive took and that no classification or
  localization error points at (an error points at the ground truth of highest IoU among those its
  rule considers).
- **dAP** (TIDE's oracle, Bolya et al. 2020): AP at IoU t after fixing one error type alone, minus AP
  before. A classification error gets its ground truth's class, a localization error its ground
  truth's box: each becomes a true positive when that ground truth is still free (visited in
  decreasing score; fixing never takes a ground truth away from a true positive), and is removed
  otherwise. Duplicate, both and background errors are removed. Missed ground truth is removed from
  the count of ground truth (a class left without ground truth leaves the mean, as in COCOeval).
- **Confusion matrix** at IoU t and score s: detections scoring >= s that are true positives count on
  the diagonal. Then, in decreasing score, each other (not ignored) detection takes the free
  non-crowd ground truth of any class with the highest IoU >= t (cell [its class, predicted class]),
  or else counts in the background row. Ground truth left free counts in the background column
  (missed). So a class's row sums to its number of non-crowd ground truth, and a class's column to
  its detections scoring >= s (less those ignored on crowd regions).

Counts in ``{task}_errors.json`` are given over all scored detections and over those scoring >= s.

One module of ~500 lines, on purpose: the matching rules above are shared by the confusion matrix,
the error types and dAP, and split across files they would drift apart.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pycocotools.mask as mask_util
from pycocotools.coco import COCO

from pet.evaluation.backends import COCOEvalResult
from pet.utils.files import write_json_atomic
from pet.utils.visualization import plot_confusion_matrix, plot_error_breakdown, plot_pr_curves

__all__ = ["ERROR_TYPES", "ErrorBreakdown", "ImageMatches", "confusion_matrix", "error_breakdown",
           "match_detections", "pr_curves", "write_diagnostics"]

logger = logging.getLogger(__name__)

ERROR_TYPES = ("classification", "localization", "both", "duplicate", "background", "missed")
BACKGROUND_IOU = 0.1  # TIDE's t_b: below it a detection overlaps nothing
MAX_DETS = 100  # COCOeval's largest maxDets: the detections it scores per class and image

# What a detection turned out to be (codes in the flat table of the error breakdown).
_TRUE_POSITIVE, _IGNORED, _DUPLICATE, _CLASSIFICATION, _LOCALIZATION, _BOTH, _BACKGROUND = range(7)
_KIND_OF_ERROR = {"duplicate": _DUPLICATE, "classification": _CLASSIFICATION, "localization": _LOCALIZATION,
                  "both": _BOTH, "background": _BACKGROUND}


@dataclass
class ImageMatches:
    """One image's scored detections (in decreasing score) and ground truth, their IoUs and COCO matching.

    Classes are indices into the dataset's class list (0 .. K-1). ``ious[d, g]`` is COCO's IoU
    (intersection over the detection's area for a crowd region). ``det_gt[d]`` is the ground truth
    detection ``d`` took under COCO's rule at the IoU threshold, -1 when none.
    """

    det_scores: np.ndarray
    det_classes: np.ndarray
    gt_classes: np.ndarray
    gt_crowd: np.ndarray
    ious: np.ndarray
    det_gt: np.ndarray

    @property
    def matched_crowd(self) -> np.ndarray:
        """Detections matched to a crowd region: COCOeval ignores them."""
        crowd = np.zeros(len(self.det_gt), dtype=bool)
        matched = self.det_gt >= 0
        crowd[matched] = self.gt_crowd[self.det_gt[matched]]
        return crowd

    @property
    def true_positive(self) -> np.ndarray:
        return (self.det_gt >= 0) & ~self.matched_crowd


@dataclass
class ErrorBreakdown:
    """The error breakdown (module docstring) at one IoU threshold.

    ``ap``: AP (%) at ``iou_threshold`` over the classes with ground truth (COCOeval's value).
    ``delta_ap``: AP points gained by fixing each of :data:`ERROR_TYPES` alone. ``counts`` /
    ``counts_at_score``: true positives, each error type and missed ground truth, over all scored
    detections / those scoring >= ``score_threshold``.
    """

    iou_threshold: float
    background_iou: float
    score_threshold: float
    ap: float
    delta_ap: dict[str, float]
    counts: dict[str, int]
    counts_at_score: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        return {"iou_threshold": self.iou_threshold, "background_iou": self.background_iou,
                "score_threshold": self.score_threshold, "AP": _finite_or_none(self.ap),
                "dAP": {k: _finite_or_none(v) for k, v in self.delta_ap.items()},
                "counts": self.counts, "counts_at_score": self.counts_at_score}


# ------------------------------------------------------------------------------------------------ matching
def match_detections(
    coco_gt: COCO,
    results: Sequence[dict[str, Any]],
    iou_type: str,
    image_ids: Iterable[int],
    category_ids: Sequence[int],
    iou_threshold: float,
) -> list[ImageMatches]:
    """COCO-match ``results`` (COCO result dicts of ``iou_type``) to ``coco_gt`` on ``image_ids``, per image.

    ``category_ids[k]`` is the category of class index ``k``; detections and ground truth of other
    categories are left out, as COCOeval leaves them out. Images come in sorted id order.
    """
    class_of = {cid: k for k, cid in enumerate(category_ids)}
    by_image: dict[int, list[dict[str, Any]]] = {}
    for det in results:
        if det["category_id"] in class_of:
            by_image.setdefault(det["image_id"], []).append(det)
    matches = []
    for image_id in sorted(set(image_ids)):
        gts = [a for a in coco_gt.loadAnns(coco_gt.getAnnIds(imgIds=[image_id], iscrowd=None))
               if a["category_id"] in class_of]
        dets = _scored_detections(by_image.get(image_id, []), class_of)
        gt_crowd = np.array([bool(a.get("iscrowd", 0)) for a in gts], dtype=bool)
        ious = _ious([_det_region(d, iou_type) for d in dets], [_gt_region(coco_gt, a, iou_type) for a in gts],
                     gt_crowd, iou_type)
        det_classes = np.array([class_of[d["category_id"]] for d in dets], dtype=np.int64)
        gt_classes = np.array([class_of[a["category_id"]] for a in gts], dtype=np.int64)
        matches.append(ImageMatches(
            det_scores=np.array([d["score"] for d in dets], dtype=np.float64), det_classes=det_classes,
            gt_classes=gt_classes, gt_crowd=gt_crowd, ious=ious,
            det_gt=_coco_match(ious, det_classes, gt_classes, gt_crowd, iou_threshold),
        ))
    return matches


def _scored_detections(dets: list[dict[str, Any]], class_of: dict[int, int]) -> list[dict[str, Any]]:
    """The image's detections COCOeval scores (the top MAX_DETS per class), in decreasing score, ties in input order."""
    order = np.argsort([-d["score"] for d in dets], kind="stable")
    per_class = np.zeros(len(class_of), dtype=np.int64)
    kept = []
    for i in order:
        k = class_of[dets[i]["category_id"]]
        if per_class[k] < MAX_DETS:
            per_class[k] += 1
            kept.append(dets[i])
    return kept


def _det_region(det: dict[str, Any], iou_type: str) -> Any:
    return det["bbox"] if iou_type == "bbox" else det["segmentation"]  # XYWH, or an RLE


def _gt_region(coco_gt: COCO, ann: dict[str, Any], iou_type: str) -> Any:
    return ann["bbox"] if iou_type == "bbox" else coco_gt.annToRLE(ann)  # polygons and RLEs alike


def _ious(dets: list[Any], gts: list[Any], gt_crowd: np.ndarray, iou_type: str) -> np.ndarray:
    if not dets or not gts:
        return np.zeros((len(dets), len(gts)), dtype=np.float64)
    if iou_type == "bbox":
        dets, gts = np.asarray(dets, dtype=np.float64), np.asarray(gts, dtype=np.float64)
    return np.asarray(mask_util.iou(dets, gts, gt_crowd.astype(np.uint8).tolist()), dtype=np.float64)


def _coco_match(
    ious: np.ndarray, det_classes: np.ndarray, gt_classes: np.ndarray, gt_crowd: np.ndarray, iou_threshold: float
) -> np.ndarray:
    """COCOeval.evaluateImg's greedy matching at one IoU threshold, every class of one image at once.

    As there: a detection keeps the best IoU >= the threshold, a later ground truth with an equal IoU
    wins, taken non-crowd ground truth is skipped, and crowd regions (visited last) are only used
    when no non-crowd ground truth qualifies.
    """
    det_gt = np.full(len(det_classes), -1, dtype=np.int64)
    threshold = min(iou_threshold, 1 - 1e-10)
    same_class = det_classes[:, None] == gt_classes[None, :]
    candidates = np.flatnonzero(((ious >= threshold) & same_class).any(axis=1))
    gt_order = np.argsort(gt_crowd, kind="stable")
    taken = np.zeros(len(gt_classes), dtype=bool)
    for d in candidates:  # in decreasing score
        best, match = threshold, -1
        for g in gt_order:
            if not same_class[d, g] or (taken[g] and not gt_crowd[g]):
                continue
            if match > -1 and not gt_crowd[match] and gt_crowd[g]:
                break
            if ious[d, g] >= best:
                best, match = ious[d, g], g
        if match > -1:
            det_gt[d] = match
            taken[match] = True
    return det_gt


# ------------------------------------------------------------------------------------------------ confusion matrix
def confusion_matrix(
    matches: Sequence[ImageMatches], num_classes: int, iou_threshold: float, score_threshold: float
) -> np.ndarray:
    """``[K+1, K+1]`` counts: rows ground-truth class, columns predicted class; index K is background.

    ``matches`` must come from :func:`match_detections` at ``iou_threshold``. See the module
    docstring for the rule.
    """
    matrix = np.zeros((num_classes + 1, num_classes + 1), dtype=np.int64)
    background = num_classes
    threshold = min(iou_threshold, 1 - 1e-10)
    for m in matches:
        kept = m.det_scores >= score_threshold
        true_positive = kept & m.true_positive
        taken = np.zeros(len(m.gt_classes), dtype=bool)
        taken[m.det_gt[true_positive]] = True
        np.add.at(matrix, (m.gt_classes[m.det_gt[true_positive]], m.det_classes[true_positive]), 1)
        for d in np.flatnonzero(kept & (m.det_gt < 0)):
            ious = np.where(taken | m.gt_crowd, -1.0, m.ious[d])
            g = int(np.argmax(ious)) if len(ious) else -1
            if g >= 0 and ious[g] >= threshold:
                taken[g] = True
                matrix[m.gt_classes[g], m.det_classes[d]] += 1
            else:
                matrix[background, m.det_classes[d]] += 1
        missed = ~taken & ~m.gt_crowd
        np.add.at(matrix, (m.gt_classes[missed], background), 1)
    return matrix


# ------------------------------------------------------------------------------------------------ error breakdown
@dataclass
class _Table:
    """Every scored detection of the dataset, sorted as COCOeval's accumulate() sorts them (decreasing
    score; ties by image, then by rank in the image), with its kind and the (global) ground truth it
    points at; and every ground truth's class and crowd flag."""

    score: np.ndarray
    cls: np.ndarray
    kind: np.ndarray
    target: np.ndarray
    gt_cls: np.ndarray
    gt_crowd: np.ndarray


def _detection_kinds(m: ImageMatches, iou_threshold: float, background_iou: float) -> tuple[np.ndarray, np.ndarray]:
    """Kind and pointed-at ground truth (-1 for none) of each detection of one image (module docstring rules)."""
    kind = np.full(len(m.det_scores), _BACKGROUND, dtype=np.int64)
    target = m.det_gt.copy()
    kind[m.true_positive] = _TRUE_POSITIVE
    kind[m.matched_crowd] = _IGNORED
    if not len(m.gt_classes):
        return kind, target
    threshold = min(iou_threshold, 1 - 1e-10)
    ious = np.where(m.gt_crowd[None, :], -1.0, m.ious)
    same_class = m.det_classes[:, None] == m.gt_classes[None, :]
    same = np.where(same_class, ious, -1.0)
    other = np.where(same_class, -1.0, ious)
    best_same, best_other = same.max(axis=1), other.max(axis=1)
    open_ = m.det_gt < 0
    for new_kind, condition, pointed in (
        (_DUPLICATE, best_same >= threshold, same),
        (_CLASSIFICATION, best_other >= threshold, other),
        (_LOCALIZATION, best_same >= background_iou, same),
        (_BOTH, best_other >= background_iou, None),
    ):
        hit = open_ & condition
        kind[hit] = new_kind
        if pointed is not None:
            target[hit] = pointed[hit].argmax(axis=1)
        open_ &= ~hit
    return kind, target


def _table(matches: Sequence[ImageMatches], iou_threshold: float, background_iou: float) -> _Table:
    columns: dict[str, list[np.ndarray]] = {k: [] for k in ("score", "cls", "kind", "target", "image", "rank")}
    offset = 0
    for image_index, m in enumerate(matches):
        kind, target = _detection_kinds(m, iou_threshold, background_iou)
        columns["score"].append(m.det_scores)
        columns["cls"].append(m.det_classes)
        columns["kind"].append(kind)
        columns["target"].append(np.where(target >= 0, target + offset, -1))
        columns["image"].append(np.full(len(kind), image_index))
        columns["rank"].append(np.arange(len(kind)))
        offset += len(m.gt_classes)
    flat = {k: np.concatenate(v) if v else np.zeros(0) for k, v in columns.items()}
    order = np.lexsort((flat["rank"], flat["image"], -flat["score"]))
    return _Table(
        score=flat["score"][order], cls=flat["cls"][order].astype(np.int64), kind=flat["kind"][order].astype(np.int64),
        target=flat["target"][order].astype(np.int64),
        gt_cls=np.concatenate([m.gt_classes for m in matches]) if matches else np.zeros(0, np.int64),
        gt_crowd=np.concatenate([m.gt_crowd for m in matches]) if matches else np.zeros(0, bool),
    )


def _mean_ap(cls: np.ndarray, tp: np.ndarray, num_gt: np.ndarray, recall_thresholds: np.ndarray) -> float:
    """COCO's 101-point interpolated AP (%) averaged over classes with ground truth; detections in score order.

    The arithmetic is COCOeval.accumulate()'s (precision tp / (tp + fp + eps), made non-increasing,
    read at the first point reaching each recall threshold), so it gives the same numbers.
    """
    aps = []
    for k in np.flatnonzero(num_gt > 0):
        hits = tp[cls == k]
        if not len(hits):
            aps.append(0.0)
            continue
        tps = np.cumsum(hits, dtype=np.float64)
        fps = np.cumsum(~hits, dtype=np.float64)
        recall = tps / num_gt[k]
        precision = np.maximum.accumulate((tps / (fps + tps + np.spacing(1)))[::-1])[::-1]
        index = np.searchsorted(recall, recall_thresholds, side="left")
        aps.append(np.where(index < len(precision), precision[np.minimum(index, len(precision) - 1)], 0.0).mean())
    return float(np.mean(aps) * 100) if aps else float("nan")


def _num_gt(table: _Table, num_classes: int) -> np.ndarray:
    return np.bincount(table.gt_cls[~table.gt_crowd], minlength=num_classes).astype(np.float64)


def _missed(table: _Table, kept: np.ndarray) -> np.ndarray:
    """Non-crowd ground truth that no kept true positive, classification or localization error points at."""
    covered = np.zeros(len(table.gt_cls), dtype=bool)
    pointing = kept & np.isin(table.kind, (_TRUE_POSITIVE, _CLASSIFICATION, _LOCALIZATION))
    covered[table.target[pointing]] = True
    return ~covered & ~table.gt_crowd


def _ap_after_fixing(error: str, table: _Table, num_classes: int, recall_thresholds: np.ndarray) -> float:
    """AP (%) once every error of one type is fixed (TIDE's oracle; module docstring)."""
    cls, tp, keep = table.cls.copy(), table.kind == _TRUE_POSITIVE, table.kind != _IGNORED
    num_gt = _num_gt(table, num_classes)
    if error == "missed":
        num_gt -= np.bincount(table.gt_cls[_missed(table, np.ones(len(cls), bool))], minlength=num_classes)
    elif error in ("classification", "localization"):
        taken = np.zeros(len(table.gt_cls), dtype=bool)
        taken[table.target[tp]] = True
        for d in np.flatnonzero(table.kind == _KIND_OF_ERROR[error]):  # in decreasing score
            g = table.target[d]
            if taken[g]:
                keep[d] = False
            else:
                taken[g], tp[d], cls[d] = True, True, table.gt_cls[g]
    else:
        keep &= table.kind != _KIND_OF_ERROR[error]
    return _mean_ap(cls[keep], tp[keep], num_gt, recall_thresholds)


def _counts(table: _Table, kept: np.ndarray) -> dict[str, int]:
    """True positives, then :data:`ERROR_TYPES` in order, among the ``kept`` detections."""
    counts = {"true_positive": int(np.count_nonzero(kept & (table.kind == _TRUE_POSITIVE)))}
    for name in ERROR_TYPES:
        found = _missed(table, kept) if name == "missed" else kept & (table.kind == _KIND_OF_ERROR[name])
        counts[name] = int(np.count_nonzero(found))
    return counts


def error_breakdown(
    matches: Sequence[ImageMatches],
    num_classes: int,
    iou_threshold: float,
    score_threshold: float,
    background_iou: float = BACKGROUND_IOU,
) -> ErrorBreakdown:
    """Classify every scored detection and missed ground truth, and the AP each error type costs.

    ``matches`` must come from :func:`match_detections` at ``iou_threshold``. Definitions in the
    module docstring.
    """
    table = _table(matches, iou_threshold, background_iou)
    recall_thresholds = np.linspace(0.0, 1.0, 101)  # COCOeval's
    tp = table.kind == _TRUE_POSITIVE
    keep = table.kind != _IGNORED
    ap = _mean_ap(table.cls[keep], tp[keep], _num_gt(table, num_classes), recall_thresholds)
    return ErrorBreakdown(
        iou_threshold=iou_threshold, background_iou=background_iou, score_threshold=score_threshold, ap=ap,
        delta_ap={e: _ap_after_fixing(e, table, num_classes, recall_thresholds) - ap for e in ERROR_TYPES},
        counts=_counts(table, np.ones(len(table.score), dtype=bool)),
        counts_at_score=_counts(table, table.score >= score_threshold),
    )


# ------------------------------------------------------------------------------------------------ PR curves
def pr_curves(result: COCOEvalResult, class_names: Sequence[str], category_ids: Sequence[int]) -> dict[str, Any]:
    """Per class, COCOeval's interpolated precision at each recall threshold (area "all", 100 detections).

    ``precision_iou50`` at IoU 0.5, ``precision_iou50_95`` averaged over the ten IoU thresholds (so
    the mean of each curve is the class's AP50 / AP), ``score_iou50`` the lowest score kept to reach
    each recall at IoU 0.5. A class without ground truth has ``None`` curves and APs.
    """
    iou50 = int(np.flatnonzero(np.isclose(result.iou_thresholds, 0.5))[0])
    area_all = result.area_ranges.index("all")
    column = {cid: k for k, cid in enumerate(result.category_ids)}
    classes = []
    for name, cid in zip(class_names, category_ids):
        precision = result.precision[:, :, column[cid], area_all, -1]  # [T, R]
        if (precision < 0).any():  # COCOeval's -1: no ground truth
            classes.append({"name": name, "AP50": None, "AP": None, "precision_iou50": None,
                            "precision_iou50_95": None, "score_iou50": None})
            continue
        scores = result.scores[iou50, :, column[cid], area_all, -1]
        classes.append({
            "name": name, "AP50": float(precision[iou50].mean() * 100), "AP": float(precision.mean() * 100),
            "precision_iou50": precision[iou50].tolist(), "precision_iou50_95": precision.mean(axis=0).tolist(),
            "score_iou50": scores.tolist(),
        })
    return {"recall": result.recall_thresholds.tolist(), "classes": classes}


# ------------------------------------------------------------------------------------------------ files
def write_diagnostics(
    output_dir: str,
    iou_type: str,
    result: COCOEvalResult,
    coco_gt: COCO,
    results: Sequence[dict[str, Any]],
    image_ids: Iterable[int],
    class_names: Sequence[str],
    category_ids: Sequence[int],
    iou_threshold: float = 0.5,
    score_threshold: float = 0.5,
) -> list[str]:
    """Write the PR curves, confusion matrix and error breakdown of one task into ``output_dir``.

    ``result`` is the task's COCOeval (:func:`pet.evaluation.backends.run_cocoeval`) of ``results``
    on ``image_ids``; ``class_names[k]`` / ``category_ids[k]`` name class index ``k``. Returns the
    paths written (module docstring).
    """
    os.makedirs(output_dir, exist_ok=True)
    stem = os.path.join(output_dir, iou_type)
    curves = pr_curves(result, class_names, category_ids)
    write_json_atomic(f"{stem}_pr_curves.json", {"iou_type": iou_type, **curves})
    pr_png = plot_pr_curves(curves["classes"], curves["recall"], f"{stem}_pr_curves.png", title=iou_type)
    if iou_type == "keypoints":  # matching by box or mask here: the boxes' files say which box found which object
        return [f"{stem}_pr_curves.json", pr_png]
    matches = match_detections(coco_gt, results, iou_type, image_ids, category_ids, iou_threshold)
    matrix = confusion_matrix(matches, len(class_names), iou_threshold, score_threshold)
    errors = error_breakdown(matches, len(class_names), iou_threshold, score_threshold)
    labels = [*class_names, "background"]
    write_json_atomic(f"{stem}_confusion_matrix.json", {
        "iou_type": iou_type, "iou_threshold": iou_threshold, "score_threshold": score_threshold,
        "rows": "ground truth", "columns": "prediction", "labels": labels, "matrix": matrix.tolist()})
    write_json_atomic(f"{stem}_errors.json", {"iou_type": iou_type, **errors.to_json()})
    title = f"{iou_type}, IoU {iou_threshold:g}"
    paths = [
        pr_png,
        plot_confusion_matrix(matrix, labels, f"{stem}_confusion_matrix.png",
                              title=f"{title}, score >= {score_threshold:g}"),
        plot_error_breakdown(errors.delta_ap, errors.counts_at_score, f"{stem}_errors.png",
                             title=f"{title} (AP {errors.ap:.1f}); counts at score >= {score_threshold:g}"),
    ]
    logger.info(f"{iou_type} diagnostics (PR curves, confusion matrix, errors) written to {output_dir}: dAP "
                + ", ".join(f"{k} {v:+.2f}" for k, v in errors.delta_ap.items()))
    return [f"{stem}_{name}.json" for name in ("pr_curves", "confusion_matrix", "errors")] + paths


def _finite_or_none(value: float) -> float | None:
    return float(value) if np.isfinite(value) else None
