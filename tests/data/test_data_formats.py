"""Datasets as people have them: YOLO, Pascal VOC and CSV read without conversion, one set in all four formats,
outside conventions (the VOC devkit's XML, keras-retinanet / DeepForest CSVs, Ultralytics' YOLO layout), class
lists, image sizes after EXIF orientation, and the one-line errors of bad labels."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid

import cv2
import numpy as np
import pytest
import torch

from pet.cli import seed_everything
from pet.config import load_cfg
from pet.data import build_train_loader, get_dataset
from pet.data.catalog import register_dataset
from pet.data.formats import image_size, read_csv, read_yolo
from pet.engine.trainer import Trainer
from pet.modeling import build_model
from pet.utils.errors import DataError
from support.format_sets import BACKGROUND, CLASSES, RARE, write_all_formats
from support.helpers import DEMO_CFG, doc_block, run_tool_here

FORMATS = ("coco", "yolo", "voc", "csv")


@pytest.fixture(scope="module")
def four_formats(tmp_path_factory):
    """The same set in the four formats, each registered under a fresh name: {format: dataset name}."""
    specs = write_all_formats(tmp_path_factory.mktemp("formats"))
    names = {}
    for fmt, spec in specs.items():
        names[fmt] = f"{fmt}_{uuid.uuid4().hex[:8]}"
        register_dataset(names[fmt], spec["path"], spec.get("images", ""), format=fmt, split=spec.get("split", ""))
    return names


def _name() -> str:
    return f"set_{uuid.uuid4().hex[:8]}"


def _register(spec: dict, **extra) -> str:
    name = _name()
    register_dataset(name, spec["path"], spec.get("images", ""), format=spec["format"],
                     split=spec.get("split", ""), **extra)
    return name


# --------------------------------------------------------------------------- one set, four formats


def test_one_set_in_four_formats_loads_into_identical_records(four_formats):
    datasets = {fmt: get_dataset(name) for fmt, name in four_formats.items()}
    reference = datasets["coco"]
    assert reference.class_names == list(CLASSES)
    assert sum(1 for r in reference.records if not len(r["labels"])) == len(BACKGROUND)
    assert sum(int((r["labels"] == CLASSES.index(RARE) + 1).sum()) for r in reference.records) == 1
    for fmt, dataset in datasets.items():
        assert dataset.format == fmt
        assert dataset.class_names == reference.class_names
        assert dataset.label_to_category_id == reference.label_to_category_id
        assert len(dataset) == len(reference)
        for ours, theirs in zip(dataset.records, reference.records):
            assert (ours["image_id"], ours["width"], ours["height"]) == \
                (theirs["image_id"], theirs["width"], theirs["height"]), fmt
            assert os.path.basename(ours["file_name"]) == os.path.basename(theirs["file_name"])
            assert np.array_equal(ours["labels"], theirs["labels"]), fmt
            assert np.abs(ours["boxes"] - theirs["boxes"]).max(initial=0) <= 1e-3, fmt
            assert np.array_equal(ours["boxes"], theirs["boxes"]), fmt  # exactly, in fact (see yolo._annotation)

    def ignored(dataset):
        return sorted(tuple(a["bbox"]) + (a["image_id"], a["category_id"])
                      for a in dataset.coco.dataset["annotations"] if a["iscrowd"])

    assert ignored(datasets["voc"]) == ignored(reference) and len(ignored(reference)) == 1  # VOC difficult = crowd


def test_the_start_up_table_counts_background_images(four_formats, caplog):
    cfg = load_cfg(None, ["DEVICE", "cpu", "MODEL.NUM_CLASSES", len(CLASSES), "TRAIN.DATASETS",
                          f"('{four_formats['yolo']}',)", "DATA.FILTER_EMPTY", False, "DATA.NUM_WORKERS", 0])
    with caplog.at_level(logging.INFO, logger="pet.data.build"):
        loader = build_train_loader(cfg)
    table = next(r.getMessage() for r in caplog.records if "Distribution of instances" in r.getMessage())
    assert f"background images (no usable box): {len(BACKGROUND)} of 12" in table and RARE in table
    assert len(loader.dataset) == 12  # DATA.FILTER_EMPTY False keeps them for training


def test_a_label_file_edited_after_loading_is_read_again_by_the_next_load(tmp_path):
    """The dataset cache notices an edited or a created label file (the VOC root's and the data.yaml's own
    times do not change when one is edited in place), so a notebook or a test session never trains on
    stale labels; an untouched set is not read again."""
    specs = write_all_formats(tmp_path)
    yolo, voc = _register(specs["yolo"]), _register(specs["voc"])
    labels, xml = tmp_path / "yolo" / "labels" / "train", tmp_path / "voc" / "Annotations" / "img_001.xml"
    before = {name: get_dataset(name) for name in (yolo, voc)}
    assert get_dataset(yolo) is before[yolo] and get_dataset(voc) is before[voc]
    assert not (labels / f"{BACKGROUND[1]}.txt").exists()

    _append(labels / "img_001.txt", "0 0.5 0.5 0.25 0.25\n")
    (labels / f"{BACKGROUND[1]}.txt").write_text("1 0.5 0.5 0.5 0.5\n")  # the background image gets a box
    _replace(xml, "<name>", "<name>new_")  # its first object's class is renamed new_<class>
    after = {name: get_dataset(name) for name in (yolo, voc)}
    background = int(BACKGROUND[1][-3:]) - 1  # img_008 is the 8th image
    assert len(after[yolo].records[0]["boxes"]) == len(before[yolo].records[0]["boxes"]) + 1
    assert len(before[yolo].records[background]["boxes"]) == 0 and len(after[yolo].records[background]["boxes"]) == 1
    assert [n for n in after[voc].class_names if n.startswith("new_")] and before[voc].class_names == list(CLASSES)


def test_an_image_added_to_a_yolo_split_folder_or_list_file_is_read_by_the_next_load(tmp_path):
    """A new image (with its label) changes neither the data.yaml nor any label file read before: the cache
    notices it by the split folder's or the image list file's time."""
    root = tmp_path / "yolo"
    write_all_formats(tmp_path)
    (root / "list.yaml").write_text((root / "data.yaml").read_text().replace("train: images/train", "train: a.txt"))
    (root / "a.txt").write_text("images/train/img_001.jpg\n")
    by_folder, by_list = (_register({"format": "yolo", "path": str(root / y), "split": "train"})
                          for y in ("data.yaml", "list.yaml"))
    before = {name: get_dataset(name) for name in (by_folder, by_list)}

    shutil.copy(root / "images" / "train" / "img_001.jpg", root / "images" / "train" / "new.jpg")
    (root / "labels" / "train" / "new.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    _append(root / "a.txt", "images/train/new.jpg\n")
    for name in (by_folder, by_list):
        assert len(get_dataset(name)) == len(before[name]) + 1, name
        assert get_dataset(name).records[-1]["file_name"].endswith("new.jpg")


def _tiny_run_cfg(tmp_path, name: str):
    return load_cfg(DEMO_CFG, [
        "CKPT", str(tmp_path / name), "DEVICE", "cpu", "MODEL.NUM_CLASSES", len(CLASSES),
        "TRAIN.DATASETS", f"('{name}',)", "TEST.DATASETS", f"('{name}',)", "HOOKS.EVAL.PERIOD", 0,
        "SOLVER.MAX_ITER", 30, "SOLVER.IMS_PER_BATCH", 2, "SOLVER.WARMUP_ITERS", 5, "SOLVER.AMP.ENABLED", False,
        "DATA.NUM_WORKERS", 0, "DATA.FILTER_EMPTY", False, "INPUT.SIZE_DIVISIBILITY", 32, "DISPLAY_ITER", 30,
        "HOOKS.CHECKPOINT.PERIOD", 0, "TRAIN.AUTO_RESUME", False, "MODEL.FLOPS_INPUT_SIZE", "(64, 64)",
        # A slimmer demo model: the test is about the data, four runs of it must stay cheap.
        "MODEL.FPN.OUT_CHANNELS", 32, "MODEL.RPN.PRE_NMS_TOPK_TRAIN", 200, "MODEL.RPN.POST_NMS_TOPK_TRAIN", 100,
        "MODEL.ROI_HEADS.BATCH_SIZE_PER_IMAGE", 32, "MODEL.ROI_BOX_HEAD.MLP_DIM", 64,
    ])


@pytest.mark.slow
def test_thirty_iterations_from_each_format_give_identical_weights(four_formats, tmp_path):
    weights, initial = {}, None
    for fmt, name in four_formats.items():
        cfg = _tiny_run_cfg(tmp_path, name)
        seed_everything(cfg.SEED)
        trainer = Trainer(cfg, default_hooks=False)
        initial = initial or {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        trainer.train()
        assert trainer.iter == 30
        weights[fmt] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    reference = weights["coco"]
    assert not all(torch.equal(reference[k], initial[k]) for k in reference)  # it did train
    for fmt, state in weights.items():
        assert state.keys() == reference.keys()
        assert all(torch.equal(state[k], reference[k]) for k in reference), fmt


# --------------------------------------------------------------------------- outside conventions


def _jpeg(path, width: int, height: int, value: int = 90) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    cv2.imwrite(str(path), np.full((height, width, 3), value, np.uint8))


# An annotation as the VOC devkit writes it (VOC2007's 000005.xml trimmed), with float coordinates, a person with
# parts (whose <name> and <bndbox> are not objects) and a difficult object.
_DEVKIT_XML = """<annotation>
	<folder>VOC2007</folder>
	<filename>000005.jpg</filename>
	<source>
		<database>The VOC2007 Database</database>
		<annotation>PASCAL VOC2007</annotation>
		<image>flickr</image>
	</source>
	<size>
		<width>60</width>
		<height>45</height>
		<depth>3</depth>
	</size>
	<segmented>0</segmented>
	<object>
		<name>chair</name>
		<pose>Rear</pose>
		<truncated>0</truncated>
		<difficult>0</difficult>
		<bndbox>
			<xmin>26.5</xmin>
			<ymin>21</ymin>
			<xmax>32.25</xmax>
			<ymax>34</ymax>
		</bndbox>
	</object>
	<object>
		<name>person</name>
		<pose>Unspecified</pose>
		<truncated>1</truncated>
		<difficult>0</difficult>
		<bndbox>
			<xmin>1</xmin>
			<ymin>1</ymin>
			<xmax>20</xmax>
			<ymax>45</ymax>
		</bndbox>
		<part>
			<name>head</name>
			<bndbox><xmin>5</xmin><ymin>2</ymin><xmax>12</xmax><ymax>9</ymax></bndbox>
		</part>
	</object>
	<object>
		<name>chair</name>
		<pose>Left</pose>
		<truncated>1</truncated>
		<difficult>1</difficult>
		<bndbox>
			<xmin>40</xmin>
			<ymin>30</ymin>
			<xmax>60</xmax>
			<ymax>45</ymax>
		</bndbox>
	</object>
