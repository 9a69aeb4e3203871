"""MODEL.LABEL_SPACE through data, evaluation and pictures: what label L means, and what is scored.

``contiguous`` (the default) numbers a dataset's categories 1..K; ``category_id`` keeps the category ids as
labels (torchvision's COCO layout, rows for ids the dataset lacks included). Loaders label samples in the
model's label space; evaluation scores the ground truth's categories only; names come from the label space.
"""
from __future__ import annotations

import json
import logging
import os
from unittest import mock

import pytest
import torch

from pet.config import load_cfg
from pet.data import LabelSpace, build_test_loader, build_train_loader, coco_categories, dataset_categories
from pet.engine.inference import evaluate_on_datasets
from pet.evaluation import VisualizationHook, evaluate_results_file
from pet.evaluation import visualizer as visualizer_module
from pet.utils.errors import ConfigError, DataError
from support.helpers import data_cfg, write_coco

# Two COCO categories, as in a user's subset of COCO: "stop sign" and COCO's last id.
STOP_SIGN, TOOTHBRUSH = 13, 90
SUBSET = [{"id": TOOTHBRUSH, "name": "toothbrush"}, {"id": STOP_SIGN, "name": "stop sign"}]


def _subset(tmp_path):
    """One 100x100 image with a toothbrush and a stop sign: ``(name, json file, image dir)``."""
    annotations = [{"id": 1, "image_id": 1, "category_id": TOOTHBRUSH, "bbox": [10, 10, 30, 20]},
                   {"id": 2, "image_id": 1, "category_id": STOP_SIGN, "bbox": [50, 40, 30, 30]}]
    return write_coco(tmp_path, images=[(1, 100, 100)], annotations=annotations, categories=SUBSET)


def test_category_id_layout_labels_samples_with_their_category_ids(tmp_path):
    name, *_ = _subset(tmp_path)
    cfg = data_cfg("TRAIN.DATASETS", (name,), "SOLVER.IMS_PER_BATCH", 1, "MODEL.LABEL_SPACE", "category_id",
                   num_classes=90)
    loader = build_train_loader(cfg)
    _, (target,) = next(iter(loader))
    assert sorted(target["labels"].tolist()) == [STOP_SIGN, TOOTHBRUSH]
    space = loader.dataset.label_space
    assert space.num_classes == 90 and space.category_id(TOOTHBRUSH) == TOOTHBRUSH
    # The unused rows are named as torchvision's COCO models name them (the dataset's categories are COCO's).
    assert (space.name(1), space.name(12), space.name(STOP_SIGN)) == ("person", "N/A", "stop sign")
    assert loader.dataset.class_names[TOOTHBRUSH - 1] == "toothbrush"
    assert loader.dataset.categories == {STOP_SIGN: "stop sign", TOOTHBRUSH: "toothbrush"}
    # The contiguous default on the same (cached) dataset: labels 1..2 by increasing id.
    contiguous = build_train_loader(data_cfg("TRAIN.DATASETS", (name,), "SOLVER.IMS_PER_BATCH", 1, num_classes=2))
    _, (target,) = next(iter(contiguous))
    assert sorted(target["labels"].tolist()) == [1, 2]
    assert contiguous.dataset.label_to_category_id == {1: STOP_SIGN, 2: TOOTHBRUSH}


def test_a_dataset_of_other_names_gets_no_coco_names_for_unused_rows():
    space = LabelSpace.build("category_id", {2: "cat", 4: "dog"}, 5)
    assert space.names == ("class_1", "cat", "class_3", "dog", "class_5")
    assert LabelSpace.from_list(space.to_list()) == space


def test_num_classes_follows_the_label_space(tmp_path):
    name, *_ = _subset(tmp_path)
    with pytest.raises(ConfigError, match=rf"Dataset '{name}': Category ids \[90\] do not fit MODEL.LABEL_SPACE "
                                          r"category_id with MODEL.NUM_CLASSES 80.*Raise MODEL.NUM_CLASSES to 90"):
        build_test_loader(data_cfg("MODEL.LABEL_SPACE", "category_id", num_classes=80), name)
    # The second trap: COCO-style ids with NUM_CLASSES 90 but the contiguous layout; the error says how out.
    with pytest.raises(ConfigError, match=rf"Dataset '{name}' has 2 categories but MODEL.NUM_CLASSES is 90; set "
                                          r"MODEL.NUM_CLASSES 2, or MODEL.LABEL_SPACE category_id"):
        build_test_loader(data_cfg(num_classes=90), name)
    with pytest.raises(ConfigError, match="MODEL.LABEL_SPACE must be contiguous or category_id, got 'by_id'"):
        load_cfg(None, ["MODEL.LABEL_SPACE", "by_id"])


