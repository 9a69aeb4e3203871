"""Keypoints through the data layer: COCO person files and YOLO pose sets read with their points, flip map,
skeleton and OKS sigmas; transforms that move and renumber points; the one-line errors of bad keypoint data."""
from __future__ import annotations

import json
import os
import re
import uuid

import cv2
import numpy as np
import pytest

from pet.config import load_cfg
from pet.data import build_train_loader, get_dataset
from pet.data.catalog import register_custom_datasets, register_dataset
from pet.data.dataset import check_same_categories
from pet.data.formats import read_yolo
from pet.data.keypoints import COCO_OKS_SIGMAS, COCO_PERSON_KEYPOINTS, COCO_PERSON_SKELETON, DEFAULT_OKS_SIGMA
from pet.data.shapes import SHAPE_CLASSES
from pet.data.shapes_keypoints import SHAPE_KEYPOINTS, generate_shapes_keypoints
from pet.data.synthetic import synthetic_batch
from pet.data.transforms import CropTransform, HFlipTransform, ResizeTransform, TransformList
from pet.modeling import build_model
from pet.utils.errors import ConfigError, DataError
from support.helpers import ROOT, data_cfg, write_coco

# torchvision's references/detection/transforms.py hard-codes this flip for COCO's person; Pet derives it from
# the names.
TORCHVISION_COCO_FLIP = [0, 2, 1, 4, 3, 6, 5, 8, 7, 10, 9, 12, 11, 14, 13, 16, 15]
CORNERS = ["top_left", "top_right", "bottom_right", "bottom_left"]


def _person_points(x0: float, y0: float) -> list[float]:
    """17 distinct labelled points (v alternating 2 and 1) near (x0, y0)."""
    return [v for i in range(17) for v in (x0 + i, y0 + (i % 5), 2 if i % 2 == 0 else 1)]


def _person_set(tmp_path, annotations=None, **kwargs):
    person = {"id": 1, "name": "person", "keypoints": list(COCO_PERSON_KEYPOINTS),
              "skeleton": [list(p) for p in COCO_PERSON_SKELETON]}
    if annotations is None:
        annotations = [
            {"id": 1, "image_id": 1, "category_id": 1, "bbox": [2, 3, 30, 20], "keypoints": _person_points(3, 4),
             "num_keypoints": 17},
            {"id": 2, "image_id": 1, "category_id": 1, "bbox": [5, 5, 10, 10]},  # a person without keypoints
        ]
    return write_coco(tmp_path, images=((1, 60, 40),), annotations=annotations, categories=[person], **kwargs)


def test_a_coco_person_file_gives_points_flip_map_skeleton_and_cocos_sigmas(tmp_path):
    name, _, _ = _person_set(tmp_path)
    dataset = get_dataset(name)
    meta = dataset.keypoint_meta
    assert meta.names == COCO_PERSON_KEYPOINTS
    assert list(meta.flip_map) == TORCHVISION_COCO_FLIP
    assert meta.skeleton == COCO_PERSON_SKELETON and meta.oks_sigmas == COCO_OKS_SIGMAS
    points = dataset.records[0]["keypoints"]
    assert points.dtype == np.float32 and points.shape == (2, 17, 3)
    np.testing.assert_array_equal(points[0].reshape(-1), _person_points(3, 4))
    np.testing.assert_array_equal(points[1], 0)  # no keypoints: unlabelled rows
    # COCOeval's keypoint task reads both fields of every ground-truth annotation
    gt = dataset.coco.anns[2]
    assert gt["num_keypoints"] == 0 and gt["keypoints"] == [0] * 51


def test_a_set_without_keypoint_names_has_no_keypoints(tmp_path):
    name, _, _ = write_coco(tmp_path)
    dataset = get_dataset(name)
    assert dataset.keypoint_meta is None and "keypoints" not in dataset.records[0]


