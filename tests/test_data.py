"""Data pipeline: demo-set generator, catalog, COCO loading and validation, transforms, samplers, loaders."""
from __future__ import annotations

import itertools
import json
import logging
import os
import re
import runpy
import subprocess
import sys
import uuid

import cv2
import numpy as np
import pycocotools.mask as mask_util
import pytest
import torch

from pet.config import load_cfg
from pet.data import (
    build_test_loader,
    build_train_loader,
    collate_batch,
    generate_shapes,
    get_dataset,
    load_coco_json,
    read_image,
    register_coco_dataset,
)
from pet.data.samplers import EpochSampler, GroupedBatchSampler, InferenceSampler, TrainingSampler
from pet.data.transforms import ColorTransform, HFlipTransform, RandomFlip, ResizeShortestEdge, apply_augmentations
from pet.utils import comm
from pet.utils.errors import ConfigError, DataError
from pet.utils.visualization import _class_color

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_CFG = os.path.join(ROOT, "cfgs", "shapes", "faster_rcnn_R-18-FPN.yaml")


@pytest.fixture(scope="module")
def shapes_root(tmp_path_factory):
    return generate_shapes(str(tmp_path_factory.mktemp("data") / "shapes"), num_train=12, num_val=6, seed=1)


def _cfg(*opts, custom=(), num_classes=3):
    base = [
        "DEVICE", "cpu", "MODEL.NUM_CLASSES", num_classes, "SOLVER.IMS_PER_BATCH", 4, "DATA.NUM_WORKERS", 0,
        "INPUT.MIN_SIZE_TRAIN", (160, 192), "INPUT.MAX_SIZE_TRAIN", 320, "INPUT.MIN_SIZE_TEST", 192,
        "INPUT.MAX_SIZE_TEST", 320, "SOLVER.MAX_ITER", 10, "DATA.CUSTOM", list(custom),
    ]
    return load_cfg(None, [str(o) for o in (*base, *opts)], freeze=False)


def _register_shapes(root: str, split: str) -> str:
    name = f"shapes_{split}_{uuid.uuid4().hex[:8]}"
    register_coco_dataset(name, os.path.join(root, "annotations", f"{split}.json"), os.path.join(root, split))
    return name


def _write_coco(tmp_path, images=((1, 40, 30),), annotations=None, categories=None, write_images=True):
    """A small COCO dataset on disk; returns (name, json path, image dir)."""
    image_dir = tmp_path / "images"
    image_dir.mkdir(exist_ok=True)
    entries = []
    for image_id, w, h in images:
        entries.append({"id": image_id, "file_name": f"{image_id}.png", "width": w, "height": h})
        if write_images:
            cv2.imwrite(str(image_dir / f"{image_id}.png"), np.full((h, w, 3), 128, np.uint8))
    if annotations is None:
        annotations = [{"id": i + 1, "image_id": e["id"], "category_id": 1, "bbox": [2, 3, 10, 8], "iscrowd": 0}
                       for i, e in enumerate(entries)]
    data = {"images": entries, "annotations": annotations,
            "categories": categories or [{"id": 1, "name": "thing"}]}
    json_file = tmp_path / "ann.json"
    json_file.write_text(json.dumps(data))
    name = f"custom_{uuid.uuid4().hex[:8]}"
    register_coco_dataset(name, str(json_file), str(image_dir))
    return name, str(json_file), str(image_dir)


# --------------------------------------------------------------------------- demo set


def test_generate_shapes_is_deterministic_and_complete(shapes_root, tmp_path):
    other = generate_shapes(str(tmp_path / "again"), num_train=12, num_val=6, seed=1)
    for rel in ("annotations/train.json", "annotations/val.json", "train/000003.jpg", "val/000006.jpg"):
        with open(os.path.join(shapes_root, rel), "rb") as a, open(os.path.join(other, rel), "rb") as b:
            assert a.read() == b.read(), rel
    data = json.load(open(os.path.join(shapes_root, "annotations", "train.json")))
    assert [c["name"] for c in data["categories"]] == ["circle", "rectangle", "triangle"]
    assert len(data["images"]) == 12
    per_image = np.bincount([a["image_id"] for a in data["annotations"]])[1:]
    assert per_image.min() >= 1 and per_image.max() <= 6
    for ann in data["annotations"]:
        assert ann["iscrowd"] == 0 and ann["area"] > 0 and ann["segmentation"]
        assert 4 <= max(ann["bbox"][2:]) <= 98
    for img in data["images"]:
        assert 192 <= img["width"] <= 256 and 192 <= img["height"] <= 256


