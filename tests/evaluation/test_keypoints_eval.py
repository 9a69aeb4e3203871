"""COCO keypoint AP (OKS) through both backends, with the set's sigmas: a hand-worked OKS, the two backends
equal on a generated keypoint set, and the evaluator's keypoints.json, metrics and PR curves.

cocoapi's own keypoint example files (person_keypoints_val2014 and its fake results) are not in the installed
pycocotools wheel (it ships the Python sources alone), so the backends are checked against each other and
against a value worked out by hand instead of against cocoapi's published numbers."""
from __future__ import annotations

import json
import math
import os

import cv2
import numpy as np
import pytest
import torch

from pet.config import load_cfg
from pet.data import get_dataset
from pet.data.shapes_keypoints import generate_shapes_keypoints
from pet.engine.inference import evaluate_on_datasets
from pet.engine.trainer import Trainer
from pet.evaluation import COCOEvaluator, VisualizationHook, evaluate_results_file
from pet.evaluation.backends import KeypointTask, run_cocoeval
from pet.evaluation.coco import masks_to_rle
from support.helpers import ROOT, write_coco

CORNERS = ["top_left", "top_right", "bottom_right", "bottom_left"]
pytest.importorskip("faster_coco_eval")


def _corner_set(tmp_path, num_images=12, seed=0):
    """Images of 80x60 with 1-3 'box' objects (corners as keypoints, some hidden or unlabelled) and a 'blob'
    class without keypoints."""
    rng = np.random.default_rng(seed)
    annotations = []
    for image_id in range(1, num_images + 1):
        for _ in range(int(rng.integers(1, 4))):
            x, y = rng.uniform(0, 40), rng.uniform(0, 30)
            w, h = rng.uniform(8, 38), rng.uniform(8, 28)
            points = np.array([[x, y], [x + w, y], [x + w, y + h], [x, y + h]])
            visibility = rng.choice([0, 1, 2, 2, 2, 2], size=4)
            flat = np.concatenate([points, visibility[:, None]], axis=1)
            flat[visibility == 0, :2] = 0
            annotations.append({"id": len(annotations) + 1, "image_id": image_id, "category_id": 1,
                                "bbox": [x, y, w, h], "area": w * h, "keypoints": flat.reshape(-1).tolist(),
                                "num_keypoints": int((visibility > 0).sum())})
        annotations.append({"id": len(annotations) + 1, "image_id": image_id, "category_id": 2,
                            "bbox": [1, 1, 5, 5], "area": 25.0})
    categories = [{"id": 1, "name": "box", "keypoints": CORNERS, "skeleton": [[1, 2], [2, 3], [3, 4], [4, 1]]},
                  {"id": 2, "name": "blob"}]
    images = [(i, 80, 60) for i in range(1, num_images + 1)]
    name, _, _ = write_coco(tmp_path, images=images, annotations=annotations, categories=categories)
    return get_dataset(name)


def _detections(dataset, seed=1, noise=1.5):
    """Perturbed copies of the ground truth (some dropped, some false), plus blob boxes without keypoints."""
    rng = np.random.default_rng(seed)
    results = []
    for ann in dataset.coco.dataset["annotations"]:
        if ann["category_id"] != 1 or rng.random() < 0.15:
            continue
        points = np.array(ann["keypoints"], dtype=np.float64).reshape(-1, 3)
        points[:, :2] += rng.normal(0, noise, size=(4, 2))
        points[:, 2] = rng.uniform(0, 5, size=4)
        results.append({"image_id": ann["image_id"], "category_id": 1, "bbox": ann["bbox"],
                        "score": float(rng.uniform(0.2, 1.0)), "keypoints": points.reshape(-1).tolist()})
    for image_id in range(1, 6):  # false positives
        results.append({"image_id": image_id, "category_id": 1, "bbox": [50, 40, 20, 15], "score": 0.3,
                        "keypoints": [50, 40, 1, 70, 40, 1, 70, 55, 1, 50, 55, 1]})
    return results