class _FixedDetector(torch.nn.Module):
    """Per image: a perfect toothbrush, a stop sign 10 px off, and an airplane (id 5, not in the dataset)."""

    def __init__(self) -> None:
        super().__init__()
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, images, targets):
        return [{"boxes": torch.tensor([[10.0, 10.0, 40.0, 30.0], [60.0, 50.0, 90.0, 80.0], [0.0, 0.0, 50.0, 50.0]]),
                 "scores": torch.tensor([0.9, 0.8, 0.7]), "labels": torch.tensor([TOOTHBRUSH, STOP_SIGN, 5])}
                for _ in targets]


def test_evaluation_scores_the_datasets_categories_not_the_heads_rows(tmp_path, caplog):
    """A 90-row model on a 2-category subset of COCO: bbox.json holds the two categories' detections with their ids,
    the per-class AP and the diagnostics cover those two, and re-scoring bbox.json gives the same AP."""
    name, *_ = _subset(tmp_path)
    cfg = data_cfg("TEST.DATASETS", (name,), "MODEL.LABEL_SPACE", "category_id", "TEST.AMP.ENABLED", False,
                   num_classes=90)
    out = str(tmp_path / "test")
    with caplog.at_level(logging.INFO, logger="pet.evaluation.coco"):
        metrics = evaluate_on_datasets(cfg, _FixedDetector(), out)
    with open(os.path.join(out, "bbox.json")) as f:
        results = json.load(f)
    assert [d["category_id"] for d in results] == [TOOTHBRUSH, STOP_SIGN]
    assert [d["score"] for d in results] == pytest.approx([0.9, 0.8])
    assert "Left out 1 detections of category ids [5]" in caplog.text
    assert sorted(k for k in metrics if "/AP-" in k) == ["bbox/AP-stop sign", "bbox/AP-toothbrush"]
    assert metrics["bbox/AP-toothbrush"] == pytest.approx(100.0) and metrics["bbox/AP-stop sign"] == 0.0
    with open(os.path.join(out, "bbox_confusion_matrix.json")) as f:
        assert json.load(f)["labels"] == ["stop sign", "toothbrush", "background"]
    again = evaluate_results_file(name, os.path.join(out, "bbox.json"))["bbox"]
    assert again["AP"] == pytest.approx(metrics["bbox/AP"])


def test_detection_pictures_name_classes_through_the_label_space(tmp_path):
    name, *_ = _subset(tmp_path)
    cfg = data_cfg("MODEL.LABEL_SPACE", "category_id", num_classes=90)
    loader = build_test_loader(cfg, name)
    visualizer = VisualizationHook(str(tmp_path), num_images=1)
    visualizer.before_test(data_loader=loader)
    results = [{"image_id": 1, "category_id": c, "bbox": [10, 10, 30, 20], "score": 0.9} for c in (TOOTHBRUSH, 13)]
    with mock.patch.object(visualizer_module, "draw_detections", wraps=visualizer_module.draw_detections) as draw:
        visualizer.after_test(results=results)
    assert draw.call_args.args[2] == ["toothbrush", "stop sign"] and len(visualizer.written) == 1


def test_dataset_categories_without_images_or_annotations(tmp_path, monkeypatch):
    monkeypatch.setenv("PET_DATA_ROOT", str(tmp_path / "nothing_here"))  # no COCO files at all
    categories = dataset_categories("coco_2017_val")
    assert categories == coco_categories() and len(categories) == 80 and categories[TOOTHBRUSH] == "toothbrush"
    assert max(categories) == 90 and 12 not in categories
    assert dataset_categories("shapes_train") == {1: "circle", 2: "rectangle", 3: "triangle"}
    # A registered file: only its categories are read, so an annotation of a missing image does not matter.
    name, json_file, _ = write_coco(tmp_path, images=[(1, 20, 20)], categories=SUBSET, write_images=False,
                                    annotations=[{"id": 1, "image_id": 7, "category_id": 13, "bbox": [0, 0, 1, 1]}])
    assert dataset_categories(name) == {STOP_SIGN: "stop sign", TOOTHBRUSH: "toothbrush"}
    with pytest.raises(DataError, match="refers to image id 7"):
        build_test_loader(data_cfg(num_classes=2), name)