</annotation>
"""


def _devkit_root(tmp_path):
    root = tmp_path / "VOCdevkit" / "VOC2007"
    for folder in ("Annotations", "ImageSets/Main", "JPEGImages"):
        (root / folder).mkdir(parents=True)
    (root / "Annotations" / "000005.xml").write_text(_DEVKIT_XML)
    _jpeg(root / "JPEGImages" / "000005.jpg", 60, 45)
    (root / "ImageSets" / "Main" / "test.txt").write_text("000005\n")
    (root / "ImageSets" / "Main" / "chair_test.txt").write_text("000005  1\n")  # a class file: not a split
    return root


def test_a_devkit_voc_annotation_reads_one_based_float_coordinates_and_difficult_objects(tmp_path):
    root = _devkit_root(tmp_path)
    dataset = get_dataset(_register({"format": "voc", "path": str(root), "split": "test"}))
    assert dataset.class_names == ["chair", "person"]  # sorted, parts left out
    (record,) = dataset.records
    assert (record["width"], record["height"]) == (60, 45)
    assert record["file_name"] == str(root / "JPEGImages" / "000005.jpg")
    # [xmin - 1, ymin - 1, xmax, ymax]: the 1-based pixels 1..20 are 20 pixels wide, starting at 0
    assert record["boxes"].tolist() == [[25.5, 20.0, 32.25, 34.0], [0.0, 0.0, 20.0, 45.0]]
    assert record["labels"].tolist() == [1, 2]
    (crowd,) = [a for a in dataset.coco.dataset["annotations"] if a["iscrowd"]]
    assert crowd["bbox"] == [39.0, 29.0, 21.0, 16.0] and crowd["category_id"] == 1  # difficult: ignored, not trained


def test_a_voc_split_file_and_a_yolo_image_list_saved_with_a_bom_read_as_without(tmp_path):
    """Notepad and other Windows tools start a UTF-8 file with a byte-order mark (and end lines with CRLF): the
    first image id or path must not carry it ('\\ufeff000005' has no annotation file)."""
    root = _devkit_root(tmp_path)
    (root / "ImageSets" / "Main" / "test.txt").write_bytes("000005\r\n".encode("utf-8-sig"))
    assert len(get_dataset(_register({"format": "voc", "path": str(root), "split": "test"}))) == 1
    _jpeg(tmp_path / "y" / "images" / "a.jpg", 60, 40)
    _write(tmp_path / "y" / "train.txt", "./images/a.jpg\r\n".encode("utf-8-sig"))
    (tmp_path / "y" / "data.yaml").write_text("train: train.txt\nnames: [dog]\n")
    read = read_yolo(str(tmp_path / "y" / "data.yaml"), "train")
    assert [i["file_name"] for i in read.coco["images"]] == [os.path.join("images", "a.jpg")]


def test_keras_retinanet_csv_without_header_and_with_empty_images(tmp_path):
    _jpeg(tmp_path / "imgs" / "a.jpg", 50, 40)
    _jpeg(tmp_path / "imgs" / "sub" / "b.png", 30, 20)
    (tmp_path / "annotations.csv").write_text(
        "imgs/a.jpg,10,12,30,40,cow\nimgs/a.jpg,0,1,5.5,6,sheep\nimgs/sub/b.png,,,,,\n")
    read = read_csv(str(tmp_path / "annotations.csv"), classes=["sheep", "cow"])  # keras' class file order
    assert read.image_root == str(tmp_path)
    assert [(i["file_name"], i["width"], i["height"]) for i in read.coco["images"]] == [
        ("imgs/a.jpg", 50, 40), (os.path.join("imgs", "sub", "b.png"), 30, 20)]
    assert [(a["bbox"], a["category_id"]) for a in read.coco["annotations"]] == [
        ([10.0, 12.0, 20.0, 28.0], 2), ([0.0, 1.0, 5.5, 5.0], 1)]
    assert read.coco["categories"] == [{"id": 1, "name": "sheep"}, {"id": 2, "name": "cow"}]


def test_deepforest_csv_with_header_zero_box_images_and_renamed_columns(tmp_path, caplog):
    for name in ("t1.tif", "t2.tif"):
        _jpeg(tmp_path / name, 40, 40)
    (tmp_path / "trees.csv").write_text(
        "image_path,xmin,ymin,xmax,ymax,label\nt1.tif,1,2,11,12,Tree\nt2.tif,0,0,0,0,Snag\n")
    with caplog.at_level(logging.WARNING):
        dataset = get_dataset(_register({"format": "csv", "path": str(tmp_path / "trees.csv")}))
    assert dataset.class_names == ["Tree"] and [len(r["labels"]) for r in dataset.records] == [1, 0]
    assert not caplog.records  # the zero box marks an empty image: it is no box to drop, its label no class
    # Another tool's header (TensorFlow's CSV): columns named per role, extra columns ignored.
    (tmp_path / "tf.csv").write_text("filename,width,height,class,xmin,ymin,xmax,ymax\nt1.tif,40,40,Tree,1,2,11,12\n")
    read = read_csv(str(tmp_path / "tf.csv"), columns={"image_path": "filename", "label": "class"})
    assert [a["bbox"] for a in read.coco["annotations"]] == [[1.0, 2.0, 10.0, 10.0]]


def test_ultralytics_layout_list_files_dict_names_polygons_and_missing_labels(tmp_path):
    """A data.yaml beside, not in, the dataset root; a split as a list file with ./ paths and one as a folder;
    label files found by the last /images/ -> /labels/ (a folder called images higher up stays)."""
    root = tmp_path / "images" / "mini"  # an outer 'images' folder: only the last one is replaced
    for split, stem in (("train", "a"), ("train", "b"), ("val", "c")):
        _jpeg(root / "images" / split / f"{stem}.jpg", 80, 40)
    (root / "labels" / "train").mkdir(parents=True)
    (root / "labels" / "train" / "a.txt").write_text("1 0.5 0.5 0.25 0.5\n\n0 0.1 0.1 0.3 0.1 0.2 0.4\n")
    (root / "train.txt").write_text("./images/train/b.jpg\n./images/train/a.jpg\n")  # b has no label file
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "mini.yaml").write_text(
        "path: ../images/mini\ntrain: train.txt\nval: [images/val]\nnames:\n  0: person\n  1: bus\n")
    read = read_yolo(str(tmp_path / "cfg" / "mini.yaml"), "train")
    assert read.image_root == str(root)
    assert [i["file_name"] for i in read.coco["images"]] == [os.path.join("images", "train", s) for s in
                                                              ("a.jpg", "b.jpg")]  # sorted, as Ultralytics
    box, polygon = read.coco["annotations"]
    assert box["category_id"] == 2 and box["bbox"] == [30.0, 10.0, 20.0, 20.0]  # bus: index 1 -> id 2
    assert polygon["category_id"] == 1 and polygon["bbox"] == [8.0, 4.0, 16.0, 12.0]
    assert polygon["segmentation"] == [[8.0, 4.0, 24.0, 4.0, 16.0, 16.0]]
    assert read.coco["categories"] == [{"id": 1, "name": "person"}, {"id": 2, "name": "bus"}]
    assert len(read_yolo(str(tmp_path / "cfg" / "mini.yaml"), "val").coco["images"]) == 1


def test_a_roboflow_export_with_parent_relative_splits_reads_its_own_folders(tmp_path):
    """Roboflow writes `train: ../train/images` in a data.yaml that sits beside train/: Ultralytics, finding no
    such folder above, drops the ../ and reads the one beside the yaml."""
    for split in ("train", "valid"):
        _jpeg(tmp_path / "export" / split / "images" / "a.jpg", 100, 50)
        _write(tmp_path / "export" / split / "labels" / "a.txt", "0 0.5 0.5 0.2 0.2\n")
    (tmp_path / "export" / "data.yaml").write_text("train: ../train/images\nval: ../valid/images\nnc: 1\n"
                                                   "names: ['cone']\n")
    for split, folder in (("train", "train"), ("val", "valid")):
        read = read_yolo(str(tmp_path / "export" / "data.yaml"), split)
        assert read.image_root == str(tmp_path / "export")
        assert [i["file_name"] for i in read.coco["images"]] == [os.path.join(folder, "images", "a.jpg")]
        assert [a["bbox"] for a in read.coco["annotations"]] == [[40.0, 20.0, 20.0, 10.0]]


def test_data_yaml_names_as_ultralytics_reads_them_quoted_indices_nc_alone_and_nc_disagreeing(tmp_path):
    """Ultralytics reads `names` keyed '0', '1' as 0, 1, names the classes of an nc-only yaml class_0, class_1,
    and refuses a yaml whose nc is not the number of names."""
    _jpeg(tmp_path / "images" / "a.jpg", 40, 20)
    _write(tmp_path / "labels" / "a.txt", "1 0.5 0.5 0.5 0.5\n")
    data_yaml = tmp_path / "data.yaml"
    for classes, expected in (("names:\n  '0': person\n  '1': bus\n", ["person", "bus"]),
                              ("nc: 2\n", ["class_0", "class_1"])):
        data_yaml.write_text(f"train: images\n{classes}")
        read = read_yolo(str(data_yaml), "train")
        assert [c["name"] for c in read.coco["categories"]] == expected
        assert [a["category_id"] for a in read.coco["annotations"]] == [2]
    data_yaml.write_text("train: images\nnc: 3\nnames: [person, bus]\n")
    with pytest.raises(DataError, match=rf"^{re.escape(str(data_yaml))}: 'nc' is 3 but 'names' lists 2 classes"):
        read_yolo(str(data_yaml), "train")


def test_a_pose_set_reads_the_box_of_each_line_and_stops_at_a_line_unlike_its_kpt_shape(tmp_path):
    """With kpt_shape [17, 3] a line is the box and 51 keypoint values; 17 keypoints written as x y (39 values)
    are not a polygon (the yaml says pose) but a mistake naming its file:line."""
    _jpeg(tmp_path / "images" / "a.jpg", 100, 100)
    (tmp_path / "data.yaml").write_text("train: images\nkpt_shape: [17, 3]\nnames: [person]\n")
    _write(tmp_path / "labels" / "a.txt", f"0 0.5 0.5 0.2 0.2 {' '.join(['0.9 0.9 2'] * 17)}\n0 0.2 0.2 0.1 0.1\n")
    read = read_yolo(str(tmp_path / "data.yaml"), "train")
    assert [a["bbox"] for a in read.coco["annotations"]] == [[40.0, 40.0, 20.0, 20.0], [15.0, 15.0, 10.0, 10.0]]
    _append(tmp_path / "labels" / "a.txt", f"0 0.5 0.5 0.2 0.2 {' '.join(['0.9 0.9'] * 17)}\n")
    with pytest.raises(DataError, match=r"a.txt:3: 39 values; with kpt_shape \[17, 3\] in the data.yaml a label "
                                        r"line is 'class cx cy w h' and 51 keypoint values \(56 in all\)"):
        read_yolo(str(tmp_path / "data.yaml"), "train")


def test_a_yolo_label_line_repeated_in_one_file_is_read_once_with_one_warning(tmp_path, caplog):
    """Ultralytics removes duplicate label rows: kept, the repeat is an object no detection can match twice."""
    for stem in ("a", "b"):
        _jpeg(tmp_path / "images" / f"{stem}.jpg", 100, 100)
    _write(tmp_path / "labels" / "a.txt", "0 0.5 0.5 0.2 0.2\n0 0.1 0.1 0.1 0.1\n0 0.5 0.5 0.2 0.2\n"
                                          "0 0.5 0.5 0.2 0.2\n")
    _write(tmp_path / "labels" / "b.txt", "0 0.5 0.5 0.2 0.2\n1 0.5 0.5 0.2 0.2\n")  # another class: no repeat
    (tmp_path / "data.yaml").write_text("train: images\nnames: [a, b]\n")
    with caplog.at_level(logging.WARNING, logger="pet.data.formats.yolo"):
        read = read_yolo(str(tmp_path / "data.yaml"), "train")
    assert [(a["image_id"], a["bbox"]) for a in read.coco["annotations"]] == [
        (1, [40.0, 40.0, 20.0, 20.0]), (1, [5.0, 5.0, 10.0, 10.0]), (2, [40.0, 40.0, 20.0, 20.0]),
        (2, [40.0, 40.0, 20.0, 20.0])]
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith(f"{tmp_path / 'labels' / 'a.txt'}: removed 2 duplicate label lines")


def test_yolo_labels_written_from_pixel_boxes_read_back_as_exactly_those_pixels(tmp_path):
    """Normalising and back leaves float noise (0 becomes 2e-9): Pet rounds it away at 1e-6 px, far below the
    labels' precision, so a box reads back to the same float32 a COCO file gives."""
    width, height = 97, 61
    _jpeg(tmp_path / "images" / "train" / "a.jpg", width, height)
    boxes = [(x, y, w, h) for x in (0, 3, 50) for y in (0, 7) for w in range(1, 40, 3) for h in (1, 5, 23)
             if x + w <= width and y + h <= height]
    lines = [f"0 {(x + w / 2) / width:.10g} {(y + h / 2) / height:.10g} {w / width:.10g} {h / height:.10g}"
             for x, y, w, h in boxes]
    _write(tmp_path / "labels" / "train" / "a.txt", "\n".join(lines) + "\n")
    (tmp_path / "data.yaml").write_text("train: images/train\nnames: [thing]\n")
    read = read_yolo(str(tmp_path / "data.yaml"), "train")
    assert [tuple(a["bbox"]) for a in read.coco["annotations"]] == [tuple(map(float, b)) for b in boxes]