@pytest.mark.numeric
def test_both_backends_give_the_same_keypoint_ap(tmp_path):
    dataset = _corner_set(tmp_path)
    results = _detections(dataset)
    task = KeypointTask((0.05, 0.05, 0.08, 0.08), (1,))
    image_ids = dataset.coco.getImgIds()
    ref = run_cocoeval(dataset.coco, results, "keypoints", image_ids, "pycocotools", task)
    fast = run_cocoeval(dataset.coco, results, "keypoints", image_ids, "faster", task)
    assert len(ref.stats) == 10 and ref.category_ids == [1] and ref.area_ranges == ["all", "medium", "large"]
    assert 0.2 < ref.stats[0] < 0.95  # neither trivial nor empty
    np.testing.assert_allclose(fast.stats, ref.stats, rtol=0, atol=1e-12)
    np.testing.assert_allclose(fast.precision, ref.precision, rtol=0, atol=1e-12)
    other = run_cocoeval(dataset.coco, results, "keypoints", image_ids, "pycocotools",
                         KeypointTask((0.1,) * 4, (1,)))
    assert other.stats[0] > ref.stats[0]  # looser sigmas, higher AP: the sigmas reach COCOeval


@pytest.mark.parametrize("backend", ["pycocotools", "faster"])
def test_the_oks_of_one_detection_is_cocos_formula(tmp_path, backend):
    """One object of area 400, every point off by d: OKS = exp(-d^2 / (2 * area * (2 sigma)^2)). With d chosen
    for OKS 0.72 the detection is right at OKS 0.50..0.70 and wrong above: AP = 5/10 exactly."""
    sigma, area = 0.05, 400.0
    d = math.sqrt(-math.log(0.72) * 2 * area * (2 * sigma) ** 2)
    points = [10, 10, 2, 30, 10, 2, 30, 30, 2, 10, 30, 2]
    annotations = [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [10, 10, 20, 20], "area": area,
                    "keypoints": points, "num_keypoints": 4}]
    name, _, _ = write_coco(tmp_path, images=((1, 80, 60),), annotations=annotations,
                            categories=[{"id": 1, "name": "box", "keypoints": CORNERS}])
    dataset = get_dataset(name)
    moved = [v + d if i % 3 == 0 else v for i, v in enumerate(points)]
    results = [{"image_id": 1, "category_id": 1, "bbox": [10, 10, 20, 20], "score": 0.9, "keypoints": moved}]
    result = run_cocoeval(dataset.coco, results, "keypoints", [1], backend, KeypointTask((sigma,) * 4, (1,)))
    assert result.stats[0] == pytest.approx(0.5, abs=1e-12)
    assert result.stats[1] == pytest.approx(1.0) and result.stats[2] == pytest.approx(0.0)


def test_the_evaluator_scores_keypoints_and_writes_them_flat_with_scores(tmp_path):
    dataset = _corner_set(tmp_path)
    evaluator = COCOEvaluator(dataset, str(tmp_path / "out"), backend="pycocotools")
    gts = {}
    for ann in dataset.coco.dataset["annotations"]:
        gts.setdefault(ann["image_id"], []).append(ann)
    for image_id, anns in gts.items():
        boxes = torch.tensor([[a["bbox"][0], a["bbox"][1], a["bbox"][0] + a["bbox"][2], a["bbox"][1] + a["bbox"][3]]
                              for a in anns])
        labels = torch.tensor([a["category_id"] for a in anns])
        points = torch.tensor([a["keypoints"] if "keypoints" in a and a["category_id"] == 1 else [0.0] * 12
                               for a in anns], dtype=torch.float32).reshape(-1, 4, 3)
        points[..., 2] = 1  # torchvision's third column
        output = {"boxes": boxes, "scores": torch.full((len(anns),), 0.9), "labels": labels, "keypoints": points,
                  "keypoints_scores": torch.full((len(anns), 4), 7.5)}
        evaluator.process([{"image_id": image_id}], [output])
    metrics = evaluator.evaluate()
    assert set(metrics) == {"bbox", "keypoints"}
    assert metrics["keypoints"]["AP"] == pytest.approx(100.0)
    assert set(metrics["keypoints"]) == {"AP", "AP50", "AP75", "APm", "APl", "AP-box"}  # blob has no points
    written = json.loads((tmp_path / "out" / "keypoints.json").read_text())
    assert {d["category_id"] for d in written} == {1} and all(len(d["keypoints"]) == 12 for d in written)
    assert {d["keypoints"][2] for d in written} == {7.5}  # the point's score, as detectron2 writes it
    assert "keypoints" not in json.loads((tmp_path / "out" / "bbox.json").read_text())[0]
    assert (tmp_path / "out" / "keypoints_pr_curves.png").is_file()
    rescored = evaluate_results_file(dataset, str(tmp_path / "out" / "keypoints.json"), backend="faster")
    assert rescored["keypoints"]["AP"] == pytest.approx(100.0)