@pytest.mark.parametrize("points, message", [
    ([1, 2, 2] * 16, r"has 48 keypoint values; this set has 17 keypoints, so 'keypoints' must hold 51 numbers"),
    ([1, 2, 2] * 16 + [1, 2, 3], r": keypoint 17 has visibility 3; COCO's values are 0 \(not labelled\), 1"),
    ([1, 2, 2] * 16 + [70, 2, 2], r": keypoint 17 is visible \(v=2\) at \(70, 2\), outside the 60x40 image"),
    ([1, 2, 2] * 16 + [1, "a", 2], r"has keypoints that are not all finite numbers"),
])
def test_bad_coco_keypoints_are_one_error_naming_the_file_and_annotation(tmp_path, points, message):
    annotations = [{"id": 7, "image_id": 1, "category_id": 1, "bbox": [2, 3, 30, 20], "keypoints": points}]
    name, json_file, _ = _person_set(tmp_path, annotations)
    with pytest.raises(DataError, match=rf"^Annotation 7 in {re.escape(json_file)} \(dataset '{name}'\) "
                                        rf"\(image id 1\).*{message}"):
        get_dataset(name)


def test_a_hidden_point_outside_the_image_is_accepted(tmp_path):
    """Only a point marked visible must lie in the image: v=1 (labelled, hidden) may be guessed outside it."""
    name, _, _ = _person_set(tmp_path, [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [2, 3, 30, 20],
                                         "keypoints": [1, 2, 2] * 16 + [70, 2, 1]}])
    assert get_dataset(name).records[0]["keypoints"][0, 16].tolist() == [70, 2, 1]


def test_categories_naming_different_points_are_an_error(tmp_path):
    categories = [{"id": 1, "name": "a", "keypoints": ["p", "q"]}, {"id": 2, "name": "b", "keypoints": ["p"]}]
    name, _, _ = write_coco(tmp_path, categories=categories)
    with pytest.raises(DataError, match="Categories 'a' and 'b' in .* name different keypoints"):
        get_dataset(name)


# --------------------------------------------------------------------------- DATA.CUSTOM oks_sigmas


def _corner_set(tmp_path):
    category = {"id": 1, "name": "box", "keypoints": CORNERS}
    annotations = [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [10, 5, 20, 10],
                    "keypoints": [10, 5, 2, 30, 5, 2, 30, 15, 2, 10, 15, 1]}]
    return write_coco(tmp_path, images=((1, 60, 40),), annotations=annotations, categories=[category])


def test_a_custom_set_gets_the_default_sigma_or_its_own(tmp_path):
    _, json_file, image_dir = _corner_set(tmp_path)
    meta = get_dataset(_register_custom(json_file, image_dir)).keypoint_meta
    assert meta.oks_sigmas == (DEFAULT_OKS_SIGMA,) * 4
    assert list(meta.flip_map) == [1, 0, 3, 2]  # left <-> right in the names
    mine = get_dataset(_register_custom(json_file, image_dir, oks_sigmas=[0.05, 0.05, 0.1, 0.1])).keypoint_meta
    assert mine.oks_sigmas == (0.05, 0.05, 0.1, 0.1)


@pytest.mark.parametrize("sigmas, error, message", [
    ([0.05] * 3, DataError, r"3 OKS sigmas for 4 keypoints"),
    ([0.05, 0.05, 0.05, 0.2], DataError, r"OKS sigmas \[.*\] must lie in \(0, 0.107\]"),
    ("0.05", ConfigError, r"`oks_sigmas` must be a list of numbers"),
])
def test_bad_oks_sigmas_are_refused(tmp_path, sigmas, error, message):
    _, json_file, image_dir = _corner_set(tmp_path)
    with pytest.raises(error, match=message):
        get_dataset(_register_custom(json_file, image_dir, oks_sigmas=sigmas))


def test_oks_sigmas_for_a_set_without_keypoints_are_refused(tmp_path):
    _, json_file, image_dir = write_coco(tmp_path)
    with pytest.raises(DataError, match="has no keypoints .* so its `oks_sigmas` mean nothing"):
        get_dataset(_register_custom(json_file, image_dir, oks_sigmas=[0.05]))