def test_a_set_as_ultralytics_convert_coco_writes_it_scores_the_coco_original(tmp_path):
    """convert_coco's output (labels/<json name>/*.txt, '%g' values, crowd boxes left out) moved into
    Ultralytics' layout: the same records within 1e-3 px and the same AP for one set of detections."""
    from pet.evaluation.coco import evaluate_results_file

    specs = write_all_formats(tmp_path)
    coco_name = _register(specs["coco"])
    coco = get_dataset(coco_name)
    root = tmp_path / "converted"
    for image in coco.coco.dataset["images"]:
        anns = [a for a in coco.coco.imgToAnns[image["id"]] if not a["iscrowd"]]
        w, h = image["width"], image["height"]
        rows = [(a["category_id"] - 1, (a["bbox"][0] + a["bbox"][2] / 2) / w, (a["bbox"][1] + a["bbox"][3] / 2) / h,
                 a["bbox"][2] / w, a["bbox"][3] / h) for a in anns]  # convert_coco(cls91to80=False)
        _write(root / "labels" / "ann" / f"{image['file_name'][:-4]}.txt",
               "".join(("%g " * 5).rstrip() % row + "\n" for row in rows))
        _write(root / "images" / "ann" / image["file_name"], (tmp_path / "coco" / "images" /
                                                              image["file_name"]).read_bytes())
    names = "".join(f"  - {n}\n" for n in CLASSES)
    (root / "data.yaml").write_text(f"path: .\ntrain: images/ann\nval: images/ann\nnames:\n{names}")
    yolo = get_dataset(_register({"format": "yolo", "path": str(root / "data.yaml"), "split": "val"}))
    for ours, theirs in zip(yolo.records, coco.records):
        assert np.abs(ours["boxes"] - theirs["boxes"]).max(initial=0) <= 1e-3
        assert np.array_equal(ours["labels"], theirs["labels"])
    detections = [{"image_id": r["image_id"], "category_id": int(label), "score": 0.9 - 0.01 * k,
                   "bbox": [float(x0) + 0.5, float(y0) - 0.5, float(x1 - x0), float(y1 - y0)]}
                  for r in coco.records for k, ((x0, y0, x1, y1), label) in enumerate(zip(r["boxes"], r["labels"]))]
    results = tmp_path / "bbox.json"
    results.write_text(json.dumps(detections))
    ap_coco = evaluate_results_file(coco, str(results))["bbox"]
    ap_yolo = evaluate_results_file(yolo, str(results))["bbox"]
    assert abs(ap_coco["AP"] - ap_yolo["AP"]) < 0.1 and ap_coco["AP"] > 50


