"""Pascal VOC's detection metric (VOC2010 and later): per-class AP at IoU 0.5, and their mean.

VOC users compare with this number, not COCO's AP50, which interpolates precision at 101
recall points and treats crowd regions its own way. Here, as in the VOC devkit:

- detections of a class are taken by decreasing score over all images; each goes to the ground
  truth box of its class it overlaps most in its image; above the IoU threshold (strictly) it is a
  true positive if that box is not yet taken and not difficult, ignored if the box is difficult,
  and a false positive if the box was taken already; otherwise a false positive;
- AP is the area under the precision-recall curve after making precision monotone (each point
  takes the best precision at any higher recall), summed over every recall step (all points, not
  VOC2007's 11).

Boxes are continuous XYXY (a VOC box read as ``[xmin - 1, ymin - 1, xmax, ymax]``), so the
devkit's "+1" pixel widths are already in them. Difficult objects are the ground truth's crowd
regions (``iscrowd``), as :mod:`pet.data.formats.voc` stores them.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["voc_ap", "voc_class_ap", "voc_evaluate"]


def voc_ap(recall: Sequence[float] | np.ndarray, precision: Sequence[float] | np.ndarray) -> float:
    """Area under the monotone precision envelope of a PR curve given at each detection (VOC2010+)."""
    recall = np.concatenate([[0.0], np.asarray(recall, dtype=np.float64), [1.0]])
    precision = np.concatenate([[0.0], np.asarray(precision, dtype=np.float64), [0.0]])
    envelope = np.maximum.accumulate(precision[::-1])[::-1]
    steps = np.flatnonzero(recall[1:] != recall[:-1])
    return float(np.sum((recall[steps + 1] - recall[steps]) * envelope[steps + 1]))


def voc_class_ap(
    ground_truth: Mapping[Any, tuple[np.ndarray, np.ndarray]],
    detections: Iterable[tuple[Any, float, Sequence[float]]],
    iou_threshold: float = 0.5,
) -> float:
    """AP of one class: ``ground_truth`` maps an image to (XYXY boxes [N, 4], difficult flags [N]),
    ``detections`` are ``(image, score, XYXY box)``. NaN when the class has no non-difficult box."""
    num_positives = sum(int((~difficult).sum()) for _, difficult in ground_truth.values())
    if num_positives == 0:
        return float("nan")
    detections = sorted(detections, key=lambda d: -d[1])
    taken = {image: np.zeros(len(boxes), dtype=bool) for image, (boxes, _) in ground_truth.items()}
    tp = np.zeros(len(detections))
    fp = np.zeros(len(detections))
    for k, (image, _, box) in enumerate(detections):
        boxes, difficult = ground_truth.get(image, (np.zeros((0, 4)), np.zeros(0, dtype=bool)))
        overlaps = _iou(np.asarray(box, dtype=np.float64), boxes)
        best = int(np.argmax(overlaps)) if len(overlaps) else -1
        if best < 0 or overlaps[best] <= iou_threshold:
            fp[k] = 1
        elif difficult[best]:
            continue  # neither right nor wrong
        elif taken[image][best]:
            fp[k] = 1  # a duplicate
        else:
            tp[k] = 1
            taken[image][best] = True
    tp, fp = np.cumsum(tp), np.cumsum(fp)
    recall = tp / num_positives
    precision = tp / np.maximum(tp + fp, np.finfo(np.float64).eps)
    return voc_ap(recall, precision)


def voc_evaluate(
    coco_gt: Any, results: Sequence[Mapping[str, Any]], image_ids: Iterable[int], iou_threshold: float = 0.5
) -> dict[int, float]:
    """Per category id, the VOC AP of COCO ``results`` against the pycocotools ground truth ``coco_gt`` on
    ``image_ids`` (crowd regions are the difficult objects). NaN for a category without non-difficult boxes."""
    image_ids = set(image_ids)
    ground_truth: dict[int, dict[int, tuple[list, list]]] = defaultdict(dict)
    for ann in coco_gt.loadAnns(coco_gt.getAnnIds(imgIds=sorted(image_ids))):
        x, y, w, h = ann["bbox"]
        boxes, difficult = ground_truth[ann["category_id"]].setdefault(ann["image_id"], ([], []))
        boxes.append([x, y, x + w, y + h])
        difficult.append(bool(ann.get("iscrowd", 0)))
    detections: dict[int, list[tuple[int, float, list[float]]]] = defaultdict(list)
    for det in results:
        if det["image_id"] in image_ids:
            x, y, w, h = det["bbox"]
            detections[det["category_id"]].append((det["image_id"], float(det["score"]), [x, y, x + w, y + h]))
    aps = {}
    for category_id in sorted(coco_gt.getCatIds()):
        per_image = {image: (np.asarray(b, dtype=np.float64).reshape(-1, 4), np.asarray(d, dtype=bool))
                     for image, (b, d) in ground_truth[category_id].items()}
        aps[category_id] = voc_class_ap(per_image, detections[category_id], iou_threshold)
    return aps


def _iou(box: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    if len(boxes) == 0:
        return np.zeros(0)
    iw = np.clip(np.minimum(boxes[:, 2], box[2]) - np.maximum(boxes[:, 0], box[0]), 0, None)
    ih = np.clip(np.minimum(boxes[:, 3], box[3]) - np.maximum(boxes[:, 1], box[1]), 0, None)
    inter = iw * ih
    union = (box[2] - box[0]) * (box[3] - box[1]) + (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]) - inter
    return inter / np.maximum(union, np.finfo(np.float64).eps)