_COUNTER = iter(range(10**6))


def _register_custom(json_file, image_dir, **extra) -> str:
    name = f"kp_custom_{next(_COUNTER)}_{id(extra)}"
    register_custom_datasets(data_cfg(custom=[{"name": name, "path": json_file, "images": image_dir, **extra}]))
    return name


# --------------------------------------------------------------------------- YOLO pose


def _yolo_pose(tmp_path, lines: str, yaml_extra: str = "kpt_shape: [3, 3]\nflip_idx: [1, 0, 2]\n") -> str:
    (tmp_path / "images").mkdir(exist_ok=True)
    (tmp_path / "labels").mkdir(exist_ok=True)
    cv2.imwrite(str(tmp_path / "images" / "a.jpg"), np.zeros((50, 100, 3), np.uint8))
    (tmp_path / "labels" / "a.txt").write_text(lines)
    (tmp_path / "data.yaml").write_text(f"train: images\nnames: [thing]\n{yaml_extra}")
    return str(tmp_path / "data.yaml")


def test_a_yolo_pose_set_reads_its_keypoints_in_pixels_with_its_flip_idx(tmp_path):
    data_yaml = _yolo_pose(tmp_path, "0 0.5 0.5 0.4 0.4 0.3 0.4 2 0.7 0.4 1 0 0 0\n0 0.2 0.2 0.1 0.1\n")
    read = read_yolo(data_yaml, "train")
    assert read.coco["annotations"][0]["keypoints"] == [30.0, 20.0, 2.0, 70.0, 20.0, 1.0, 0.0, 0.0, 0.0]
    assert read.coco["annotations"][1]["keypoints"] == [0.0] * 9  # a box alone: no point labelled
    assert read.keypoint_meta.flip_map == (1, 0, 2) and read.keypoint_meta.names == ("kp_0", "kp_1", "kp_2")
    name = f"pose_{id(read)}"
    register_dataset(name, data_yaml, format="yolo", split="train")
    dataset = get_dataset(name)
    assert dataset.records[0]["keypoints"].shape == (2, 3, 3) and dataset.keypoint_meta.flip_map == (1, 0, 2)


def test_yolo_keypoints_of_two_values_are_visible_but_for_a_missing_zero_point(tmp_path):
    data_yaml = _yolo_pose(tmp_path, "0 0.5 0.5 0.4 0.4 0.3 0.4 0 0\n", "kpt_shape: [2, 2]\nkpt_names: [a, b]\n")
    read = read_yolo(data_yaml, "train")
    assert read.coco["annotations"][0]["keypoints"] == [30.0, 20.0, 2.0, 0.0, 0.0, 0.0]
    assert read.keypoint_meta.names == ("a", "b") and read.keypoint_meta.flip_map == (0, 1)


@pytest.mark.parametrize("line, message", [
    ("0 0.5 0.5 0.4 0.4 0.3 0.4 2 0.7 0.4 5 0 0 0", r"a.txt:1: keypoint 2 has visibility 5"),
    ("0 0.5 0.5 0.4 0.4 0.3 0.4 2 1.7 0.4 2 0 0 0", r"a.txt:1: keypoint 2 is visible \(v=2\) at \(170, 20\), "
                                                    r"outside the 100x50 image"),
    ("0 0.5 0.5 0.4 0.4 0.3 0.4 2 0.7 0.4 2", r"a.txt:1: 11 values; with kpt_shape \[3, 3\]"),
])
def test_bad_yolo_keypoints_name_the_label_file_and_line(tmp_path, line, message):
    data_yaml = _yolo_pose(tmp_path, line + "\n")
    name = f"pose_bad_{abs(hash((str(tmp_path), line)))}"
    register_dataset(name, data_yaml, format="yolo", split="train")
    with pytest.raises(DataError, match=message):
        get_dataset(name)