def test_generate_shapes_replaces_partial_set(tmp_path):
    root = tmp_path / "shapes"
    (root / "train").mkdir(parents=True)  # a crashed run: files but no completion marker
    (root / "train" / "junk.jpg").write_bytes(b"partial")
    (tmp_path / "shapes.tmp-999999").mkdir()  # the temporary folder of a killed run
    generate_shapes(str(root), num_train=2, num_val=1)
    assert not (root / "train" / "junk.jpg").exists()
    assert len(os.listdir(root / "train")) == 2
    assert not any(p.name.startswith("shapes.tmp") for p in tmp_path.iterdir())


# --------------------------------------------------------------------------- catalog and labels


def test_unknown_dataset_name_suggests_closest():
    with pytest.raises(ConfigError, match="Did you mean 'shapes_train'.*shapes_val"):
        get_dataset("shape_train")


def test_builtin_paths_follow_data_root(monkeypatch, tmp_path):
    from pet.data.catalog import get_dataset_spec

    monkeypatch.setenv("PET_DATA_ROOT", str(tmp_path))
    spec = get_dataset_spec("coco_2017_val")
    assert spec.json_file == str(tmp_path / "coco" / "annotations" / "instances_val2017.json")
    assert spec.image_root == str(tmp_path / "coco" / "val2017")


def test_custom_datasets_from_config(tmp_path):
    name, json_file, image_dir = (f"mine_{uuid.uuid4().hex[:6]}", *_write_coco(tmp_path)[1:])
    cfg = _cfg("TRAIN.DATASETS", (name,), custom=[{"name": name, "json": json_file, "images": image_dir}],
               num_classes=1)
    images, targets = next(iter(build_train_loader(cfg)))
    assert images.shape[0] == 4 and targets[0]["labels"].tolist() == [1]
    with pytest.raises(ConfigError, match=r"DATA.CUSTOM\[0\] lacks \['images'\]"):
        build_train_loader(_cfg(custom=[{"name": "x", "json": json_file}]))


def test_class_id_round_trip(tmp_path):
    categories = [{"id": 7, "name": "seven"}, {"id": 3, "name": "three"}, {"id": 12, "name": "twelve"}]
    annotations = [{"id": i + 1, "image_id": 1, "category_id": c, "bbox": [i * 5, 0, 4, 4]}
                   for i, c in enumerate([12, 3, 7, 3])]
    _, json_file, image_dir = _write_coco(tmp_path, annotations=annotations, categories=categories)
    ds = load_coco_json(json_file, image_dir)
    assert ds.class_names == ["three", "seven", "twelve"]
    assert ds.label_to_category_id == {1: 3, 2: 7, 3: 12}
    labels = ds.records[0]["labels"].tolist()
    assert [ds.label_to_category_id[label] for label in labels] == [12, 3, 7, 3]
    assert all(ds.category_id_to_label[ds.label_to_category_id[label]] == label for label in (1, 2, 3))


def test_crowd_excluded_and_empty_images_filtered_only_in_training(tmp_path):
    annotations = [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [0, 0, 5, 5], "iscrowd": 1},
                   {"id": 2, "image_id": 2, "category_id": 1, "bbox": [0, 0, 5, 5]}]
    name, *_ = _write_coco(tmp_path, images=[(1, 20, 20), (2, 20, 20), (3, 20, 20)], annotations=annotations)
    cfg = _cfg("TRAIN.DATASETS", (name,), "SOLVER.IMS_PER_BATCH", 1, num_classes=1)
    assert len(build_train_loader(cfg).dataset) == 1
    cfg.DATA.FILTER_EMPTY = False
    assert len(build_train_loader(cfg).dataset) == 3
    test_loader = build_test_loader(cfg, name)
    assert len(test_loader.dataset) == 3
    targets = [t for _, batch in test_loader for t in batch]
    assert [len(t["boxes"]) for t in targets] == [0, 1, 0]


