"""COCO-format datasets: the demo-set generator, the catalog, loading and validation, image decoding, and the
one-line errors bad data gives through tools/train_net.py."""
from __future__ import annotations

import itertools
import json
import logging
import os
import re
import uuid

import cv2
import numpy as np
import pytest

from pet.data import (
    build_test_loader,
    build_train_loader,
    generate_shapes,
    get_dataset,
    load_coco_json,
    read_image,
    register_coco_dataset,
)
from pet.utils.errors import ConfigError, DataError
from support.helpers import (
    DEMO_CFG,
    data_cfg,
    register_split,
    run_tool,
    run_tool_here,
    single_dataset_opts,
    write_coco,
)

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
    assert spec.path == str(tmp_path / "coco" / "annotations" / "instances_val2017.json")
    assert spec.image_root == str(tmp_path / "coco" / "val2017")


def test_custom_datasets_from_config(tmp_path):
    name, json_file, image_dir = (f"mine_{uuid.uuid4().hex[:6]}", *write_coco(tmp_path)[1:])
    cfg = data_cfg("TRAIN.DATASETS", (name,), custom=[{"name": name, "path": json_file, "images": image_dir}],
               num_classes=1)
    images, targets = next(iter(build_train_loader(cfg)))
    assert images.shape[0] == 4 and targets[0]["labels"].tolist() == [1]
    with pytest.raises(ConfigError, match=r"DATA.CUSTOM\[0\]: .* lacks images"):
        build_train_loader(data_cfg(custom=[{"name": "x", "path": json_file}]))


def test_a_coco_entrys_old_json_key_still_registers_with_a_warning(tmp_path, caplog):
    """``json:`` is ``path:``'s name before 0.2.0: the entry still loads until 0.3.0, with a warning naming both."""
    name, json_file, image_dir = (f"old_{uuid.uuid4().hex[:6]}", *write_coco(tmp_path)[1:])
    cfg = data_cfg("TRAIN.DATASETS", (name,), custom=[{"name": name, "json": json_file, "images": image_dir}],
                   num_classes=1)
    with caplog.at_level("WARNING", logger="pet.data.catalog"):
        images, _ = next(iter(build_train_loader(cfg)))
    assert images.shape[0] == 4
    assert [r.getMessage() for r in caplog.records if "`json`" in r.getMessage()] == [
        f"DATA.CUSTOM[0] ('{name}') gives `json`, which is now called `path`; please rename it (`json` goes in "
        "Pet 0.3.0)."]


def test_class_id_round_trip(tmp_path):
    categories = [{"id": 7, "name": "seven"}, {"id": 3, "name": "three"}, {"id": 12, "name": "twelve"}]
    annotations = [{"id": i + 1, "image_id": 1, "category_id": c, "bbox": [i * 5, 0, 4, 4]}
                   for i, c in enumerate([12, 3, 7, 3])]
    _, json_file, image_dir = write_coco(tmp_path, annotations=annotations, categories=categories)
    ds = load_coco_json(json_file, image_dir)
    assert ds.class_names == ["three", "seven", "twelve"]
    assert ds.label_to_category_id == {1: 3, 2: 7, 3: 12}
    labels = ds.records[0]["labels"].tolist()
    assert [ds.label_to_category_id[label] for label in labels] == [12, 3, 7, 3]
    assert all(ds.category_id_to_label[ds.label_to_category_id[label]] == label for label in (1, 2, 3))


def test_crowd_excluded_and_empty_images_filtered_only_in_training(tmp_path):
    annotations = [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [0, 0, 5, 5], "iscrowd": 1},
                   {"id": 2, "image_id": 2, "category_id": 1, "bbox": [0, 0, 5, 5]}]
    name, *_ = write_coco(tmp_path, images=[(1, 20, 20), (2, 20, 20), (3, 20, 20)], annotations=annotations)
    cfg = data_cfg("TRAIN.DATASETS", (name,), "SOLVER.IMS_PER_BATCH", 1, num_classes=1)
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
    a, *_ = write_coco(tmp_path / "a")
    b, *_ = write_coco(tmp_path / "b", categories=[{"id": 1, "name": "other"}])
    with pytest.raises(DataError, match="have different categories"):
        build_train_loader(data_cfg("TRAIN.DATASETS", (a, b), num_classes=1))


def test_concatenated_datasets_share_one_label_space(shapes_root):
    names = (register_split(shapes_root, "train"), register_split(shapes_root, "val"))
    loader = build_train_loader(data_cfg("TRAIN.DATASETS", names))
    assert len(loader.dataset) == 18 and loader.dataset.class_names == ["circle", "rectangle", "triangle"]