def _write(path, content) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb" if isinstance(content, bytes) else "w") as f:
        f.write(content)


# --------------------------------------------------------------------------- image sizes


@pytest.mark.parametrize("extension", ["jpg", "png", "webp", "tif"])
def test_image_sizes_come_out_as_opencv_decodes_an_exif_rotated_image(tmp_path, extension):
    """A TIFF carries the orientation among its own tags, and recent Pillows report its size already turned."""
    from PIL import Image

    pixels = np.zeros((20, 40, 3), np.uint8)  # stored 40 wide, 20 high; EXIF 6 says: turn a quarter
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / f"rotated.{extension}"
    Image.fromarray(pixels).save(path, **({"tiffinfo": {0x0112: 6}} if extension == "tif" else
                                          {"exif": exif.tobytes()}))
    decoded = cv2.imdecode(np.fromfile(path, np.uint8), cv2.IMREAD_COLOR)
    assert decoded.shape[:2] == (40, 20)  # opencv applies the orientation
    assert image_size(str(path), "here") == (20, 40)


def test_a_csv_set_with_an_exif_rotated_jpeg_trains_without_a_size_mismatch(tmp_path):
    from PIL import Image

    exif = Image.Exif()
    exif[0x0112] = 8
    Image.fromarray(np.full((30, 50, 3), 100, np.uint8)).save(tmp_path / "r.jpg", exif=exif.tobytes())
    (tmp_path / "boxes.csv").write_text("r.jpg,2,3,12,40,thing\n")  # a box only the rotated 30x50 frame holds
    name = _register({"format": "csv", "path": str(tmp_path / "boxes.csv")})
    assert (get_dataset(name).records[0]["width"], get_dataset(name).records[0]["height"]) == (30, 50)
    cfg = load_cfg(None, ["DEVICE", "cpu", "MODEL.NUM_CLASSES", 1, "TRAIN.DATASETS", f"('{name}',)",
                          "SOLVER.IMS_PER_BATCH", 1, "DATA.NUM_WORKERS", 0, "INPUT.MIN_SIZE_TRAIN", "(0,)"])
    images, targets = next(iter(build_train_loader(cfg)))
    assert targets[0]["orig_size"] == (50, 30) and targets[0]["boxes"].shape == (1, 4)