@pytest.mark.parametrize("yaml_extra, message", [
    ("kpt_shape: [3, 3]\nflip_idx: [1, 1, 2]\n", r"flip map \[1, 1, 2\] is not a permutation"),
    ("kpt_shape: [3, 3]\nflip_idx: [1, 0]\n", r"flip_idx \[1, 0\] must list 3 point indices"),
    ("kpt_shape: [3, 4]\n", r"kpt_shape \[3, 4\] must be \[K, 2\] or \[K, 3\]"),
])
def test_a_bad_pose_yaml_is_one_error_naming_it(tmp_path, yaml_extra, message):
    data_yaml = _yolo_pose(tmp_path, "0 0.5 0.5 0.4 0.4\n", yaml_extra)
    with pytest.raises(DataError, match=rf"^{re.escape(data_yaml)}: .*{message}"):
        read_yolo(data_yaml, "train")


# --------------------------------------------------------------------------- transforms and the mapper


def test_a_flip_mirrors_x_and_swaps_left_and_right_points():
    points = np.array([[[10, 5, 2], [30, 6, 1], [20, 9, 0]]], np.float32)
    flipped = HFlipTransform(100).apply_keypoints(points, [1, 0, 2])
    np.testing.assert_array_equal(flipped, [[[70, 6, 1], [90, 5, 2], [80, 9, 0]]])
    twice = TransformList([HFlipTransform(100), HFlipTransform(100)]).apply_keypoints(points, [1, 0, 2])
    np.testing.assert_array_equal(twice, points)
    with pytest.raises(ValueError, match="needs the set's flip map"):
        HFlipTransform(100).apply_keypoints(points)


def test_resize_and_crop_move_points_and_keep_visibility():
    points = np.array([[[10, 5, 2], [30, 6, 1]]], np.float32)
    resized = ResizeTransform(50, 100, 100, 300).apply_keypoints(points)
    np.testing.assert_allclose(resized, [[[30, 10, 2], [90, 12, 1]]])
    cropped = CropTransform(8, 2, 20, 20).apply_keypoints(points)
    np.testing.assert_allclose(cropped, [[[2, 3, 2], [22, 4, 1]]])


def test_the_training_loader_flips_points_by_the_sets_map_and_unlabels_points_a_crop_cuts(tmp_path):
    name, _, _ = _corner_set(tmp_path)
    cfg = data_cfg("TRAIN.DATASETS", (name,), "INPUT.FLIP_PROB", 1.0, "INPUT.MIN_SIZE_TRAIN", (40,),
                   "INPUT.MAX_SIZE_TRAIN", 1000, "SOLVER.IMS_PER_BATCH", 1, num_classes=1)
    _, targets = next(iter(build_train_loader(cfg)))
    points = targets[0]["keypoints"]
    assert points.dtype.is_floating_point and tuple(points.shape) == (1, 4, 3)
    # the 60 px wide image, mirrored: x -> 60 - x, and top_left <-> top_right, bottom_right <-> bottom_left
    np.testing.assert_array_equal(points[0].numpy(), [[30, 5, 2], [50, 5, 2], [50, 15, 1], [30, 15, 2]])
    cfg = data_cfg("TRAIN.DATASETS", (name,), "INPUT.FLIP_PROB", 0.0, "INPUT.MIN_SIZE_TRAIN", (0,),
                   "INPUT.CROP.ENABLED", True, "INPUT.CROP.SIZE", (40, 25), "SOLVER.IMS_PER_BATCH", 1,
                   num_classes=1)
    cut = 0
    for _, (_, targets) in zip(range(8), build_train_loader(cfg)):  # wherever the crop falls
        if not len(targets[0]["keypoints"]):
            continue  # the crop missed the box: it goes, with its points
        points = targets[0]["keypoints"].numpy()[0]
        inside = (points[:, 0] >= 0) & (points[:, 0] <= 25) & (points[:, 1] >= 0) & (points[:, 1] <= 40)
        assert (points[~inside, 2] == 0).all() and (points[inside, 2] > 0).all()
        cut += int((~inside).any())
    assert cut  # some crop cut some point off