def test_instances_table_is_logged(shapes_root, caplog):
    name = register_split(shapes_root, "train")
    with caplog.at_level(logging.INFO, logger="pet.data.build"):
        build_train_loader(data_cfg("TRAIN.DATASETS", (name,)))
    table = next(r.getMessage() for r in caplog.records if "Distribution of instances" in r.getMessage())
    assert "circle" in table and "triangle" in table and "total" in table


def test_num_classes_must_match_dataset(shapes_root):
    with pytest.raises(ConfigError, match="has 3 categories but MODEL.NUM_CLASSES is 80"):
        build_train_loader(data_cfg("TRAIN.DATASETS", (register_split(shapes_root, "train"),), num_classes=80))


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
    ('{"images": [{"id": 1, "file_name": "a.png", "width": "60", "height": "40"}], "categories": [{"id": 1, '
     '"name": "a"}], "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [1, 5, 10, 10]}]}',
     r"Image id 1 in .*bad.json .* has width '60' and height '40'; they must be numbers of pixels"),
])
def test_json_that_is_not_coco(tmp_path, content, message):
    json_file = tmp_path / "bad.json"
    json_file.write_text(content)
    with pytest.raises(DataError, match=message):
        load_coco_json(str(json_file), str(tmp_path))


def test_annotation_with_unknown_image_or_category(tmp_path):
    bad_image = [{"id": 5, "image_id": 99, "category_id": 1, "bbox": [0, 0, 2, 2]}]
    _, json_file, image_dir = write_coco(tmp_path, annotations=bad_image)
    with pytest.raises(DataError, match="Annotation 5 in .*ann.json.* refers to image id 99"):
        load_coco_json(json_file, image_dir)
    bad_cat = [{"id": 6, "image_id": 1, "category_id": 4, "bbox": [0, 0, 2, 2]}]
    _, json_file, image_dir = write_coco(tmp_path, annotations=bad_cat)
    with pytest.raises(DataError, match=r"Annotation 6 .*image id 1.* category id 4.*known ids: \[1\]"):
        load_coco_json(json_file, image_dir)
    # With `classes`, the check comes before the renumbering: id 1 is no category of the file, not the new 'thing'.
    _, json_file, image_dir = write_coco(tmp_path, annotations=[{"id": 7, "image_id": 1, "category_id": 1,
                                                                 "bbox": [0, 0, 2, 2]}],
                                         categories=[{"id": 5, "name": "thing"}])
    with pytest.raises(DataError, match=r"Annotation 7 .*image id 1.* category id 1.*known ids: \[5\]"):
        load_coco_json(json_file, image_dir, classes=["thing"])


def test_degenerate_boxes_clipped_or_rejected(tmp_path, caplog):
    annotations = [
        {"id": 1, "image_id": 1, "category_id": 1, "bbox": [30, 20, 20, 20]},  # sticks out of the 40x30 image
        {"id": 2, "image_id": 1, "category_id": 1, "bbox": [5, 5, 0, 4]},  # zero width
        {"id": 3, "image_id": 1, "category_id": 1, "bbox": [2, 2, 5, 5]},  # fine
    ]
    _, json_file, image_dir = write_coco(tmp_path, annotations=annotations)
    with caplog.at_level(logging.WARNING, logger="pet.data.coco_json"):
        ds = load_coco_json(json_file, image_dir)
    np.testing.assert_allclose(ds.records[0]["boxes"], [[30, 20, 40, 30], [2, 2, 7, 7]])
    assert any("clipped 1 boxes" in r.getMessage() and "dropped 1" in r.getMessage() for r in caplog.records)
    with pytest.raises(DataError, match=r"Annotation 1 .*image id 1.*lies outside the 40x30 image.*DATA.STRICT"):
        load_coco_json(json_file, image_dir, strict=True)


def test_empty_dataset(tmp_path):
    _, json_file, image_dir = write_coco(tmp_path, images=[], annotations=[])
    with pytest.raises(DataError, match="lists no images"):
        load_coco_json(json_file, image_dir)
    name, *_ = write_coco(tmp_path, images=[(1, 20, 20)], annotations=[])
    with pytest.raises(DataError, match="has no image with a usable .*DATA.FILTER_EMPTY"):
        build_train_loader(data_cfg("TRAIN.DATASETS", (name,), num_classes=1))