def test_a_labelimg_voc_set_of_exif_rotated_photos_says_to_drop_the_tag_not_to_swap_the_size(tmp_path):
    """LabelImg shows a JPEG as stored (ignoring its EXIF orientation), so its XML has the stored size and boxes
    in the stored pixels; opencv decodes the photo turned. Swapping the XML's size, as a plain size mismatch
    is told to, would misplace the box: the message says to drop the tag, and once dropped the box is right."""
    from PIL import Image

    root = tmp_path / "labelimg"
    for folder in ("Annotations", "JPEGImages", "ImageSets/Main"):
        (root / folder).mkdir(parents=True)
    pixels = np.zeros((30, 50, 3), np.uint8)  # stored 50 wide, 30 high; EXIF 6 turns it to 30x50
    pixels[2:12, 30:48] = 200  # the object, as LabelImg shows and boxes it
    exif = Image.Exif()
    exif[0x0112] = 6
    photo = root / "JPEGImages" / "IMG_0001.jpg"
    Image.fromarray(pixels).save(photo, exif=exif.tobytes(), quality=100)
    (root / "Annotations" / "IMG_0001.xml").write_text(  # as LabelImg's PascalVocWriter writes it
        f"<annotation><folder>JPEGImages</folder><filename>IMG_0001.jpg</filename><path>{photo}</path><source>"
        "<database>Unknown</database></source><size><width>50</width><height>30</height><depth>3</depth></size>"
        "<segmented>0</segmented><object><name>thing</name><pose>Unspecified</pose><truncated>0</truncated>"
        "<difficult>0</difficult><bndbox><xmin>31</xmin><ymin>3</ymin><xmax>48</xmax><ymax>12</ymax></bndbox>"
        "</object></annotation>")
    (root / "ImageSets" / "Main" / "train.txt").write_text("IMG_0001\n")
    cfg = load_cfg(None, ["DEVICE", "cpu", "MODEL.NUM_CLASSES", 1, "TRAIN.DATASETS",
                          f"('{_register({'format': 'voc', 'path': str(root), 'split': 'train'})}',)",
                          "SOLVER.IMS_PER_BATCH", 1, "DATA.NUM_WORKERS", 0, "INPUT.MIN_SIZE_TRAIN", "(0,)",
                          "INPUT.FLIP_PROB", 0.0])
    with pytest.raises(DataError) as error:
        next(iter(build_train_loader(cfg)))
    assert "decodes to 30x50 pixels, turned a quarter by its EXIF orientation 6" in str(error.value)
    assert f"exiftool -Orientation=1 -n {photo}" in str(error.value) and "Fix its width" not in str(error.value)

    Image.fromarray(pixels).save(photo, quality=100)  # the advice followed: no tag, the same stored pixels
    images, targets = next(iter(build_train_loader(cfg)))
    assert targets[0]["orig_size"] == (30, 50) and targets[0]["boxes"].tolist() == [[30, 2, 48, 12]]
    x0, y0, x1, y1 = (int(v) for v in targets[0]["boxes"][0])
    assert images[0][:, y0:y1, x0:x1].float().mean() > 150  # the box holds the object


# --------------------------------------------------------------------------- class lists


def test_classes_fix_the_order_and_ids_of_every_format(tmp_path):
    specs = write_all_formats(tmp_path)
    order = ["triangle", "star", "rectangle", "circle"]
    for fmt, spec in specs.items():
        dataset = get_dataset(_register(spec, classes=order))
        assert dataset.class_names == order, fmt
        star = [r for r in dataset.records if (r["labels"] == 2).any()]
        assert len(star) == 1, fmt  # 'star' is label 2 now, in one image


