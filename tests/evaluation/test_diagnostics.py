"""Evaluation diagnostics: PR curves, confusion matrix and error breakdown, checked on a case worked by hand.

The hand case: two 100x100 images, classes cat (id 1) and dog (id 2); boxes XYWH, IoU at 0.5, score 0.5.

    image 1  g1 cat [10,10,20,20]  g2 cat [50,50,20,20]  g3 dog [10,60,20,20]
             d1 cat 0.90 = g1 (TP)          d2 cat 0.80 shifted 1 px from g1 (IoU .905: duplicate)
             d3 dog 0.70 = g2 (classification error)      d4 dog 0.30 = g3 (TP, below the score)
    image 2  g4 dog [20,20,30,30]  g5 dog [60,10,20,20]  g6 cat crowd [0,60,50,40]
             d5 dog 0.95 [20,20,30,26.4] (IoU .88 with g4: TP up to IoU .85, FP at .9 and .95)
             d6 dog 0.60 [60,10,20,8] (IoU .4 with g5: localization error)
             d7 cat 0.55 [80,80,10,10] (nothing: background)   d8 cat 0.85 inside g6 (ignored)
"""
from __future__ import annotations

import contextlib
import io
import json
import os

import cv2
import numpy as np
import pytest
import torch
from pycocotools.coco import COCO

from pet.engine.inference import evaluate_on_datasets
from pet.evaluation.backends import run_cocoeval
from pet.evaluation.diagnostics import confusion_matrix, error_breakdown, match_detections
from support.helpers import data_cfg, write_coco
from support.synthetic_coco import synthetic_detections, synthetic_ground_truth

GT_BOXES = {  # image id -> [(category id, XYWH, iscrowd)]
    1: [(1, [10, 10, 20, 20], 0), (1, [50, 50, 20, 20], 0), (2, [10, 60, 20, 20], 0)],
    2: [(2, [20, 20, 30, 30], 0), (2, [60, 10, 20, 20], 0), (1, [0, 60, 50, 40], 1)],
}
DETECTIONS = {  # image id -> [(label, XYWH, score)]; labels 1 cat, 2 dog
    1: [(1, [10, 10, 20, 20], 0.9), (1, [11, 10, 20, 20], 0.8), (2, [50, 50, 20, 20], 0.7),
        (2, [10, 60, 20, 20], 0.3)],
    2: [(2, [20, 20, 30, 26.4], 0.95), (2, [60, 10, 20, 8], 0.6), (1, [80, 80, 10, 10], 0.55),
        (1, [5, 65, 20, 20], 0.85)],
}
R = 101  # COCO's recall thresholds 0, 0.01, ..., 1


def _hand_dataset(tmp_path) -> str:
    annotations = []
    for image_id, boxes in GT_BOXES.items():
        for category_id, (x, y, w, h), crowd in boxes:
            annotations.append({"id": len(annotations) + 1, "image_id": image_id, "category_id": category_id,
                                "bbox": [x, y, w, h], "area": w * h, "iscrowd": crowd,
                                "segmentation": [[x, y, x + w, y, x + w, y + h, x, y + h]]})
    name, _, _ = write_coco(tmp_path, images=((1, 100, 100), (2, 100, 100)), annotations=annotations,
                            categories=[{"id": 1, "name": "cat"}, {"id": 2, "name": "dog"}])
    return name


class _FixedDetector(torch.nn.Module):
    """Returns DETECTIONS for each image of the batch (original pixels), with box masks when ``masks``."""

    def __init__(self, masks: bool) -> None:
        super().__init__()
        self.masks = masks
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, images, targets):
        outputs = []
        for target in targets:
            dets = DETECTIONS[int(target["image_id"])]
            boxes = torch.tensor([[x, y, x + w, y + h] for _, (x, y, w, h), _ in dets])
            output = {"boxes": boxes, "scores": torch.tensor([s for *_, s in dets]),
                      "labels": torch.tensor([label for label, *_ in dets])}
            if self.masks:
                output["masks"] = torch.zeros(len(dets), 100, 100, dtype=torch.uint8)
                for mask, (x0, y0, x1, y1) in zip(output["masks"], boxes.round().int().tolist()):
                    mask[y0:y1, x0:x1] = 1
            outputs.append(output)
        return outputs


