"""faster-coco-eval against pycocotools (the reference): the 12 COCO numbers must agree within 1e-6.

Cases: detections made from the generated shapes set's ground truth (as a trained demo model errs:
jittered boxes and masks, wrong classes, duplicates, misses, background), with tied scores, with
crowd regions, with images and classes left without detections, no detections at all, and
COCO-like ground truth whose objects cover the three area ranges, some exactly on their borders.
"""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import json
import os

import numpy as np
import pytest
import torch
from pycocotools.coco import COCO

from pet.config import load_cfg
from pet.evaluation import COCOEvaluator
from pet.evaluation import backends as backends_module
from pet.evaluation.backends import resolve_coco_library, run_cocoeval
from pet.utils.errors import ConfigError
from support.synthetic_coco import synthetic_detections, synthetic_ground_truth

needs_faster = pytest.mark.skipif(importlib.util.find_spec("faster_coco_eval") is None,
                                  reason="faster-coco-eval is not installed (pip install faster-coco-eval)")
TASKS = ("bbox", "segm")


def _coco(gt: dict) -> COCO:
    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO()
        coco.dataset = copy.deepcopy(gt)
        coco.createIndex()
    return coco


def _task(results: list[dict], iou_type: str) -> list[dict]:
    other = "segmentation" if iou_type == "bbox" else "bbox"
    return [{k: v for k, v in d.items() if k != other} for d in results]


@pytest.fixture(scope="module")
def shapes_gt(shapes_set) -> dict:
    with open(os.path.join(shapes_set(num_train=2, num_val=40, seed=4), "annotations", "val.json")) as f:
        return json.load(f)


def _with_crowd(gt: dict) -> dict:
    """Every 5th object a crowd region (its polygons kept; the COCO-like case has RLE crowds)."""
    gt = copy.deepcopy(gt)
    for ann in gt["annotations"][::5]:
        ann["iscrowd"] = 1
    return gt


def _cases(shapes_gt: dict) -> dict[str, tuple[dict, list[dict]]]:
    """name -> (ground truth, results with bbox and segmentation)."""
    demo = synthetic_detections(shapes_gt, seed=1, masks=True, background_per_image=4)
    crowd_gt = _with_crowd(shapes_gt)
    coco_like = synthetic_ground_truth(40, num_classes=6, seed=3, crowd_fraction=0.05)
    for ann, area in zip(coco_like["annotations"][:4], (32 ** 2, 96 ** 2, 32 ** 2, 96 ** 2)):
        ann["area"] = float(area)  # on the small/medium and medium/large borders: in both ranges
    odd_ids = {image["id"] for image in shapes_gt["images"][::2]}
    return {
        "demo": (shapes_gt, demo),
        "other_seed": (shapes_gt, synthetic_detections(shapes_gt, seed=2, masks=True, background_per_image=8)),
        "tied_scores": (shapes_gt, synthetic_detections(shapes_gt, seed=3, masks=True, score_decimals=1)),
        "crowd": (crowd_gt, synthetic_detections(crowd_gt, seed=4, masks=True, background_per_image=4)),
        "images_and_a_class_without_detections": (
            shapes_gt, [d for d in demo if d["image_id"] in odd_ids and d["category_id"] != 2]),
        "no_detections": (shapes_gt, []),
        "coco_like_area_ranges": (coco_like, synthetic_detections(coco_like, seed=3, masks=True)),
    }


@pytest.fixture(scope="module")
def evaluations(shapes_gt) -> dict[tuple[str, str], tuple]:
    """(case, task) -> (pycocotools result, faster result, ground truth)."""
    out = {}
    for name, (gt, results) in _cases(shapes_gt).items():
        coco = _coco(gt)
        image_ids = [image["id"] for image in gt["images"]]
        for task in TASKS:
            out[name, task] = tuple(run_cocoeval(coco, _task(results, task), task, image_ids, backend)
                                    for backend in ("pycocotools", "faster")) + (gt,)
    return out


CASES = ["demo", "other_seed", "tied_scores", "crowd", "images_and_a_class_without_detections", "no_detections",
         "coco_like_area_ranges"]


@pytest.mark.numeric
@needs_faster
@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("case", CASES)
def test_the_12_coco_numbers_agree(evaluations, case, task):
    reference, faster, _ = evaluations[case, task]
    assert (reference.backend, faster.backend) == ("pycocotools", "faster")
    assert reference.stats.shape == faster.stats.shape == (12,)
    np.testing.assert_allclose(faster.stats, reference.stats, rtol=0, atol=1e-6)
    # Per class, IoU, recall point, area range and max detections too: the per-class APs and PR curves.
    np.testing.assert_allclose(faster.precision, reference.precision, rtol=0, atol=1e-6)
    np.testing.assert_allclose(faster.scores, reference.scores, rtol=0, atol=1e-6)