def test_a_coco_category_outside_classes_is_dropped_when_unused_and_an_error_when_used(tmp_path):
    specs = write_all_formats(tmp_path)
    data = json.loads(open(specs["coco"]["path"]).read())
    data["categories"].append({"id": 0, "name": "shapes-dataset"})  # Roboflow's unused supercategory entry
    open(specs["coco"]["path"], "w").write(json.dumps(data))
    dataset = get_dataset(_register(specs["coco"], classes=list(CLASSES)))
    assert dataset.class_names == list(CLASSES)
    with pytest.raises(DataError, match=r"ann.json .*: class 'star' \(annotation \d+\) is not in the dataset's "
                                        r"`classes` list \['circle', 'rectangle', 'triangle'\]"):
        get_dataset(_register(specs["coco"], classes=["circle", "rectangle", "triangle"]))


def _csv(path, rows: str) -> str:
    path.write_text(rows)
    return str(path)


def test_train_and_test_sets_with_different_classes_stop_before_training_naming_the_class(tmp_path):
    for stem in ("a", "b"):
        _jpeg(tmp_path / f"{stem}.jpg", 40, 40)
    train = _register({"format": "csv", "path": _csv(tmp_path / "train.csv", "a.jpg,1,1,9,9,cat\na.jpg,5,5,20,20,dog\n"
                                                                              "a.jpg,2,2,30,30,emu\n")})
    val = _register({"format": "csv", "path": _csv(tmp_path / "val.csv", "b.jpg,1,1,9,9,cat\nb.jpg,3,3,9,9,emu\n")})
    cfg = load_cfg(None, ["DEVICE", "cpu", "MODEL.NUM_CLASSES", 3, "TRAIN.DATASETS", f"('{train}',)",
                          "TEST.DATASETS", f"('{val}',)", "HOOKS.EVAL.PERIOD", 10, "SOLVER.IMS_PER_BATCH", 1,
                          "DATA.NUM_WORKERS", 0])
    with pytest.raises(DataError, match=rf"'{train}' \(.*train.csv\) and '{val}' \(.*val.csv\) have different "
                                        rf"categories: classes \['dog'\] only in '{train}'.*same `classes: \[...\]`"):
        build_train_loader(cfg)
    cfg.defrost()
    cfg.HOOKS.EVAL.PERIOD = 0  # not validating: only the training sets count
    build_train_loader(cfg)
    # With the run's list given to both, the ids agree and the class missing from val is fine.
    fixed = [_register({"format": "csv", "path": str(tmp_path / f"{s}.csv")}, classes=["cat", "dog", "emu"])
             for s in ("train", "val")]
    cfg.TRAIN.DATASETS, cfg.TEST.DATASETS, cfg.HOOKS.EVAL.PERIOD = (fixed[0],), (fixed[1],), 10
    build_train_loader(cfg)


# --------------------------------------------------------------------------- bad data: one line, nothing written