def test_datasets_with_different_categories_cannot_be_concatenated(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, *_ = _write_coco(tmp_path / "a")
    b, *_ = _write_coco(tmp_path / "b", categories=[{"id": 1, "name": "other"}])
    with pytest.raises(DataError, match="have different categories"):
        build_train_loader(_cfg("TRAIN.DATASETS", (a, b), num_classes=1))


def test_concatenated_datasets_share_one_label_space(shapes_root):
    names = (_register_shapes(shapes_root, "train"), _register_shapes(shapes_root, "val"))
    loader = build_train_loader(_cfg("TRAIN.DATASETS", names))
    assert len(loader.dataset) == 18 and loader.dataset.class_names == ["circle", "rectangle", "triangle"]


def test_instances_table_is_logged(shapes_root, caplog):
    name = _register_shapes(shapes_root, "train")
    with caplog.at_level(logging.INFO, logger="pet.data.build"):
        build_train_loader(_cfg("TRAIN.DATASETS", (name,)))
    table = next(r.getMessage() for r in caplog.records if "Distribution of instances" in r.getMessage())
    assert "circle" in table and "triangle" in table and "total" in table


def test_num_classes_must_match_dataset(shapes_root):
    with pytest.raises(ConfigError, match="has 3 categories but MODEL.NUM_CLASSES is 80"):
        build_train_loader(_cfg("TRAIN.DATASETS", (_register_shapes(shapes_root, "train"),), num_classes=80))


# --------------------------------------------------------------------------- bad data


def test_missing_json(tmp_path):
    name = f"missing_{uuid.uuid4().hex[:6]}"
    register_coco_dataset(name, str(tmp_path / "nope.json"), str(tmp_path))
    with pytest.raises(DataError, match=f"Annotation file of dataset '{name}' not found: .*nope.json"):
        get_dataset(name)


@pytest.mark.parametrize("content, message", [
    ("{not json", "is not valid JSON"),
    ("[]", "looks like a detection results file"),
    ('{"images": []}', "is not in COCO format"),
    ('{"images": [{"id": 1}], "categories": [{"id": 1, "name": "a"}]}', "Image #0 .* needs an 'id' and a 'file_name'"),
])
def test_json_that_is_not_coco(tmp_path, content, message):
    json_file = tmp_path / "bad.json"
    json_file.write_text(content)
    with pytest.raises(DataError, match=message):
        load_coco_json(str(json_file), str(tmp_path))


def test_annotation_with_unknown_image_or_category(tmp_path):
    bad_image = [{"id": 5, "image_id": 99, "category_id": 1, "bbox": [0, 0, 2, 2]}]
    _, json_file, image_dir = _write_coco(tmp_path, annotations=bad_image)
    with pytest.raises(DataError, match="Annotation 5 in .*ann.json.* refers to image id 99"):
        load_coco_json(json_file, image_dir)
    bad_cat = [{"id": 6, "image_id": 1, "category_id": 4, "bbox": [0, 0, 2, 2]}]
    _, json_file, image_dir = _write_coco(tmp_path, annotations=bad_cat)
    with pytest.raises(DataError, match=r"Annotation 6 .*image id 1.* category id 4.*known ids: \[1\]"):
        load_coco_json(json_file, image_dir)


def test_degenerate_boxes_clipped_or_rejected(tmp_path, caplog):
    annotations = [
        {"id": 1, "image_id": 1, "category_id": 1, "bbox": [30, 20, 20, 20]},  # sticks out of the 40x30 image
        {"id": 2, "image_id": 1, "category_id": 1, "bbox": [5, 5, 0, 4]},  # zero width
        {"id": 3, "image_id": 1, "category_id": 1, "bbox": [2, 2, 5, 5]},  # fine
    ]
    _, json_file, image_dir = _write_coco(tmp_path, annotations=annotations)
    with caplog.at_level(logging.WARNING, logger="pet.data.dataset"):
        ds = load_coco_json(json_file, image_dir)
    np.testing.assert_allclose(ds.records[0]["boxes"], [[30, 20, 40, 30], [2, 2, 7, 7]])
    assert any("clipped 1 boxes" in r.getMessage() and "dropped 1" in r.getMessage() for r in caplog.records)
    with pytest.raises(DataError, match=r"Annotation 1 .*image id 1.*lies outside the 40x30 image.*DATA.STRICT"):
        load_coco_json(json_file, image_dir, strict=True)


def test_empty_dataset(tmp_path):
    _, json_file, image_dir = _write_coco(tmp_path, images=[], annotations=[])
    with pytest.raises(DataError, match="lists no images"):
        load_coco_json(json_file, image_dir)
    name, *_ = _write_coco(tmp_path, images=[(1, 20, 20)], annotations=[])
    with pytest.raises(DataError, match="has no image with a usable .*DATA.FILTER_EMPTY"):
        build_train_loader(_cfg("TRAIN.DATASETS", (name,), num_classes=1))


def test_missing_image_file(tmp_path):
    name, _, image_dir = _write_coco(tmp_path, images=[(1, 20, 20), (2, 20, 20)])
    os.remove(os.path.join(image_dir, "2.png"))
    cfg = _cfg("TRAIN.DATASETS", (name,), "SOLVER.IMS_PER_BATCH", 1, num_classes=1)
    with pytest.raises(DataError, match=r"1 of 2 image files .* missing, e.g. .*2.png \(image id 2\)"):
        build_train_loader(cfg)
    cfg.DATA.ON_BAD_IMAGE = "skip"
    loader = build_train_loader(cfg)
    assert len(loader.dataset) == 1 and loader.dataset.num_skipped == 1


# Through tools/train_net.py: one line on stderr naming the culprit, exit status 2, no traceback.
_BAD_DATA = {
    "missing json": ({}, "Annotation file of dataset '{name}' not found: .*nope.json. Check the path"),
    "invalid json": ({"json_text": "{not json"},
                     r"ann.json of dataset '{name}' is not valid JSON .*fix or re-download"),
    "not coco": ({"json_text": '{"images": []}'}, "ann.json of dataset '{name}' is not in COCO format: it needs"),
    "unknown image": ({"annotations": [{"id": 5, "image_id": 99, "category_id": 1, "bbox": [0, 0, 2, 2]}]},
                      r"Annotation 5 in .*ann.json \(dataset '{name}'\) refers to image id 99.*Fix the image_id"),
    "unknown category": ({"annotations": [{"id": 6, "image_id": 1, "category_id": 4, "bbox": [0, 0, 2, 2]}]},
                         r"Annotation 6 .*\(image id 1\) has category id 4, which is not in 'categories'"),
    "box outside, strict": ({"annotations": [{"id": 7, "image_id": 1, "category_id": 1, "bbox": [30, 20, 20, 20]}],
                             "opts": ["DATA.STRICT", True]},
                            r"Annotation 7 .*\(image id 1\): bbox \[30, 20, 20, 20\] lies outside the 40x30 image"),
    "empty box, strict": ({"annotations": [{"id": 8, "image_id": 1, "category_id": 1, "bbox": [5, 5, 0, 4]}],
                           "opts": ["DATA.STRICT", True]}, r"Annotation 8 .* has zero or negative size. Fix it"),
    "empty dataset": ({"images": [], "annotations": []}, "ann.json .* lists no images; .* Point the dataset at"),
    "no usable box": ({"annotations": []}, "Dataset '{name}' has no image with a usable .*DATA.FILTER_EMPTY False"),
    "missing image": ({"remove": "1.png"}, r"1 of 1 image files .* missing, e.g. .*1.png \(image id 1\)"),
    "mask without segmentation": ({"opts": ["MODEL.MASK_ON", True]},
                                  r"MODEL.MASK_ON is True but 1 annotations of dataset '{name}'"),
}


def _run_train_net_here(monkeypatch, capsys, *args) -> tuple[int, str]:
    """Run tools/train_net.py in this process (a subprocess each would cost seconds); (exit status, stderr)."""
    pet_logger = logging.getLogger("pet")
    saved = pet_logger.handlers[:], pet_logger.propagate, pet_logger.level
    monkeypatch.setattr(sys, "argv", ["train_net.py", *map(str, args)])
    status = 0
    try:
        runpy.run_path(os.path.join(ROOT, "tools", "train_net.py"), run_name="__main__")
    except SystemExit as exc:
        status = exc.code
    finally:  # train_net reconfigures the 'pet' logger; later tests rely on it propagating
        for handler in set(pet_logger.handlers) - set(saved[0]):
            handler.close()
        pet_logger.handlers[:], pet_logger.propagate = saved[0], saved[1]
        pet_logger.setLevel(saved[2])
    return status, capsys.readouterr().err


def _train_opts(tmp_path, name: str, json_file: str, image_dir: str) -> list[str]:
    return ["--cfg", DEMO_CFG, "CKPT", tmp_path / "run", *_custom_opts(json_file, image_dir, name),
            "MODEL.NUM_CLASSES", 1, "SOLVER.IMS_PER_BATCH", 2, "SOLVER.MAX_ITER", 2, "TEST.EVAL_PERIOD", 0,
            "TRAIN.AUTO_RESUME", False, "INPUT.MIN_SIZE_TRAIN", "(0,)"]


@pytest.mark.parametrize("case", list(_BAD_DATA))
def test_bad_data_stops_train_net_with_one_clear_line(tmp_path, monkeypatch, capsys, case):
    spec, expected = _BAD_DATA[case]
    _, json_file, image_dir = _write_coco(tmp_path, images=spec.get("images", ((1, 40, 30),)),
                                          annotations=spec.get("annotations"))
    if "json_text" in spec:
        with open(json_file, "w") as f:
            f.write(spec["json_text"])
    if case == "missing json":
        json_file = str(tmp_path / "nope.json")
    if "remove" in spec:
        os.remove(os.path.join(image_dir, spec["remove"]))
    name = f"bad_{uuid.uuid4().hex[:8]}"
    status, stderr = _run_train_net_here(monkeypatch, capsys, *_train_opts(tmp_path, name, json_file, image_dir),
                                         *spec.get("opts", []))
    assert status == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), stderr
    assert re.search(expected.replace("{name}", name), lines[0]), lines[0]