# --------------------------------------------------------------------------- the shapes keypoint set


def test_the_shapes_keypoint_set_labels_the_corners_of_the_demo_sets_own_objects(shapes_root, tmp_path):
    """Same images and boxes as the demo set; a rectangle's 4 corners and a triangle's 3 vertices, on the box
    edges where nothing hides them; circles have none; the names give the left <-> right flip map."""
    root = generate_shapes_keypoints(str(tmp_path / "shapes_kp"), shapes_root)
    with open(os.path.join(shapes_root, "annotations", "train.json")) as f:
        demo = json.load(f)
    with open(os.path.join(root, "annotations", "train.json")) as f:
        kp = json.load(f)
    assert kp["images"] == demo["images"]
    assert [{k: a[k] for k in ("id", "bbox", "category_id")} for a in kp["annotations"]] == \
        [{k: a[k] for k in ("id", "bbox", "category_id")} for a in demo["annotations"]]
    for ann in kp["annotations"]:
        points = np.array(ann["keypoints"]).reshape(7, 3)
        x, y, w, h = ann["bbox"]
        name = SHAPE_CLASSES[ann["category_id"] - 1]
        labelled = {"circle": [], "rectangle": [0, 1, 2, 3], "triangle": [4, 5, 6]}[name]
        assert np.flatnonzero(points[:, 2]).tolist() == labelled
        assert ann["num_keypoints"] == len(labelled)
        visible = points[points[:, 2] == 2]
        assert ((visible[:, 0] >= x - 1) & (visible[:, 0] <= x + w + 1) & (visible[:, 1] >= y - 1)
                & (visible[:, 1] <= y + h + 1)).all()  # a vertex is on its outline, within a pixel of its box
        if name == "rectangle" and (points[:4, 2] == 2).all():  # whole: its corners are its box's
            np.testing.assert_allclose(points[:4, :2], [[x, y], [x + w - 1, y], [x + w - 1, y + h - 1],
                                                        [x, y + h - 1]], atol=1)
        if name == "triangle":
            assert points[4, 1] <= points[5:7, 1].min() and points[5, 0] <= points[6, 0]
    name = f"kp_shapes_{uuid.uuid4().hex[:8]}"
    register_dataset(name, os.path.join(root, "annotations", "val.json"), os.path.join(shapes_root, "val"))
    meta = get_dataset(name).keypoint_meta
    assert meta.names == SHAPE_KEYPOINTS and list(meta.flip_map) == [1, 0, 3, 2, 4, 6, 5]


def test_sets_trained_together_must_name_the_same_points(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    corners, _, _ = _corner_set(tmp_path / "a")
    person, _, _ = _person_set(tmp_path / "b", annotations=[])
    with pytest.raises(DataError, match=r"have different keypoints: \('top_left', .*\) against \('nose', "):
        check_same_categories([get_dataset(corners), _renamed(get_dataset(person), "box")])


def _renamed(dataset, name):
    """The dataset with its one category called ``name`` (so only the points differ)."""
    dataset.categories = {1: name}
    return dataset


def test_the_synthetic_batch_of_a_keypoint_config_trains_a_keypoint_rcnn():
    """The batch the precision probe times a model on (SOLVER.AMP.ENABLED auto) must suit a keypoint model:
    without keypoints its training step fails and the probe falls back to float32."""
    cfg = load_cfg(os.path.join(ROOT, "cfgs", "shapes", "keypoint_rcnn_R-10-FPN.yaml"),
                   ["MODEL.ROI_KEYPOINT_HEAD.CONV_DIMS", "[16]", "SOLVER.IMS_PER_BATCH", "2", "DEVICE", "cpu"])
    images, targets = synthetic_batch(cfg, training=True, num_keypoints=7)
    assert all(t["keypoints"].shape == (len(t["boxes"]), 7, 3) for t in targets)
    model = build_model(cfg).train()
    assert "loss_keypoint" in model(images, targets)