def test_missing_image_file(tmp_path):
    name, _, image_dir = write_coco(tmp_path, images=[(1, 20, 20), (2, 20, 20)])
    os.remove(os.path.join(image_dir, "2.png"))
    cfg = data_cfg("TRAIN.DATASETS", (name,), "SOLVER.IMS_PER_BATCH", 1, num_classes=1)
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
    "NaN in a box": ({"annotations": [{"id": 9, "image_id": 1, "category_id": 1, "bbox": [float("nan"), 5, 4, 4]}]},
                     r"Annotation 9 in .*ann.json \(dataset '{name}'\) \(image id 1\) has bbox \[nan, 5, 4, 4\], "
                     "which holds NaN or infinity"),
    "infinity in a box, strict": ({"annotations": [{"id": 3, "image_id": 1, "category_id": 1,
                                                    "bbox": [1, 5, float("inf"), 4]}], "opts": ["DATA.STRICT", True]},
                                  r"Annotation 3 in .*ann.json .* has bbox \[1, 5, inf, 4\], which holds NaN or "
                                  "infinity. Fix or remove"),
    "empty dataset": ({"images": [], "annotations": []}, "ann.json .* lists no images; .* Point the dataset at"),
    "no usable box": ({"annotations": []}, "Dataset '{name}' has no image with a usable .*DATA.FILTER_EMPTY False"),
    "missing image": ({"remove": "1.png"}, r"1 of 1 image files .* missing, e.g. .*1.png \(image id 1\)"),
    "mask without segmentation": ({"opts": ["MODEL.MASK_ON", True]},
                                  r"MODEL.MASK_ON is True but 1 annotations of dataset '{name}'"),
}


def _train_opts(tmp_path, name: str, json_file: str, image_dir: str) -> list[str]:
    return ["--cfg", DEMO_CFG, "CKPT", tmp_path / "run", *single_dataset_opts(json_file, image_dir, name),
            "MODEL.NUM_CLASSES", 1, "SOLVER.IMS_PER_BATCH", 2, "SOLVER.MAX_ITER", 2, "HOOKS.EVAL.PERIOD", 0,
            "TRAIN.AUTO_RESUME", False, "INPUT.MIN_SIZE_TRAIN", "(0,)"]


@pytest.mark.parametrize("case", list(_BAD_DATA))
def test_bad_data_stops_train_net_with_one_clear_line(tmp_path, monkeypatch, capsys, case):
    spec, expected = _BAD_DATA[case]
    _, json_file, image_dir = write_coco(tmp_path, images=spec.get("images", ((1, 40, 30),)),
                                          annotations=spec.get("annotations"))
    if "json_text" in spec:
        with open(json_file, "w") as f:
            f.write(spec["json_text"])
    if case == "missing json":
        json_file = str(tmp_path / "nope.json")
    if "remove" in spec:
        os.remove(os.path.join(image_dir, spec["remove"]))
    name = f"bad_{uuid.uuid4().hex[:8]}"
    status, stderr = run_tool_here(monkeypatch, capsys, "train_net.py",
                                   *_train_opts(tmp_path, name, json_file, image_dir), *spec.get("opts", []))
    assert status == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), stderr
    assert re.search(expected.replace("{name}", name), lines[0]), lines[0]


@pytest.mark.slow
def test_corrupt_image_in_a_worker_stops_train_net_with_one_clear_line(tmp_path):
    name, json_file, image_dir = write_coco(tmp_path, images=[(i, 24, 20) for i in range(1, 5)])
    for i in range(1, 5):  # every image broken: the first batch, loaded in the worker, must fail
        with open(os.path.join(image_dir, f"{i}.png"), "wb") as f:
            f.write(b"this is not a png")
    proc = run_tool("train_net.py", *_train_opts(tmp_path, "broken", json_file, image_dir), "DATA.NUM_WORKERS", 1,
                    check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert re.match(r"Error: Cannot decode image .*\d.png \(image id \d\): the file is empty, corrupt or not an "
                    r"image. Replace or remove it, or set DATA.ON_BAD_IMAGE skip", lines[0]), lines[0]


def _corrupt_dataset(tmp_path):
    name, _, image_dir = write_coco(tmp_path, images=[(i, 24, 20) for i in range(1, 5)])
    with open(os.path.join(image_dir, "3.png"), "wb") as f:
        f.write(b"this is not a png")
    return name


@pytest.mark.parametrize("workers", [0, 1])
def test_corrupt_image_error_is_one_clean_message(tmp_path, workers):
    name = _corrupt_dataset(tmp_path)
    cfg = data_cfg("TEST.IMS_PER_BATCH", 2, "DATA.NUM_WORKERS", workers, num_classes=1)
    try:  # not pytest.raises: its traceback would keep the loader (and its worker) alive until exit
        list(build_test_loader(cfg, name))
        raise AssertionError("no DataError raised")
    except DataError as exc:
        message = str(exc)
    assert message.startswith("Cannot decode image") and "3.png (image id 3)" in message
    assert "DATA.ON_BAD_IMAGE skip" in message and "Traceback" not in message


def test_corrupt_image_skipped(tmp_path):
    name = _corrupt_dataset(tmp_path)
    cfg = data_cfg("TRAIN.DATASETS", (name,), "DATA.ON_BAD_IMAGE", "skip", "SOLVER.IMS_PER_BATCH", 4, num_classes=1)
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