@pytest.fixture(scope="module")
def test_run(tmp_path_factory):
    """What tools/test_net.py (and the EvalHook) run: evaluate_on_datasets into an output folder."""
    tmp_path = tmp_path_factory.mktemp("hand")
    cfg = data_cfg("TEST.DATASETS", (_hand_dataset(tmp_path),), "TEST.IMS_PER_BATCH", 2, "MODEL.NUM_CLASSES", 2,
                   "TEST.AMP.ENABLED", False)
    out = str(tmp_path / "test")
    metrics = evaluate_on_datasets(cfg, _FixedDetector(masks=True), out)
    return out, metrics


def _read(out: str, name: str) -> dict:
    with open(os.path.join(out, name)) as f:
        return json.load(f)


def test_a_test_run_writes_readable_pictures_and_json(test_run):
    out, _ = test_run
    for task in ("bbox", "segm"):
        for name in ("pr_curves", "confusion_matrix", "errors"):
            _read(out, f"{task}_{name}.json")
            image = cv2.imread(os.path.join(out, f"{task}_{name}.png"))
            assert image is not None and image.shape[0] > 100 and image.shape[1] > 100, (task, name)


def test_confusion_matrix_matches_the_hand_count(test_run):
    out, _ = test_run
    confusion = _read(out, "bbox_confusion_matrix.json")
    assert confusion["labels"] == ["cat", "dog", "background"]
    assert (confusion["iou_threshold"], confusion["score_threshold"]) == (0.5, 0.5)
    # rows: ground truth cat, dog, background (false positives); columns: predicted cat, dog, background (missed)
    assert confusion["matrix"] == [
        [1, 1, 0],  # g1 found (d1); g2 taken for a dog (d3)
        [0, 1, 2],  # g4 found (d5); g3 (d4 scores 0.3) and g5 (d6 at IoU 0.4) missed
        [2, 1, 0],  # d2 (duplicate) and d7 (background) as cat, d6 as dog; d8 on the crowd region is ignored
    ]
    # Rectangular masks over the same boxes: the mask IoUs cross 0.5 where the box IoUs do.
    assert _read(out, "segm_confusion_matrix.json")["matrix"] == confusion["matrix"]


def test_pr_curves_match_the_hand_computed_precision(test_run):
    out, metrics = test_run
    curves = {c["name"]: c for c in _read(out, "bbox_pr_curves.json")["classes"]}
    # cat: d1 TP, d2 FP, d7 FP with 2 ground truth -> precision 1 up to recall 0.5, then nothing; every IoU alike.
    assert curves["cat"]["precision_iou50"] == pytest.approx([1.0] * 51 + [0.0] * 50)
    assert curves["cat"]["precision_iou50_95"] == pytest.approx(curves["cat"]["precision_iou50"])
    # dog at IoU <= .85: d5 TP, d3 FP, d6 FP, d4 TP of 3 -> 1 to recall 1/3, then 2/4 to 2/3.
    assert curves["dog"]["precision_iou50"] == pytest.approx([1.0] * 34 + [0.5] * 33 + [0.0] * 34)
    # at IoU .9 and .95 d5 misses too: only d4, 4th of 4 -> 0.25 to recall 1/3. Mean of 8 + 2 thresholds:
    assert curves["dog"]["precision_iou50_95"] == pytest.approx([0.85] * 34 + [0.4] * 33 + [0.0] * 34)
    assert curves["cat"]["AP50"] == pytest.approx(100 * 51 / R)
    assert curves["dog"]["AP"] == pytest.approx(100 * (34 * 0.85 + 33 * 0.4) / R)
    assert metrics["bbox/AP-dog"] == pytest.approx(curves["dog"]["AP"])
    assert metrics["bbox/AP50"] == pytest.approx(100 * (51 + 50.5) / (2 * R))


