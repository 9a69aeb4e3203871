"""COCO evaluation: perfect and empty predictions, bbox.json, re-evaluation and the distributed gather."""
from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from pet.config import load_cfg
from pet.data import build_test_loader
from pet.evaluation import BOX_METRICS, COCOEvaluator, evaluate_results_file
from pet.utils import comm
from pet.utils.errors import DataError
from support.helpers import register_split


@pytest.fixture(scope="module")
def val_loader(shapes_set):
    name = register_split(shapes_set(num_train=2, num_val=6, seed=2), "val")
    cfg = load_cfg(None, ["DEVICE", "cpu", "MODEL.NUM_CLASSES", "3", "DATA.NUM_WORKERS", "0", "TEST.IMS_PER_BATCH",
                          "2", "INPUT.MIN_SIZE_TEST", "300", "INPUT.MAX_SIZE_TEST", "500"])
    return build_test_loader(cfg, name)


def _perfect_outputs(targets):
    """Ground truth as detections: boxes mapped back from resized to original pixels, score 1."""
    outputs = []
    for t in targets:
        scale = torch.tensor([t["orig_size"][1] / t["image_size"][1], t["orig_size"][0] / t["image_size"][0]] * 2)
        outputs.append({"boxes": t["boxes"] * scale, "scores": torch.ones(len(t["boxes"])), "labels": t["labels"]})
    return outputs


def _run(evaluator, loader, make_outputs=_perfect_outputs):
    evaluator.reset()
    for batch in loader:
        evaluator.process(batch, make_outputs(batch[1]))
    return evaluator.evaluate()


def test_perfect_predictions_give_ap_100_and_a_readable_bbox_json(val_loader, tmp_path):
    evaluator = COCOEvaluator(val_loader.dataset, output_dir=str(tmp_path))
    metrics = _run(evaluator, val_loader)["bbox"]
    for name in ("AP", "AP50", "AP75"):
        assert metrics[name] == pytest.approx(100.0), name
    assert set(BOX_METRICS) <= metrics.keys()
    assert {"AP-circle", "AP-rectangle", "AP-triangle"} <= metrics.keys()

    results_file = tmp_path / "bbox.json"
    results = json.loads(results_file.read_text())
    assert results and set(results[0]) == {"image_id", "category_id", "bbox", "score"}
    coco_dt = val_loader.dataset.coco.loadRes(str(results_file))
    assert len(coco_dt.getAnnIds()) == len(val_loader.dataset.coco.getAnnIds())

    again = evaluate_results_file(val_loader.dataset, str(results_file))["bbox"]
    for name in BOX_METRICS:
        assert again[name] == pytest.approx(metrics[name], nan_ok=True), name


def test_imperfect_predictions_score_lower(val_loader):
    def shifted(targets):
        outputs = _perfect_outputs(targets)
        for out in outputs:
            out["boxes"] = out["boxes"] + 4.0  # every box 4 px off: fails the strict IoU thresholds
        return outputs

    metrics = _run(COCOEvaluator(val_loader.dataset), val_loader, shifted)["bbox"]
    assert metrics["AP"] < 90 and metrics["AP75"] < metrics["AP50"]


def test_detections_use_the_dataset_category_ids_and_xywh(val_loader):
    evaluator = COCOEvaluator(val_loader.dataset)
    target = {"image_id": 1}
    evaluator.process([target], [{"boxes": torch.tensor([[10.0, 20.0, 40.0, 60.0]]), "scores": torch.tensor([0.5]),
                                  "labels": torch.tensor([2])}])
    (det,) = evaluator.predictions
    assert det["category_id"] == val_loader.dataset.label_to_category_id[2]
    assert det["bbox"] == [10.0, 20.0, 30.0, 40.0] and det["image_id"] == 1


def test_no_detections_is_ap_zero_with_a_warning(val_loader, tmp_path, caplog):
    evaluator = COCOEvaluator(val_loader.dataset, output_dir=str(tmp_path))

    def nothing(targets):
        return [{"boxes": torch.zeros(0, 4), "scores": torch.zeros(0), "labels": torch.zeros(0, dtype=torch.int64)}
                for _ in targets]

    with caplog.at_level(logging.WARNING, logger="pet.evaluation.coco"):
        metrics = _run(evaluator, val_loader, nothing)["bbox"]
    assert metrics["AP"] == 0.0 and metrics["AP-circle"] == 0.0
    assert any("No detections" in r.getMessage() for r in caplog.records)
    assert json.loads((tmp_path / "bbox.json").read_text()) == []


def test_only_processed_images_are_scored_and_duplicates_count_once(val_loader):
    evaluator = COCOEvaluator(val_loader.dataset)
    _, first_targets = next(iter(val_loader))
    for _ in range(2):  # the same images twice (e.g. a bad image replaced by another) count once
        evaluator.process(first_targets, _perfect_outputs(first_targets))
    metrics = evaluator.evaluate()["bbox"]
    assert metrics["AP"] == pytest.approx(100.0)
    assert len(evaluator.predictions) == sum(len(t["boxes"]) for t in first_targets)


def test_distributed_evaluate_gathers_to_rank_zero(val_loader, monkeypatch):
    batches = list(val_loader)
    shards = [COCOEvaluator(val_loader.dataset) for _ in range(2)]
    for i, (_, targets) in enumerate(batches):
        shards[i % 2].process(targets, _perfect_outputs(targets))
    # rank 1 also saw rank 0's first batch: duplicates across ranks are merged
    shards[1].process(batches[0][1], _perfect_outputs(batches[0][1]))
    monkeypatch.setattr(comm, "get_world_size", lambda: 2)
    monkeypatch.setattr(comm, "all_gather_object", lambda obj: [s._predictions for s in shards])
    monkeypatch.setattr(comm, "is_main_process", lambda: False)
    assert shards[1].evaluate() == {}
    monkeypatch.setattr(comm, "is_main_process", lambda: True)
    assert shards[0].evaluate()["bbox"]["AP"] == pytest.approx(100.0)


def test_evaluate_results_file_rejects_bad_files(val_loader, tmp_path):
    with pytest.raises(DataError, match="Results file not found"):
        evaluate_results_file(val_loader.dataset, str(tmp_path / "missing.json"))
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps([{"image_id": 999, "category_id": 1, "bbox": [0, 0, 1, 1], "score": 1.0}]))
    with pytest.raises(DataError, match="image id 999 .* Was the file made on another dataset"):
        evaluate_results_file(val_loader.dataset, str(wrong))


def test_missing_size_ranges_are_nan_not_minus_one(val_loader):
    metrics = _run(COCOEvaluator(val_loader.dataset), val_loader)["bbox"]
    coco = val_loader.dataset.coco
    has_large = any(a["area"] > 96**2 for a in coco.loadAnns(coco.getAnnIds()))
    assert has_large or math.isnan(metrics["APl"])
    assert all(math.isnan(v) or 0 <= v <= 100 for v in metrics.values())