def _append(path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def _replace(path, old: str, new: str, count: int = 1) -> None:
    content = open(path).read()
    assert old in content, (path, old)
    open(path, "w").write(content.replace(old, new, count))


def _sub(path, pattern: str, new: str) -> None:
    content = open(path).read()
    assert re.search(pattern, content), (path, pattern)
    open(path, "w").write(re.sub(pattern, new, content, count=1))


# case: (format, change to the written set, expected message, extra entry keys, extra opts)
_BAD = {
    "yolo: no data.yaml": ("yolo", lambda r: os.remove(r / "yolo" / "data.yaml"),
                           r"YOLO data file not found: .*data.yaml. Point `path`", {}, []),
    "yolo: yaml syntax": ("yolo", lambda r: _append(r / "yolo" / "data.yaml", "train: [unclosed\n"),
                          r"data.yaml:\d+: not valid YAML", {}, []),
    "yolo: a class named twice": ("yolo", lambda r: _replace(r / "yolo" / "data.yaml", "3: triangle", "3: star"),
                                  r"The class list of .*data.yaml repeats \['star'\]", {}, []),
    "yolo: nc is not the number of names": ("yolo", lambda r: _append(r / "yolo" / "data.yaml", "nc: 5\n"),
                                            r"data.yaml: 'nc' is 5 but 'names' lists 4 classes", {}, []),
    "yolo: no such split": ("yolo", None, r"data.yaml has no 'test' split \(it has \['train', 'val'\]\)",
                            {"split": "test"}, []),
    "yolo: class index out of range": ("yolo", lambda r: _append(r / "yolo/labels/train/img_001.txt",
                                                                 "4 0.5 0.5 0.1 0.1\n"),
                                       r"img_001.txt:2: class index 4 is not one of the 4 classes", {}, []),
    "yolo: not normalised": ("yolo", lambda r: _append(r / "yolo/labels/train/img_001.txt", "0 12 14 5 6\n"),
                             r"img_001.txt:2: coordinates .* are not normalised to \[0, 1\]", {}, []),
    "yolo: class nan": ("yolo", lambda r: _append(r / "yolo/labels/train/img_001.txt", "nan 0.5 0.5 0.1 0.1\n"),
                        r"img_001.txt:2: 'nan 0.5 0.5 0.1 0.1' is not numbers", {}, []),
    "yolo: wrong number of values": ("yolo", lambda r: _append(r / "yolo/labels/train/img_001.txt", "0 .5 .5 .1\n"),
                                     r"img_001.txt:2: 4 values; a YOLO label line is", {}, []),
    "yolo: box outside, strict": ("yolo", lambda r: _append(r / "yolo/labels/train/img_001.txt",
                                                            "0 0.95 0.5 0.3 0.2\n"),
                                  r"img_001.txt:2: box \(x1, y1, x2, y2\) = .* lies outside the \d+x\d+ image. "
                                  r"Fix it, or set DATA.STRICT False", {}, ["DATA.STRICT", True]),
    "voc: no such split": ("voc", None, r"VOC split file not found: .*val.txt. Splits there: \['train'\]",
                           {"split": "val"}, []),
    "voc: no Annotations folder": ("voc", lambda r: shutil.rmtree(r / "voc/Annotations"),
                                   r"VOC root .*voc has no Annotations/ folder .* Is `path` the VOC root", {}, []),
    "voc: xml syntax": ("voc", lambda r: _replace(r / "voc/Annotations/img_002.xml", "</annotation>", ""),
                        r"img_002.xml:\d+: not valid XML", {}, []),
    "voc: no bndbox": ("voc", lambda r: _replace(r / "voc/Annotations/img_002.xml", "bndbox>", "box>", count=2),
                       r"img_002.xml, <object> #1 \('\w+'\): no <bndbox>", {}, []),
    "voc: not a number": ("voc", lambda r: _replace(r / "voc/Annotations/img_002.xml", "<xmin>", "<xmin>x"),
                          r"img_002.xml, <object> #1 \('\w+'\): <bndbox/xmin> is 'x\d+', not a number", {}, []),
    "voc: coordinate inf": ("voc", lambda r: _sub(r / "voc/Annotations/img_002.xml", "<ymax>[^<]*", "<ymax>inf"),
                            r"img_002.xml, <object> #1 \('\w+'\): <bndbox/ymax> is 'inf', not a number", {}, []),
    "voc: missing xml": ("voc", lambda r: os.remove(r / "voc/Annotations/img_002.xml"),
                         r"train.txt:2: image id 'img_002' has no annotation file", {}, []),
    "voc: class outside classes": ("voc", None, r"img_005.xml, <object> #1 \('star'\): class 'star' is not in the "
                                   r"dataset's `classes` list", {"classes": ["circle", "rectangle", "triangle"]}, []),
    "voc: box outside, strict": ("voc", lambda r: _replace(r / "voc/Annotations/img_002.xml", "<xmin>", "<xmin>-2"),
                                 r"img_002.xml, <object> #1 \('\w+'\): box .* lies outside", {},
                                 ["DATA.STRICT", True]),
    "csv: no file": ("csv", lambda r: os.remove(r / "csv/boxes.csv"), r"CSV file not found: .*boxes.csv", {}, []),
    "csv: wrong column count": ("csv", lambda r: _append(r / "csv/boxes.csv", "img_001.jpg,1,2,3\n"),
                                r"boxes.csv:\d+: 4 columns where 6 are expected", {}, []),
    "csv: box not numbers": ("csv", lambda r: _append(r / "csv/boxes.csv", "img_001.jpg,a,b,c,d,circle\n"),
                             r"boxes.csv:\d+: the box \['a', 'b', 'c', 'd'\] is not four numbers", {}, []),
    "csv: coordinate nan": ("csv", lambda r: _append(r / "csv/boxes.csv", "img_001.jpg,nan,2,3,4,circle\n"),
                            r"boxes.csv:\d+: the box \['nan', '2', '3', '4'\] is not four numbers", {}, []),
    "csv: header lacks a column": ("csv", lambda r: _replace(r / "csv/boxes.csv", "image_path,", "file,"),
                                   r"boxes.csv:1: the header .* lacks the columns \['image_path'\]", {}, []),
    "csv: box without label": ("csv", lambda r: _append(r / "csv/boxes.csv", "img_001.jpg,1,2,3,4,\n"),
                               r"boxes.csv:\d+: a box without a label", {}, []),
    "csv: label without a box": ("csv", lambda r: _append(r / "csv/boxes.csv", "img_001.jpg,,,,,circle\n"),
                                 r"boxes.csv:\d+: label 'circle' without a box. Give the box", {}, []),
    "csv: missing image": ("csv", lambda r: _append(r / "csv/boxes.csv", "nope.jpg,1,2,3,4,circle\n"),
                           r"boxes.csv:\d+: image .*nope.jpg does not exist", {}, []),
    "csv: class outside classes": ("csv", None, r"boxes.csv:\d+: class 'star' is not in the dataset's `classes`",
                                   {"classes": ["circle", "rectangle", "triangle"]}, []),
    "csv: box outside, strict": ("csv", lambda r: _append(r / "csv/boxes.csv", "img_001.jpg,30,2,90,9,circle\n"),
                                 r"boxes.csv:\d+: box .* lies outside", {}, ["DATA.STRICT", True]),
}


def _snapshot(root) -> dict[str, float]:
    return {os.path.join(d, f): os.path.getmtime(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files}


@pytest.mark.parametrize("case", list(_BAD))
def test_bad_labels_stop_train_net_with_one_line_naming_the_place_and_write_nothing(tmp_path, monkeypatch, capsys,
                                                                                     case):
    fmt, change, expected, extra, opts = _BAD[case]
    spec = write_all_formats(tmp_path / "data")[fmt]
    if change:
        change(tmp_path / "data")
    before = _snapshot(tmp_path / "data")
    name = _name()
    custom = [{"name": name, **spec, **extra}]
    status, stderr = run_tool_here(
        monkeypatch, capsys, "train_net.py", "--cfg", DEMO_CFG, "CKPT", tmp_path / "run",
        "DATA.CUSTOM", repr(custom), "TRAIN.DATASETS", f"('{name}',)", "TEST.DATASETS", f"('{name}',)",
        "MODEL.NUM_CLASSES", len(CLASSES), "SOLVER.MAX_ITER", 1, "SOLVER.IMS_PER_BATCH", 2, "DATA.NUM_WORKERS", 0,
        "TRAIN.AUTO_RESUME", False, *opts)
    assert status == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), stderr
    assert re.search(expected, lines[0]), lines[0]
    assert os.listdir(tmp_path / "run") == ["log.txt"]  # no config.yaml, no checkpoint
    assert _snapshot(tmp_path / "data") == before  # no cache or converted labels next to the data


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_box_outside_its_image_is_clipped_with_one_warning_naming_it(tmp_path, caplog, fmt):
    spec = write_all_formats(tmp_path)[fmt]
    outside = {"yolo": lambda: _append(tmp_path / "yolo/labels/train/img_001.txt", "0 0.95 0.5 0.3 0.2\n"),
               "voc": lambda: _replace(tmp_path / "voc/Annotations/img_001.xml", "<xmin>", "<xmin>-2"),
               "csv": lambda: _append(tmp_path / "csv/boxes.csv", "img_001.jpg,30,2,90,9,circle\n"),
               "coco": lambda: _move_first_box(tmp_path / "coco/ann.json", dx=-5)}
    outside[fmt]()
    with caplog.at_level(logging.WARNING, logger="pet.data.coco_json"):
        dataset = get_dataset(_register(spec))
    warnings = [r.getMessage() for r in caplog.records if "clipped" in r.getMessage()]
    assert len(warnings) == 1 and "clipped 1 boxes" in warnings[0], warnings
    assert re.search({"coco": r"annotation ids \[1\]", "yolo": r"img_001.txt:\d+", "voc": r"img_001.xml, <object> #1",
                      "csv": r"boxes.csv:\d+"}[fmt], warnings[0]), warnings[0]
    assert all((r["boxes"][:, 2] <= r["width"]).all() and (r["boxes"] >= 0).all() for r in dataset.records)


def _move_first_box(json_file, dx: float) -> None:
    data = json.loads(open(json_file).read())
    data["annotations"][0]["bbox"][0] += dx
    open(json_file, "w").write(json.dumps(data))


def _add_empty_coco_box(json_file) -> None:
    data = json.loads(open(json_file).read())
    data["annotations"].append({"id": 999, "image_id": 1, "category_id": 1, "bbox": [10, 10, 0, 8], "iscrowd": 0})
    open(json_file, "w").write(json.dumps(data))


_EMPTY_VOC_OBJECT = ("<object><name>circle</name><difficult>0</difficult><bndbox><xmin>10</xmin><ymin>10</ymin>"
                     "<xmax>5</xmax><ymax>20</ymax></bndbox></object></annotation>")


@pytest.mark.parametrize("fmt", FORMATS)
def test_perfect_detections_score_100_on_a_converted_set_with_clipped_and_dropped_boxes(tmp_path, fmt):
    """A YOLO, VOC or CSV set's ground truth is the boxes training uses: a box dropped as empty is no miss, a
    clipped one is scored clipped. A COCO file stays the user's own ground truth, scored as it is."""
    from pet.evaluation.coco import evaluate_results_file

    spec = write_all_formats(tmp_path)[fmt]
    labels = tmp_path / "yolo/labels/train/img_001.txt"
    change = {"yolo": lambda: _append(labels, "0 0.95 0.5 0.3 0.2\n0 0.3 0.3 0 0.2\n"),
              "voc": lambda: (_replace(tmp_path / "voc/Annotations/img_001.xml", "<xmin>", "<xmin>-2"),
                              _replace(tmp_path / "voc/Annotations/img_001.xml", "</annotation>", _EMPTY_VOC_OBJECT)),
              "csv": lambda: _append(tmp_path / "csv/boxes.csv", "img_001.jpg,30,2,90,9,circle\n"
                                                                 "img_001.jpg,10,10,10,20,circle\n"),
              "coco": lambda: (_move_first_box(tmp_path / "coco/ann.json", dx=-5),
                               _add_empty_coco_box(tmp_path / "coco/ann.json"))}
    change[fmt]()
    dataset = get_dataset(_register(spec))
    detections = [{"image_id": r["image_id"], "category_id": dataset.label_to_category_id[int(label)], "score": 0.9,
                   "bbox": [float(x0), float(y0), float(x1 - x0), float(y1 - y0)]}
                  for r in dataset.records for (x0, y0, x1, y1), label in zip(r["boxes"], r["labels"])]
    (tmp_path / "bbox.json").write_text(json.dumps(detections))
    ap = evaluate_results_file(dataset, str(tmp_path / "bbox.json"))["bbox"]["AP"]
    if fmt == "coco":
        assert ap < 99 and len(dataset.coco.getAnnIds(imgIds=[1])) == len(dataset.records[0]["boxes"]) + 1
        return
    assert ap == pytest.approx(100.0)
    ground_truth = [a for a in dataset.coco.loadAnns(dataset.coco.getAnnIds(imgIds=[1])) if not a["iscrowd"]]
    xyxy = [[x, y, x + w, y + h] for x, y, w, h in (a["bbox"] for a in ground_truth)]
    assert np.allclose(xyxy, dataset.records[0]["boxes"], atol=1e-5)  # the records are float32
    assert all(a["area"] == a["bbox"][2] * a["bbox"][3] for a in ground_truth)


# --------------------------------------------------------------------------- the tools


@pytest.mark.slow
def test_visualize_data_and_test_net_work_on_a_voc_set(four_formats, tmp_path, monkeypatch, capsys):
    """The tools see a dataset of any format as they see a COCO one: pictures with class names, COCO metrics plus
    VOC's own for a voc set, and results files with the dataset's category ids."""
    name = four_formats["voc"]
    opts = ["DEVICE", "cpu", "MODEL.NUM_CLASSES", len(CLASSES), "TRAIN.DATASETS", f"('{name}',)",
            "TEST.DATASETS", f"('{name}',)", "INPUT.MIN_SIZE_TEST", 64, "DATA.NUM_WORKERS", 0]
    status, stderr = run_tool_here(monkeypatch, capsys, "visualize_data.py", "--cfg", DEMO_CFG, "--split", "test",
                                   "--num", 2, "--out", tmp_path / "vis", *opts)
    assert status == 0 and sorted(os.listdir(tmp_path / "vis")) == ["test_000_id1.png", "test_001_id2.png"], stderr
    cfg = load_cfg(DEMO_CFG, [*opts, "CKPT", str(tmp_path / "run"), "TEST.NUM_WARMUP", 0])
    torch.manual_seed(0)
    model = build_model(cfg)
    torch.save({"model": model.state_dict()}, tmp_path / "weights.pth")
    status, stderr = run_tool_here(monkeypatch, capsys, "test_net.py", "--cfg", DEMO_CFG, *opts, "CKPT",
                                   tmp_path / "run", "TEST.WEIGHTS", tmp_path / "weights.pth", "TEST.NUM_WARMUP", 0)
    assert status == 0, stderr
    metrics = json.loads((tmp_path / "run" / "test" / "metrics.json").read_text())["metrics"]
    assert {"bbox/VOC_AP50", "bbox/AP", "bbox/AP-star"} <= metrics.keys(), sorted(metrics)


# --------------------------------------------------------------------------- the entries of docs/data.md


def test_the_documented_entries_of_each_format_register_and_the_data_settings_load(tmp_path, monkeypatch):
    from pet.data import catalog
    from pet.data.catalog import get_dataset_spec, register_custom_datasets

    monkeypatch.setattr(catalog, "_REGISTERED", dict(catalog._REGISTERED))  # the documented names stay in this test
    (tmp_path / "formats.yaml").write_text(doc_block("yaml", "format: voc"))
    cfg = load_cfg(str(tmp_path / "formats.yaml"), [])
    register_custom_datasets(cfg)
    specs = {entry["name"]: get_dataset_spec(entry["name"]) for entry in cfg.DATA.CUSTOM}
    assert {s.format for s in specs.values()} == set(FORMATS)
    assert specs["cones_val"].split == "val" and specs["trees_train"].classes == ("Tree", "Snag")
    (tmp_path / "settings.yaml").write_text(doc_block("yaml", "REPEAT_THRESHOLD"))
    settings = load_cfg(str(tmp_path / "settings.yaml"), [])
    assert settings.DATA.SAMPLER == "RepeatFactorTrainingSampler" and settings.INPUT.CROP.SIZE == (800, 800)