@needs_faster
def test_the_cases_test_what_they_say(evaluations):
    """Guards against a case that degenerates into a trivial one (all -1, all 0, or no crowd)."""
    for task in TASKS:
        demo = evaluations["demo", task][0].stats
        assert 30 < demo[0] * 100 < 95 and demo[1] > demo[0]
        assert evaluations["no_detections", task][0].stats[0] == 0
        partial = evaluations["images_and_a_class_without_detections", task][0]
        assert 0 < partial.stats[0] < demo[0]
        areas = evaluations["coco_like_area_ranges", task][0].stats
        assert (areas[3:6] > 0).all() and (areas[9:12] > 0).all()  # small, medium and large objects all scored
    assert sum(a["iscrowd"] for a in evaluations["crowd", "bbox"][2]["annotations"]) >= 10
    coco_like = evaluations["coco_like_area_ranges", "bbox"][2]["annotations"]
    assert any(a["iscrowd"] and isinstance(a["segmentation"]["counts"], list) for a in coco_like)  # uncompressed RLE


@pytest.mark.numeric
@needs_faster
def test_the_evaluator_gives_the_same_metrics_with_either_backend(shapes_gt):
    """Through COCOEvaluator, per-class AP included."""
    dataset = type("Dataset", (), {})()
    dataset.coco, dataset.name = _coco(shapes_gt), "shapes"
    dataset.class_names = [c["name"] for c in shapes_gt["categories"]]
    dataset.label_to_category_id = {i + 1: c["id"] for i, c in enumerate(shapes_gt["categories"])}
    detections = synthetic_detections(shapes_gt, seed=6)
    metrics = {}
    for backend in ("pycocotools", "faster"):
        evaluator = COCOEvaluator(dataset, backend=backend)
        for image in shapes_gt["images"]:
            dets = [d for d in detections if d["image_id"] == image["id"]]
            boxes = torch.tensor([d["bbox"] for d in dets], dtype=torch.float64).reshape(-1, 4)
            boxes[:, 2:] += boxes[:, :2]
            evaluator.process([{"image_id": image["id"]}], [{
                "boxes": boxes, "scores": torch.tensor([d["score"] for d in dets]),
                "labels": torch.tensor([d["category_id"] for d in dets], dtype=torch.int64)}])
        metrics[backend] = evaluator.evaluate()["bbox"]
    assert metrics["faster"].keys() == metrics["pycocotools"].keys()
    for key, value in metrics["pycocotools"].items():
        assert metrics["faster"][key] == pytest.approx(value, abs=1e-4, nan_ok=True), key


@needs_faster
def test_faster_leaves_the_datasets_ground_truth_as_it_was(shapes_gt):
    """faster-coco-eval adds fields to the annotations it evaluates: it must get copies."""
    coco = _coco(shapes_gt)
    before = copy.deepcopy(coco.dataset)
    results = _task(synthetic_detections(shapes_gt, seed=7, masks=True), "segm")
    run_cocoeval(coco, results, "segm", [image["id"] for image in shapes_gt["images"]], "faster")
    assert coco.dataset == before


def test_auto_picks_faster_when_installed_and_pycocotools_otherwise(monkeypatch):
    monkeypatch.setattr(backends_module, "faster_available", lambda: True)
    assert resolve_coco_library("auto") == "faster"
    assert resolve_coco_library("pycocotools") == "pycocotools"
    monkeypatch.setattr(backends_module, "faster_available", lambda: False)
    assert resolve_coco_library("auto") == "pycocotools"
    with pytest.raises(ConfigError, match="pip install faster-coco-eval"):
        resolve_coco_library("faster")
    with pytest.raises(ConfigError, match="TEST.COCO_BACKEND must be one of"):
        resolve_coco_library("fast")


@pytest.mark.parametrize("opts, message", [
    (["TEST.COCO_BACKEND", "fast"], "TEST.COCO_BACKEND must be auto, pycocotools or faster"),
    (["TEST.DIAGNOSTICS.IOU", "0"], "TEST.DIAGNOSTICS.IOU must be in"),
    (["TEST.DIAGNOSTICS.SCORE", "1.5"], "TEST.DIAGNOSTICS.SCORE must be in"),
])
def test_the_config_rejects_bad_values(opts, message):
    with pytest.raises(ConfigError, match=message):
        load_cfg(None, opts)


def test_the_config_asks_for_faster_coco_eval_before_training_when_it_is_missing(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "faster_coco_eval" else find_spec(name, *args))
    with pytest.raises(ConfigError, match="pip install faster-coco-eval"):
        load_cfg(None, ["TEST.COCO_BACKEND", "faster"])
    assert load_cfg(None, ["TEST.COCO_BACKEND", "auto"]).TEST.COCO_BACKEND == "auto"