def test_corrupt_image_in_a_worker_stops_train_net_with_one_clear_line(tmp_path):
    name, json_file, image_dir = _write_coco(tmp_path, images=[(i, 24, 20) for i in range(1, 5)])
    for i in range(1, 5):  # every image broken: the first batch, loaded in the worker, must fail
        with open(os.path.join(image_dir, f"{i}.png"), "wb") as f:
            f.write(b"this is not a png")
    proc = _run_tool("train_net.py", *_train_opts(tmp_path, "broken", json_file, image_dir), "DATA.NUM_WORKERS", 1)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert re.match(r"Error: Cannot decode image .*\d.png \(image id \d\): the file is empty, corrupt or not an "
                    r"image. Replace or remove it, or set DATA.ON_BAD_IMAGE skip", lines[0]), lines[0]


def _corrupt_dataset(tmp_path):
    name, _, image_dir = _write_coco(tmp_path, images=[(i, 24, 20) for i in range(1, 5)])
    with open(os.path.join(image_dir, "3.png"), "wb") as f:
        f.write(b"this is not a png")
    return name


@pytest.mark.parametrize("workers", [0, 1])
def test_corrupt_image_error_is_one_clean_message(tmp_path, workers):
    name = _corrupt_dataset(tmp_path)
    cfg = _cfg("TEST.IMS_PER_BATCH", 2, "DATA.NUM_WORKERS", workers, num_classes=1)
    try:  # not pytest.raises: its traceback would keep the loader (and its worker) alive until exit
        list(build_test_loader(cfg, name))
        raise AssertionError("no DataError raised")
    except DataError as exc:
        message = str(exc)
    assert message.startswith("Cannot decode image") and "3.png (image id 3)" in message
    assert "DATA.ON_BAD_IMAGE skip" in message and "Traceback" not in message


