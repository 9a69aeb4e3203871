"""Pascal VOC's mAP@0.5 (VOC2010+ all-point AP, difficult objects ignored), checked on hand-computed cases and
reported beside COCO's numbers for a voc dataset."""
from __future__ import annotations

import json
import os
import uuid

import cv2
import numpy as np
import pytest
import torch

from pet.data import get_dataset, register_dataset
from pet.evaluation import COCOEvaluator, evaluate_results_file
from pet.evaluation.voc import voc_ap, voc_class_ap

# One class; image 1 holds g1 and a difficult g2, image 2 holds g3: two positives (difficult ones do not count).
GROUND_TRUTH = {1: (np.array([[0, 0, 10, 10], [20, 20, 30, 30]], float), np.array([False, True])),
                2: (np.array([[0, 0, 10, 10]], float), np.array([False]))}
DETECTIONS = [
    (1, 0.9, [0, 0, 10, 10]),    # g1: true positive                       tp 1, fp 0 -> recall .5, precision 1
    (1, 0.8, [20, 20, 30, 30]),  # the difficult g2: neither right nor wrong (left out of the curve)
    (1, 0.7, [1, 0, 10, 10]),    # g1 again (IoU .9): a duplicate            tp 1, fp 1 -> .5, 1/2
    (2, 0.6, [50, 50, 60, 60]),  # nothing there                             tp 1, fp 2 -> .5, 1/3
    (2, 0.5, [0, 0, 10, 12]),    # g3 (IoU 100/120)                          tp 2, fp 2 -> 1, 1/2
]
# By hand, as the VOC devkit (and detectron2's voc_ap) define it: the precision envelope is 1 up to recall .5 and
# .5 after; the area under it over the two recall steps is .5 * 1 + .5 * .5 = 0.75. (COCO's 101-point AP50 of the
# same detections is 76/101 = 0.7525: they are different metrics.)
HAND_AP = 0.75


def test_voc_ap_is_the_area_under_the_precision_envelope():
    assert voc_ap([0.5, 0.5, 0.5, 1.0], [1.0, 0.5, 1 / 3, 0.5]) == pytest.approx(HAND_AP)
    assert voc_ap([0.25, 0.5, 0.5, 0.75], [1.0, 1.0, 2 / 3, 0.75]) == pytest.approx(0.25 + 0.25 + 0.25 * 0.75)
    # A false positive first: the envelope lifts the first recall step to the later precision 2/3 (without it, 7/12).
    assert voc_ap([0.0, 0.5, 1.0], [0.0, 0.5, 2 / 3]) == pytest.approx(2 / 3)
    assert voc_ap([], []) == 0.0


def test_voc_class_ap_on_a_hand_computed_case():
    assert voc_class_ap(GROUND_TRUTH, DETECTIONS) == pytest.approx(HAND_AP)
    assert voc_class_ap(GROUND_TRUTH, list(reversed(DETECTIONS))) == pytest.approx(HAND_AP)  # sorted by score
    # IoU exactly 0.5 is not enough (the devkit's "ovmax > ovthresh"); COCO counts it.
    assert voc_class_ap({1: (np.array([[0.0, 0, 10, 10]]), np.array([False]))}, [(1, 1.0, [0, 0, 20, 10])]) == 0.0
    assert np.isnan(voc_class_ap({1: (np.zeros((1, 4)), np.array([True]))}, DETECTIONS))  # only difficult objects


def _voc_set(root):
    """GROUND_TRUTH as a VOC set (1-based inclusive coordinates) with a second class that has no object."""
    for folder in ("Annotations", "JPEGImages", "ImageSets/Main"):
        os.makedirs(root / folder)
    for stem, (boxes, difficult) in GROUND_TRUTH.items():
        cv2.imwrite(str(root / "JPEGImages" / f"{stem}.jpg"), np.zeros((40, 40, 3), np.uint8))
        objects = "".join(f"<object><name>a</name><difficult>{int(d)}</difficult><bndbox><xmin>{x0 + 1:g}</xmin>"
                          f"<ymin>{y0 + 1:g}</ymin><xmax>{x1:g}</xmax><ymax>{y1:g}</ymax></bndbox></object>"
                          for (x0, y0, x1, y1), d in zip(boxes, difficult))
        (root / "Annotations" / f"{stem}.xml").write_text(
            f"<annotation><filename>{stem}.jpg</filename><size><width>40</width><height>40</height></size>"
            f"{objects}</annotation>")
    (root / "ImageSets" / "Main" / "test.txt").write_text("1\n2\n")
    name = f"voc_{uuid.uuid4().hex[:8]}"
    register_dataset(name, str(root), format="voc", split="test", classes=["a", "b"])
    return get_dataset(name)


def test_a_voc_dataset_reports_voc_map_beside_cocos_numbers(tmp_path):
    dataset = _voc_set(tmp_path / "VOC")
    evaluator = COCOEvaluator(dataset, output_dir=str(tmp_path / "out"), diagnostics=False)
    for image_id in (1, 2):
        dets = [d for d in DETECTIONS if d[0] == image_id]
        evaluator.process([{"image_id": image_id}], [{
            "boxes": torch.tensor([d[2] for d in dets], dtype=torch.float32),
            "scores": torch.tensor([d[1] for d in dets]), "labels": torch.ones(len(dets), dtype=torch.int64)}])
    metrics = evaluator.evaluate()["bbox"]
    assert metrics["VOC_AP50"] == pytest.approx(HAND_AP * 100)  # class 'b' has no object: left out of the mean
    assert metrics["AP50"] == pytest.approx(76 / 101 * 100)  # COCO's number beside it
    rescored = evaluate_results_file(dataset, str(tmp_path / "out" / "bbox.json"))["bbox"]
    assert rescored["VOC_AP50"] == pytest.approx(HAND_AP * 100)


def test_other_formats_report_only_cocos_numbers(tmp_path):
    dataset = _voc_set(tmp_path / "VOC")
    results = [{"image_id": d[0], "category_id": 1, "score": d[1], "bbox": [d[2][0], d[2][1], d[2][2] - d[2][0],
                                                                           d[2][3] - d[2][1]]} for d in DETECTIONS]
    (tmp_path / "bbox.json").write_text(json.dumps(results))
    dataset.format = "coco"  # the same ground truth, read as COCO
    assert "VOC_AP50" not in evaluate_results_file(dataset, str(tmp_path / "bbox.json"))["bbox"]