def test_error_breakdown_matches_the_hand_count(test_run):
    out, metrics = test_run
    errors = _read(out, "bbox_errors.json")
    assert errors["counts"] == {"true_positive": 3, "classification": 1, "localization": 1, "both": 0,
                                "duplicate": 1, "background": 1, "missed": 0}
    # At score 0.5 d4 is gone: g3 becomes missed.
    assert errors["counts_at_score"] == {"true_positive": 2, "classification": 1, "localization": 1, "both": 0,
                                         "duplicate": 1, "background": 1, "missed": 1}
    assert errors["AP"] == pytest.approx(metrics["bbox/AP50"])
    # Fixing d3's class makes it cat's 2nd TP: cat 1 to recall .5, 2/3 to 1; dog loses an FP: 1, then 2/3.
    # Fixing d6's box makes it dog's TP for g5: dog 1 to recall 1/3, then 3/4 to 1.
    # Removing d2 (duplicate) or d7 (background) changes no interpolated precision; nothing is missed.
    before = 51 + 50.5
    assert errors["dAP"] == pytest.approx({
        "classification": 100 * ((51 + 50 * 2 / 3) + (34 + 33 * 2 / 3) - before) / (2 * R),
        "localization": 100 * (51 + 34 + 67 * 0.75 - before) / (2 * R),
        "both": 0.0, "duplicate": 0.0, "background": 0.0, "missed": 0.0,
    })


def test_diagnostics_follow_the_config(tmp_path):
    name = _hand_dataset(tmp_path)
    base = ("TEST.DATASETS", (name,), "MODEL.NUM_CLASSES", 2, "TEST.AMP.ENABLED", False)
    evaluate_on_datasets(data_cfg(*base, "TEST.DIAGNOSTICS.SCORE", 0.25), _FixedDetector(masks=False),
                         str(tmp_path / "low"))
    # d4 (0.30) now counts: g3 is found instead of missed.
    assert _read(str(tmp_path / "low"), "bbox_confusion_matrix.json")["matrix"][1] == [0, 2, 1]
    evaluate_on_datasets(data_cfg(*base, "TEST.DIAGNOSTICS.ENABLED", False), _FixedDetector(masks=False),
                         str(tmp_path / "off"))
    assert sorted(os.listdir(tmp_path / "off")) == ["bbox.json"]


@pytest.fixture(scope="module")
def random_case():
    """Perturbed detections on COCO-like ground truth with crowd regions, and its pycocotools objects."""
    gt = synthetic_ground_truth(40, num_classes=4, seed=5, crowd_fraction=0.08)
    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO()
        coco.dataset = gt
        coco.createIndex()
    return gt, coco, synthetic_detections(gt, seed=5, masks=True, score_decimals=2)


@pytest.mark.parametrize("iou_type", ["bbox", "segm"])
@pytest.mark.parametrize("iou", [0.5, 0.75])
def test_the_matching_is_cocoevals(random_case, iou_type, iou):
    """Diagnostics' own matching gives COCOeval's AP at that IoU, crowd regions and score ties included."""
    gt, coco, dets = random_case
    results = [{k: v for k, v in d.items() if k != ("segmentation" if iou_type == "bbox" else "bbox")} for d in dets]
    image_ids = [image["id"] for image in gt["images"]]
    assert any(a["iscrowd"] for a in gt["annotations"])
    coco_eval = run_cocoeval(coco, results, iou_type, image_ids, "pycocotools")
    matches = match_detections(coco, results, iou_type, image_ids, [1, 2, 3, 4], iou)
    breakdown = error_breakdown(matches, 4, iou, 0.5)
    assert breakdown.ap == pytest.approx(coco_eval.stats[1 if iou == 0.5 else 2] * 100, abs=1e-9)
    assert 20 < breakdown.ap < 95  # a case with both hits and mistakes


def test_confusion_matrix_rows_and_columns_add_up(random_case):
    gt, coco, dets = random_case
    results = [{k: v for k, v in d.items() if k != "segmentation"} for d in dets]
    matches = match_detections(coco, results, "bbox", [image["id"] for image in gt["images"]], [1, 2, 3, 4], 0.5)
    matrix = confusion_matrix(matches, 4, 0.5, 0.3)
    gt_per_class = np.bincount([a["category_id"] - 1 for a in gt["annotations"] if not a["iscrowd"]], minlength=4)
    assert matrix[:4].sum(axis=1).tolist() == gt_per_class.tolist()
    kept = np.bincount(np.concatenate([m.det_classes[(m.det_scores >= 0.3) & ~m.matched_crowd] for m in matches]),
                       minlength=4)
    assert matrix[:, :4].sum(axis=0).tolist() == kept.tolist()
    assert matrix[4, 4] == 0 and np.trace(matrix[:4, :4]) > 0 and matrix[:4, :4].sum() > np.trace(matrix[:4, :4])