def test_corrupt_image_skipped(tmp_path):
    name = _corrupt_dataset(tmp_path)
    cfg = _cfg("TRAIN.DATASETS", (name,), "DATA.ON_BAD_IMAGE", "skip", "SOLVER.IMS_PER_BATCH", 4, num_classes=1)
    loader = build_train_loader(cfg)
    batches = list(itertools.islice(loader, 3))
    assert all(images.shape[0] == 4 for images, _ in batches)
    assert all(t["image_id"] != 3 for _, targets in batches for t in targets)
    assert loader.dataset.num_skipped >= 1


def test_gray_and_rgba_images_become_rgb(tmp_path):
    gray, rgba = tmp_path / "gray.png", tmp_path / "rgba.png"
    cv2.imwrite(str(gray), np.full((6, 5), 200, np.uint8))
    cv2.imwrite(str(rgba), np.dstack([np.full((6, 5, 3), (10, 20, 30), np.uint8), np.full((6, 5), 255, np.uint8)]))
    assert read_image(str(gray)).shape == (6, 5, 3)
    image = read_image(str(rgba))
    assert image.shape == (6, 5, 3) and image[0, 0].tolist() == [30, 20, 10]  # BGR on disk -> RGB


# --------------------------------------------------------------------------- transforms


def test_resize_and_flip_keep_boxes_on_the_pixels():
    image = np.zeros((100, 150, 3), np.uint8)
    image[20:50, 30:90] = 255  # box XYXY (30, 20, 90, 50)
    boxes = np.array([[30, 20, 90, 50]], np.float32)
    augs = [ResizeShortestEdge((200,), 1000), RandomFlip(prob=1.0)]
    out, transform = apply_augmentations(augs, image, np.random.default_rng(0))
    assert out.shape == (200, 300, 3)
    ys, xs = np.nonzero(out[..., 0] > 127)
    np.testing.assert_allclose(transform.apply_boxes(boxes)[0], [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1],
                               atol=1.5)
    np.testing.assert_allclose(transform.apply_boxes(boxes)[0], [300 - 180, 40, 300 - 60, 100])
    polygon = np.array([30, 20, 90, 20, 90, 50, 30, 50], np.float64)
    np.testing.assert_allclose(transform.apply_polygons([polygon])[0], [240, 40, 120, 40, 120, 100, 240, 100])


def test_resize_respects_max_size_and_multi_scale():
    aug = ResizeShortestEdge((100, 200), max_size=250)
    rng = np.random.default_rng(0)
    shapes = {aug.get_transform(100, 400, rng).new_h for _ in range(20)}
    assert shapes == {62}  # 200/100 would make the long side 800 > 250, so it is capped at 250
    sizes = {aug.get_transform(300, 300, rng).new_h for _ in range(30)}
    assert sizes == {100, 200}
    flip = HFlipTransform(10)
    np.testing.assert_allclose(flip.apply_boxes(flip.apply_boxes(np.array([[1, 2, 4, 6]], np.float32))), [[1, 2, 4, 6]])


def test_color_transform_matches_torchvision_and_keeps_geometry():
    from torchvision.transforms.v2 import functional as F

    image = np.random.default_rng(0).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    jitter = ColorTransform(brightness=1.3, contrast=0.7, saturation=1.4)
    chw = torch.from_numpy(image).permute(2, 0, 1)
    reference = F.adjust_saturation(F.adjust_contrast(F.adjust_brightness(chw, 1.3), 0.7), 1.4)
    # torchvision rounds to uint8 after each step, Pet once at the end
    assert np.abs(jitter.apply_image(image).astype(int) - reference.permute(1, 2, 0).numpy()).max() <= 3
    assert ColorTransform().apply_image(image) is image
    boxes = np.array([[1, 2, 5, 6]], np.float32)
    np.testing.assert_array_equal(jitter.apply_boxes(boxes), boxes)