@pytest.mark.slow
def test_a_keypoint_rcnn_trains_on_the_shapes_corners_and_is_scored_on_them(tiny_set, tmp_path):
    """Two training steps of the shipped shapes keypoint config on the tiny set's corners, then its test: the
    targets carry the corners, and evaluation reports keypoint AP beside box AP and writes keypoints.json."""
    kp_root = generate_shapes_keypoints(str(tmp_path / "kp"), tiny_set)
    custom = [{"name": "kp_tiny_train", "path": f"{kp_root}/annotations/train.json", "images": f"{tiny_set}/train"},
              {"name": "kp_tiny_val", "path": f"{kp_root}/annotations/val.json", "images": f"{tiny_set}/val"}]
    cfg = load_cfg(os.path.join(ROOT, "cfgs", "shapes", "keypoint_rcnn_R-10-FPN.yaml"), [
        "CKPT", str(tmp_path / "run"), "DATA.CUSTOM", str(custom), "TRAIN.DATASETS", "('kp_tiny_train',)",
        "TEST.DATASETS", "('kp_tiny_val',)", "SOLVER.MAX_ITER", "2", "SOLVER.IMS_PER_BATCH", "2",
        "DATA.NUM_WORKERS", "0", "HOOKS.EVAL.PERIOD", "0", "SOLVER.AMP.ENABLED", "False", "DEVICE", "cpu",
        "MODEL.ROI_KEYPOINT_HEAD.CONV_DIMS", "[32]", "TEST.DIAGNOSTICS.ENABLED", "False",
        "MODEL.FLOPS_INPUT_SIZE", "()", "TRAIN.AUTO_RESUME", "False"])
    trainer = Trainer(cfg)
    _, targets = next(iter(trainer.data_loader))
    assert all(t["keypoints"].shape == (len(t["boxes"]), 7, 3) for t in targets)
    trainer.train()
    metrics = evaluate_on_datasets(cfg, trainer.model, str(tmp_path / "test"))
    assert {"bbox/AP", "keypoints/AP", "keypoints/AP-rectangle", "keypoints/AP-triangle"} <= set(metrics)
    assert "keypoints/AP-circle" not in metrics  # circles have no points to score
    written = json.loads((tmp_path / "test" / "keypoints.json").read_text())
    assert all(len(d["keypoints"]) == 21 and d["category_id"] in (2, 3) for d in written)



def _drawn(tmp_path, dataset, results):
    """The hook's picture of image 1 (grey 128 where nothing is drawn), BGR."""
    hook = VisualizationHook(str(tmp_path / "out"), num_images=1)
    hook.before_test(data_loader=type("Loader", (), {"dataset": dataset})())
    hook.after_test(results=results)
    return cv2.imread(hook.written[0])


def test_the_visualization_hook_draws_keypoints_joined_by_the_sets_skeleton(tmp_path):
    """test_net's pictures show what was scored: a detection's points as dots joined by the set's skeleton (the
    corner set's four edges); a blob without points is drawn as a box."""
    corners = [[25, 15, 2.0], [55, 15, 1.0], [55, 45, 3.0], [25, 45, 0.5]]  # 5 px inside the box
    drawn = _drawn(tmp_path, _corner_set(tmp_path, num_images=1), [
        {"image_id": 1, "category_id": 1, "bbox": [20, 10, 40, 40], "score": 0.9,
         "keypoints": [v for point in corners for v in point]},
        {"image_id": 1, "category_id": 2, "bbox": [64, 39, 15, 17], "score": 0.8}])
    assert all((drawn[y, x] != 128).any() for x, y, _ in corners)
    assert (drawn[30, 25] != 128).any() and (drawn[45, 40] != 128).any()  # the left and bottom edges
    assert (drawn[30, 40] == 128).all()  # inside the box, off the skeleton: nothing
    assert (drawn[47, 64] != 128).any()  # the blob's box


def test_the_visualization_hook_blends_in_each_detections_mask(tmp_path):
    """A mask model's results: each detection's RLE mask (as the evaluator saves it) is blended into the picture;
    the rest of its box is not."""
    masks = np.zeros((2, 60, 80), np.uint8)
    masks[0, 25:45, 30:55] = 1
    masks[1, 40:55, 65:78] = 1
    drawn = _drawn(tmp_path, _corner_set(tmp_path, num_images=1), [
        {"image_id": 1, "category_id": c, "bbox": box, "score": 0.9, "segmentation": rle}
        for c, box, rle in zip((1, 2), ([20, 10, 40, 40], [64, 39, 15, 17]), masks_to_rle(masks))])
    assert (drawn[35, 40] != 128).any() and (drawn[47, 70] != 128).any()
    assert (drawn[18, 25] == 128).all()  # in the first box, outside its mask