def test_color_jitter_changes_pixels_not_boxes_and_is_seeded(shapes_root):
    name = _register_shapes(shapes_root, "train")

    def first_batch(*opts):
        return next(iter(build_train_loader(_cfg("TRAIN.DATASETS", (name,), *opts))))

    plain_images, plain_targets = first_batch()
    jitter = ("INPUT.BRIGHTNESS", 0.4, "INPUT.CONTRAST", 0.4, "INPUT.SATURATION", 0.4)
    images, targets = first_batch(*jitter)
    assert images.shape == plain_images.shape and not torch.equal(images, plain_images)
    for a, b in zip(targets, plain_targets):
        assert a["image_id"] == b["image_id"] and a["image_size"] == b["image_size"]
        assert torch.equal(a["boxes"], b["boxes"])
    assert torch.equal(first_batch(*jitter)[0], images)  # same seed, same jitter
    with pytest.raises(ConfigError, match=r"INPUT.CONTRAST must be in \[0, 1\]"):
        first_batch("INPUT.CONTRAST", 1.5)


# --------------------------------------------------------------------------- masks


def _mask_box(mask: torch.Tensor) -> list[int]:
    ys, xs = torch.nonzero(mask, as_tuple=True)
    return [int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1]


@pytest.mark.parametrize("flip", [0.0, 1.0])
def test_masks_follow_boxes_through_resize_and_flip(shapes_root, flip):
    name = _register_shapes(shapes_root, "train")
    loader = build_train_loader(_cfg("TRAIN.DATASETS", (name,), "MODEL.MASK_ON", True, "INPUT.FLIP_PROB", flip))
    for _, targets in itertools.islice(loader, 3):
        for t in targets:
            masks = t["masks"]
            assert masks.dtype == torch.uint8 and masks.shape == (len(t["boxes"]), *t["image_size"])
            assert set(masks.unique().tolist()) == {0, 1}
            for box, mask in zip(t["boxes"], masks):  # polygons of the visible part: their box is the bbox
                np.testing.assert_allclose(_mask_box(mask), box.tolist(), atol=2)


def test_polygon_and_rle_masks_stay_aligned_with_labels_through_resize_and_flip(tmp_path):
    rle_region = np.zeros((30, 40), np.uint8)
    rle_region[5:15, 20:30] = 1
    rle = mask_util.encode(np.asfortranarray(rle_region))
    rle["counts"] = rle["counts"].decode()
    crowd = mask_util.encode(np.asfortranarray(np.ones((30, 40), np.uint8)))
    crowd["counts"] = crowd["counts"].decode()
    annotations = [
        {"id": 1, "image_id": 1, "category_id": 7, "bbox": [2, 3, 10, 8],
         "segmentation": [[2, 3, 12, 3, 12, 11, 2, 11], [0, 0, 1, 1]]},  # the 2-point polygon is dropped
        {"id": 2, "image_id": 1, "category_id": 3, "bbox": [0, 0, 40, 30], "segmentation": crowd, "iscrowd": 1},
        {"id": 3, "image_id": 1, "category_id": 7, "bbox": [5, 5, 0, 3], "segmentation": [[5, 5, 6, 5, 6, 8]]},
        {"id": 4, "image_id": 1, "category_id": 3, "bbox": [20, 5, 10, 10], "segmentation": rle},
    ]
    name, *_ = _write_coco(tmp_path, annotations=annotations,
                           categories=[{"id": 7, "name": "seven"}, {"id": 3, "name": "three"}])
    cfg = _cfg("TRAIN.DATASETS", (name,), "SOLVER.IMS_PER_BATCH", 1, "MODEL.MASK_ON", True, "INPUT.MIN_SIZE_TRAIN",
               (60,), "INPUT.MAX_SIZE_TRAIN", 1000, "INPUT.FLIP_PROB", 1.0, num_classes=2)
    loader = build_train_loader(cfg)
    _, (target,) = next(iter(loader))
    # crowd (2) and zero-width (3) annotations are gone from boxes, labels and masks alike
    assert [loader.dataset.label_to_category_id[int(label)] for label in target["labels"]] == [7, 3]
    assert target["image_size"] == (60, 80) and target["masks"].shape == (2, 60, 80)
    np.testing.assert_allclose(target["boxes"], [[80 - 24, 6, 80 - 4, 22], [80 - 60, 10, 80 - 40, 30]])
    assert [_mask_box(m) for m in target["masks"]] == [[56, 6, 76, 22], [20, 10, 40, 30]]
    expected_rle = np.repeat(np.repeat(rle_region, 2, axis=0), 2, axis=1)[:, ::-1]
    assert np.array_equal(target["masks"][1].numpy(), expected_rle)
    assert int(target["masks"][0].sum()) == 20 * 16


def test_mask_on_needs_a_segmentation_for_every_box(tmp_path):
    name, json_file, _ = _write_coco(tmp_path)  # boxes only
    cfg = _cfg("TRAIN.DATASETS", (name,), "MODEL.MASK_ON", True, num_classes=1)
    with pytest.raises(DataError, match=r"MODEL.MASK_ON is True but 1 annotations .*ann.json.* no usable "
                                        r"'segmentation'.*annotation ids \[1\].*set MODEL.MASK_ON False"):
        build_train_loader(cfg)
    cfg.MODEL.MASK_ON = False
    assert "masks" not in next(iter(build_train_loader(cfg)))[1][0]


@pytest.mark.parametrize("segmentation, message", [
    ({"counts": "00", "size": [10, 10]}, r"Annotation 1 .*image id 1.* RLE mask of size \[10, 10\].* 30x40"),
    ({"size": [30, 40]}, "Annotation 1 .*RLE segmentation without 'counts' and 'size'"),
    ([1, 2, 3, 4, 5, 6], r"Annotation 1 .*neither RLE nor a list of polygons"),
])
def test_malformed_segmentation_is_named(tmp_path, segmentation, message):
    annotations = [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [2, 3, 10, 8], "segmentation": segmentation}]
    _, json_file, image_dir = _write_coco(tmp_path, annotations=annotations)
    with pytest.raises(DataError, match=message):
        load_coco_json(json_file, image_dir)


# --------------------------------------------------------------------------- samplers


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("size", [1, 7, 10])
def test_inference_sampler_covers_every_index_once(world_size, size):
    shards = [list(InferenceSampler(size, rank, world_size)) for rank in range(world_size)]
    assert sorted(i for s in shards for i in s) == list(range(size))
    assert sum(shards, []) == list(range(size))  # contiguous, in rank order
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_training_sampler_is_seeded_and_sharded():
    def take(rank, world, seed=0):
        return list(itertools.islice(TrainingSampler(10, seed, rank=rank, world_size=world), 15))

    assert take(0, 1) == take(0, 1) and take(0, 1) != take(0, 1, seed=1)
    stream = take(0, 1)[:10]
    assert sorted(i for i, _ in stream) == list(range(10))
    assert take(0, 2)[:5] == stream[0::2] and take(1, 2)[:5] == stream[1::2]


def test_epoch_sampler_reshuffles_and_balances_ranks():
    samplers = [EpochSampler(7, seed=0, rank=r, world_size=2) for r in range(2)]
    first = [list(s) for s in samplers]
    assert [len(x) for x in first] == [4, 4] and {i for x in first for i, _ in x} == set(range(7))
    for s in samplers:
        s.set_epoch(1)
    assert [list(s) for s in samplers] != first
    samplers[0].set_epoch(0)
    assert list(samplers[0]) == first[0]


def test_grouped_batch_sampler_groups_by_aspect_ratio():
    group_ids = np.array([0, 1] * 10)
    sampler = EpochSampler(20, seed=0, rank=0, world_size=1)
    batches = list(GroupedBatchSampler(sampler, group_ids, batch_size=3))
    assert len(batches) == 20 // 3 == len(GroupedBatchSampler(sampler, group_ids, 3))
    mixed = [b for b in batches if len({group_ids[i] for i, _ in b}) > 1]
    assert len(mixed) <= 1 and (not mixed or mixed[0] is batches[-1])  # only the leftovers batch mixes


# --------------------------------------------------------------------------- loaders


def test_collate_pads_to_size_divisibility():
    samples = [{"image": torch.full((3, 50, 70), 7, dtype=torch.uint8), "image_id": 1},
               {"image": torch.full((3, 65, 40), 9, dtype=torch.uint8), "image_id": 2}]
    images, targets = collate_batch(samples, size_divisibility=32)
    assert images.shape == (2, 3, 96, 96) and images.dtype == torch.uint8
    assert images.is_contiguous(memory_format=torch.channels_last)  # no transpose of the HWC pixels
    assert images[0, :, :50, :70].eq(7).all() and images[0, :, 50:].eq(0).all() and images[0, :, :, 70:].eq(0).all()
    assert images[1, :, :65, :40].eq(9).all() and images[1, :, :, 40:].eq(0).all()
    assert [t["image_id"] for t in targets] == [1, 2] and "image" not in targets[0]


def test_train_batch_follows_the_contract(shapes_root):
    name = _register_shapes(shapes_root, "train")
    loader = build_train_loader(_cfg("TRAIN.DATASETS", (name,)))
    images, targets = next(iter(loader))
    assert images.dtype == torch.uint8 and images.shape[0] == 4 and images.shape[2] % 32 == images.shape[3] % 32 == 0
    coco = loader.dataset.coco
    for t in targets:
        h, w = t["image_size"]
        assert min(h, w) in (160, 192) and images.shape[2] >= h and images.shape[3] >= w
        assert (t["orig_size"][0], t["orig_size"][1]) == (coco.imgs[t["image_id"]]["height"],
                                                           coco.imgs[t["image_id"]]["width"])
        assert t["boxes"].dtype == torch.float32 and t["labels"].dtype == torch.int64
        assert len(t["boxes"]) == len(coco.getAnnIds(imgIds=t["image_id"])) and t["labels"].min() >= 1
        assert (t["boxes"][:, 2:] <= torch.tensor([w, h])).all()


def test_loader_reproducible_with_and_without_workers(shapes_root):
    name = _register_shapes(shapes_root, "train")

    def batches(workers):
        loader = build_train_loader(_cfg("TRAIN.DATASETS", (name,), "DATA.NUM_WORKERS", workers))
        return list(itertools.islice(loader, 4))

    for (img_a, tgt_a), (img_b, tgt_b) in zip(batches(0), batches(2)):
        assert torch.equal(img_a, img_b)
        assert [t["image_id"] for t in tgt_a] == [t["image_id"] for t in tgt_b]
        assert all(torch.equal(a["boxes"], b["boxes"]) for a, b in zip(tgt_a, tgt_b))


def test_epoch_mode_loader_has_a_length_and_reshuffles(shapes_root):
    name = _register_shapes(shapes_root, "train")
    loader = build_train_loader(_cfg("TRAIN.DATASETS", (name,), "SOLVER.MAX_ITER", 0, "SOLVER.MAX_EPOCHS", 2,
                                     "DATA.ASPECT_RATIO_GROUPING", False))
    assert len(loader) == 3
    order = [[t["image_id"] for t in targets] for _, targets in loader]
    assert sorted(sum(order, [])) == sorted(loader.dataset.coco.getImgIds())
    loader.batch_sampler.set_epoch(1)
    assert [[t["image_id"] for t in targets] for _, targets in loader] != order


def test_per_process_batch_must_divide(shapes_root, monkeypatch):
    monkeypatch.setattr(comm, "get_world_size", lambda: 3)
    with pytest.raises(ConfigError, match=r"SOLVER.IMS_PER_BATCH \(4\) must be a positive multiple .* \(3\)"):
        build_train_loader(_cfg("TRAIN.DATASETS", (_register_shapes(shapes_root, "train"),)))


def test_test_loader_keeps_order_and_sizes(shapes_root):
    name = _register_shapes(shapes_root, "val")
    loader = build_test_loader(_cfg("TEST.IMS_PER_BATCH", 4), name)
    targets = [t for _, batch in loader for t in batch]
    assert [t["image_id"] for t in targets] == sorted(loader.dataset.coco.getImgIds())
    assert all(min(t["image_size"]) == 192 for t in targets)
    assert loader.sampler.start == 0 and loader.sampler.end == 6 and loader.batch_size == 4


# --------------------------------------------------------------------------- tools/visualize_data.py


def _run_tool(tool: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", tool), *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=300)


def _custom_opts(json_file: str, image_dir: str, name: str = "mine") -> list[str]:
    return ["DATA.CUSTOM", f"[{{'name': '{name}', 'json': '{json_file}', 'images': '{image_dir}'}}]",
            "TRAIN.DATASETS", f"('{name}',)", "TEST.DATASETS", f"('{name}',)"]


@pytest.mark.parametrize("split, short_side", [("train", 320), ("test", 160)])
def test_visualize_data_writes_transformed_images_with_ground_truth(shapes_root, tmp_path, split, short_side):
    out = tmp_path / "vis"
    proc = _run_tool("visualize_data.py", "--cfg", DEMO_CFG, "--split", split, "--num", 3, "--out", out,
                     *_custom_opts(f"{shapes_root}/annotations/val.json", f"{shapes_root}/val"),
                     "MODEL.MASK_ON", True, "INPUT.MIN_SIZE_TRAIN", "(320,)", "INPUT.MIN_SIZE_TEST", 160)
    assert proc.returncode == 0, proc.stderr[-2000:]
    files = sorted(os.listdir(out))
    assert len(files) == 3 and all(f.startswith(f"{split}_") and f.endswith(".png") for f in files)
    class_colors = [np.array(_class_color(n)[::-1]) for n in ("circle", "rectangle", "triangle")]  # BGR on disk
    for f in files:
        picture = cv2.imread(str(out / f))
        assert picture is not None and min(picture.shape[:2]) == short_side  # after the resize
        assert os.path.getsize(out / f) > 5_000
        drawn = sum(int(np.all(picture == c, axis=-1).sum()) for c in class_colors)
        assert drawn > 100  # box outlines and name tags in the class colours
