"""Predicting on pictures without annotations (pet/predict, tools/predict.py).

A folder predicts exactly test_net's detections; every output format is written, mirrored by sub-folder and
named with the model's own class names; bad input is one line and exit status 2 before any work, and an
unreadable picture in a folder is skipped; memory stays bounded over a long stream; tiles rebuild objects
cut by seams once; a video comes out as an mp4 of the frames predicted; a killed run leaves only complete
files; a model names its classes without its dataset.

The real model is the demo config with random weights (seed 0) on the session's 6 generated validation
images; what surrounds a model (loading, tiles, memory, video, files) is tested with ``BlobDetector``, an
exact detector of bright regions, which makes the expected detections known.
"""
from __future__ import annotations

import csv
import json
import math
import os
import shutil
import signal
import struct
import zlib
from dataclasses import dataclass

import cv2
import numpy as np
import pytest
import torch
import yaml

from pet.config import load_cfg
from pet.data.categories import LabelSpace, dataset_label_space
from pet.data.formats.yolo import read_yolo
from pet.modeling import build_model
from pet.predict import PredictionWriter, Predictor, Source, predict_cfg
from pet.predict.labels import model_label_space
from pet.predict.tiling import TileSpec, greedy_nmm, merge_seams, tile_grid
from pet.utils.errors import ConfigError
from support.helpers import (
    DEMO_CFG,
    ROOT,
    BlobDetector,
    custom_datasets,
    detections_of_test_net_and_predict,
    run_tool,
    run_tool_forked,
    run_tool_in_process,
)
from support.memory import process_tree_rss
from support.toys import toy_trainer

SHAPES = LabelSpace((1, 2, 3), ("circle", "rectangle", "triangle"))
RENAMED = LabelSpace((7, 8, 9), ("ring", "box", "wedge"))  # not the dataset's: proves the names come from the model
BLOB_CLASSES = LabelSpace((1, 2, 3), ("red", "green", "blue"))


@dataclass
class Demo:
    opts: list[str]  # the val set as TEST.DATASETS, cheap FLOPs summary, CKPT
    weights: str  # records the dataset's label space
    renamed: str  # records RENAMED
    bare: str  # a plain state_dict: no label space
    val_json: str
    val_dir: str


@pytest.fixture(scope="module")
def demo(tmp_path_factory, shapes_root) -> Demo:
    root = tmp_path_factory.mktemp("predict")
    val_json, val_dir = f"{shapes_root}/annotations/val.json", f"{shapes_root}/val"
    opts = ["DEVICE", "cpu", "CKPT", str(root / "ckpt"), "MODEL.FLOPS_INPUT_SIZE", "(64, 64)",
            "DATA.CUSTOM", custom_datasets(("predict_val", val_json, val_dir)), "TEST.DATASETS", "('predict_val',)",
            "TEST.DIAGNOSTICS.ENABLED", "False", "TEST.NUM_WARMUP", "1"]
    torch.manual_seed(0)
    state = build_model(load_cfg(DEMO_CFG, opts)).state_dict()
    # Random weights score every class near 1/4; bias the classifier away from background so that every image
    # has detections above the tests' thresholds, whatever the initialisation draws.
    state["roi_heads.box_predictor.cls_score.bias"] = torch.tensor([-4.0, 1.0, 0.5, 0.0])
    paths = {name: str(root / f"{name}.pth") for name in ("weights", "renamed", "bare")}
    torch.save({"model": state, "label_space": SHAPES.to_list()}, paths["weights"])
    torch.save({"model": state, "label_space": RENAMED.to_list()}, paths["renamed"])
    torch.save(state, paths["bare"])
    return Demo(opts, paths["weights"], paths["renamed"], paths["bare"], val_json, val_dir)


def blob_predictor(*opts: str, label_space: LabelSpace = BLOB_CLASSES, **kwargs) -> Predictor:
    cfg = load_cfg(DEMO_CFG, ["DEVICE", "cpu", "TEST.NUM_WARMUP", "0", *opts])
    return Predictor(cfg, model=BlobDetector(), label_space=label_space, **kwargs)


def write_scene(path: str, size: tuple[int, int], boxes: list[tuple[int, int, int, int]], channel: int = 0) -> None:
    """A black picture of ``size`` (h, w) with a filled rectangle per box (x0, y0, x1, y1) in ``channel`` (RGB)."""
    image = np.zeros((*size, 3), np.uint8)
    for x0, y0, x1, y1 in boxes:
        image[y0:y1, x0:x1, 2 - channel] = 255  # BGR on disk
    cv2.imwrite(path, image)


# ------------------------------------------------------------------------------------------ exactness
@pytest.mark.numeric
def test_a_folder_gives_exactly_test_nets_detections_at_its_batch_size(demo, tmp_path):
    """Same model, precision (TEST.AMP auto), transform and padded batches of 4 (6 images: 4 + 2) as test_net."""
    cfg = load_cfg(DEMO_CFG, [*demo.opts, "TEST.WEIGHTS", demo.weights, "TEST.IMS_PER_BATCH", "4"])
    expected, predicted, predictor = detections_of_test_net_and_predict(cfg, demo.val_dir, demo.val_json, tmp_path)
    assert len(expected) > 100 and predicted == expected
    assert predictor.stats.pictures == 6 and predictor.stats.detections == len(expected)


# ------------------------------------------------------------------------------------------ the command line
def test_every_format_mirrors_sub_folders_names_classes_from_the_model_and_skips_a_broken_image(demo, tmp_path,
                                                                                              monkeypatch, capsys):
    """In this process (the same code; test_bad_input_is_one_line... shows a shell's view of predict.py)."""
    images = tmp_path / "in"
    for folder, names in (("a", ["000001", "000002"]), ("b", ["000001"])):
        (images / folder).mkdir(parents=True)
        for i, name in enumerate(names):
            shutil.copy(f"{demo.val_dir}/00000{i + 1 if folder == 'a' else 3}.jpg", images / folder / f"{name}.jpg")
    (images / "b" / "broken.jpg").write_bytes(b"not a jpeg")
    out = tmp_path / "out"
    run = run_tool_in_process(monkeypatch, capsys, "predict.py", "--cfg", DEMO_CFG, "--input", images, "--output",
                              out, "--save", "csv,coco,json,yolo,vis,crops", "--batch", "2", "--score-thresh", "0.3",
                              *demo.opts, "TEST.WEIGHTS", demo.renamed)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"Skipped {images}/b/broken.jpg: Cannot decode image" in run.stdout
    assert "Predicted 3 pictures, 1 unreadable skipped" in run.stdout
    assert "it/s" not in run.stderr and "img/s" not in run.stderr  # no progress bar when stderr is not a terminal

    with open(out / "predictions.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["image", "xmin", "ymin", "xmax", "ymax", "score", "label", "name"]
    assert {r["image"] for r in rows} == {f"{images}/a/000001.jpg", f"{images}/a/000002.jpg", f"{images}/b/000001.jpg"}
    assert min(float(r["score"]) for r in rows) >= 0.3
    assert {(int(r["label"]), r["name"]) for r in rows} <= set(zip(RENAMED.category_ids, RENAMED.names))

    with open(out / "predictions_images.json") as f:
        table = json.load(f)
    assert [(i["id"], i["file_name"]) for i in table["images"]] == [(1, "a/000001.jpg"), (2, "a/000002.jpg"),
                                                                    (3, "b/000001.jpg")]
    with open(out / "predictions.json") as f:
        results = json.load(f)
    assert len(results) == len(rows) and {r["category_id"] for r in results} <= {7, 8, 9}

    per_image = {}
    for name in ("a/000001", "a/000002", "b/000001"):
        with open(out / "json" / f"{name}.json") as f:
            per_image[name] = json.load(f)
        assert per_image[name]["image"] == f"{images}/{name}.jpg"
        lines = (out / "labels" / f"{name}.txt").read_text().splitlines()
        assert len(lines) == len(per_image[name]["detections"])
        for line in lines:
            cls, *coords, conf = line.split()
            assert int(cls) in (0, 1, 2) and all(0 <= float(v) <= 1 for v in coords) and float(conf) >= 0.3
        drawn = cv2.imread(str(out / "vis" / f"{name}.jpg"))
        assert drawn.shape == cv2.imread(str(images / f"{name}.jpg")).shape
    assert sum(len(p["detections"]) for p in per_image.values()) == len(rows)
    assert yaml.safe_load((out / "data.yaml").read_text())["names"] == {0: "ring", 1: "box", 2: "wedge"}
    crops = sorted(str(p.relative_to(out / "crops")) for p in (out / "crops").rglob("*.jpg"))
    assert len(crops) == len(rows) and all(c.split("/")[0] in RENAMED.names for c in crops)
    first = per_image["a/000001"]["detections"][0]
    assert f"{first['name']}/a/000001_0.jpg" in crops


@pytest.mark.numeric
def test_a_score_threshold_below_the_models_gives_the_same_detections_from_python_as_from_the_command_line(
        demo, tmp_path, monkeypatch, capsys):
    """--score-thresh below the model's SCORE_THRESH_TEST lowers it, so the model keeps those detections; the
    Predictor's score_thresh must do the same (on a copy of the caller's config), or Python finds fewer."""
    images = tmp_path / "in"
    images.mkdir()
    for name in ("000001.jpg", "000002.jpg"):
        shutil.copy(f"{demo.val_dir}/{name}", images / name)
    opts = [*demo.opts, "TEST.WEIGHTS", demo.weights, "MODEL.ROI_HEADS.SCORE_THRESH_TEST", "0.54"]
    # The command line (in this process: the other command-line tests show what a shell sees) with this process's
    # thread count, so both compute alike and the files can be compared exactly: with 2 threads against 1, float32
    # (TEST.AMP auto on a CPU without native bfloat16) put scores 1e-6 apart, enough to change a printed digit and
    # the order of near-ties (AVX-512 without bf16, and AVX2).
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    cli_run = run_tool_in_process(monkeypatch, capsys, "predict.py", "--cfg", DEMO_CFG, "--input", images,
                                  "--output", tmp_path / "cli", "--save", "csv", "--score-thresh", "0.1", *opts)
    assert cli_run.returncode == 0, cli_run.stderr
    cfg = predict_cfg(DEMO_CFG, opts)
    source = Source(str(images))
    predictor = Predictor(cfg, score_thresh=0.1)
    with PredictionWriter(str(tmp_path / "python"), ["csv"], predictor.label_space, source) as writer:
        for detections in predictor.stream(source):
            writer.write(detections)
    cli, python = ((tmp_path / folder / "predictions.csv").read_text() for folder in ("cli", "python"))
    scores = [float(row["score"]) for row in csv.DictReader(python.splitlines())]
    assert python == cli and min(scores) < 0.54 <= max(scores) and min(scores) >= 0.1
    assert cfg.MODEL.ROI_HEADS.SCORE_THRESH_TEST == 0.54


@pytest.mark.slow
def test_bad_input_is_one_line_and_exit_status_2_before_any_work(demo, tmp_path, monkeypatch, capsys):
    """The first case as a user's shell sees it (a fresh interpreter), the others in this process (the same code,
    without a start-up of seconds each)."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken.mp4").write_bytes(b"\x00" * 1000)
    (tmp_path / "a_file").write_text("")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(f"{demo.val_dir}/000001.jpg", mixed / "a.jpg")
    (mixed / "b.jpg").write_bytes(b"")
    video = cv2.VideoWriter(str(tmp_path / "clip.mp4"), cv2.VideoWriter_fourcc(*"mp4v"), 10.0, (64, 64))
    video.write(np.zeros((64, 64, 3), np.uint8))
    video.release()
    weights = ["TEST.WEIGHTS", demo.weights]
    cases = {  # input, output, extra opts -> the start of the one line
        "missing": (tmp_path / "nope", tmp_path / "o1", [], f"Error: Input {tmp_path}/nope does not exist"),
        "empty folder": (tmp_path / "empty", tmp_path / "o2", [], f"Error: Input folder {tmp_path}/empty is empty."),
        "video": (tmp_path / "broken.mp4", tmp_path / "o3", [], f"Error: Cannot read video {tmp_path}/broken.mp4"),
        "output": (mixed, tmp_path / "a_file" / "out", [],
                   f"Error: Cannot write to the output folder {tmp_path}/a_file/out"),
        "bad image, error": (mixed, tmp_path / "o5", ["DATA.ON_BAD_IMAGE", "error"],
                             f"Error: Cannot decode image {mixed}/b.jpg: the file is empty"),
        "output is the input": (mixed, mixed, [], f"Error: --output {mixed} is the input folder of {mixed}"),
        "output is the glob's folder": (f"{mixed}/**/*.jpg", mixed, [], f"Error: --output {mixed} is the input folder"),
        "stride 0": (tmp_path / "clip.mp4", tmp_path / "o6", ["--vid-stride", "0"],
                     "Error: --vid-stride takes a whole number of 1"),
        "negative batch": (mixed, tmp_path / "o7", ["--batch", "-2"],
                           "Error: --batch takes 0 (TEST.IMS_PER_BATCH) or a whole number"),
        "unquoted glob": (mixed / "a.jpg", tmp_path / "o8", [mixed / "b.jpg"],  # --input mixed/*.jpg, expanded
                          f'Error: {mixed}/b.jpg is a file, not a config key: the shell expanded a glob given to '
                          f'--input into many arguments. Quote the glob: --input "{mixed}/*.jpg".'),
    }
    runs = {}
    for name, (src, out, extra, _) in cases.items():
        args = ["--cfg", DEMO_CFG, "--input", src, "--output", out, *extra, *demo.opts, *weights]
        runs[name] = run_tool("predict.py", *args, threads=1, check=False) if not runs else \
            run_tool_in_process(monkeypatch, capsys, "predict.py", *args)
    for name, run in runs.items():
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 2 and len(lines) == 1 and lines[0].startswith(cases[name][3]), (name, run.stderr)
        if name != "bad image, error":  # found before the model is even loaded
            assert "Loaded" not in run.stdout and not os.path.exists(os.path.join(cases[name][1], "predictions.csv")), \
                name
            # and before the output folder is made: a typo in --input leaves no empty folder (with a log.txt) behind
            assert cases[name][1] == mixed or not os.path.exists(cases[name][1]), name
    assert not (tmp_path / "o5" / "predictions.csv").exists()  # a stopped run leaves no partial CSV


def test_the_output_folder_inside_the_input_is_left_out_however_it_is_named(tmp_path):
    src = tmp_path / "in"
    (src / "out" / "vis").mkdir(parents=True)
    write_scene(str(src / "a.jpg"), (32, 32), [(4, 4, 12, 12)])
    write_scene(str(src / "out" / "vis" / "a.jpg"), (32, 32), [(4, 4, 12, 12)])  # a previous run's output
    (tmp_path / "link").symlink_to(src / "out")
    for spec in (str(src), f"{src}/**/*.jpg"):
        for output in (src / "out", tmp_path / "link", src / "out" / ".." / "out"):
            source = Source(spec, exclude=str(output))
            assert [source.paths[i] for i in range(len(source))] == [str(src / "a.jpg")], (spec, output)


def test_a_folder_reached_again_through_links_is_searched_once(tmp_path):
    for folder in ("sub", "loop"):
        (tmp_path / folder).mkdir()
        write_scene(str(tmp_path / folder / "a.jpg"), (32, 32), [(4, 4, 12, 12)])
    (tmp_path / "loop" / "self").symlink_to(".")  # a loop
    (tmp_path / "alias").symlink_to("sub")  # the same folder twice: the real one is named
    source = Source(str(tmp_path))
    assert [source.paths[i] for i in range(len(source))] == [str(tmp_path / "loop" / "a.jpg"),
                                                             str(tmp_path / "sub" / "a.jpg")]


def test_a_list_file_saved_with_a_byte_order_mark_keeps_its_first_entry(tmp_path):
    for name in ("a.jpg", "b.jpg"):
        write_scene(str(tmp_path / name), (32, 32), [(4, 4, 12, 12)])
    (tmp_path / "list.txt").write_bytes("a.jpg\r\nb.jpg\r\n".encode("utf-8-sig"))
    source = Source(str(tmp_path / "list.txt"))
    assert [source.paths[i] for i in range(len(source))] == [str(tmp_path / "a.jpg"), str(tmp_path / "b.jpg")]


# ------------------------------------------------------------------------------------------ tiles
def test_tiles_cover_the_picture_with_full_size_tiles():
    tiles = tile_grid(700, 1000, 256, 192)
    assert sorted({int(x) for x in tiles[:, 0]}) == [0, 192, 384, 576, 744]
    assert sorted({int(y) for y in tiles[:, 1]}) == [0, 192, 384, 444]
    assert ((tiles[:, 2] - tiles[:, 0]) == 256).all() and ((tiles[:, 3] - tiles[:, 1]) == 256).all()
    assert tile_grid(100, 80, 256, 192).tolist() == [[0, 0, 80, 100]]
    assert TileSpec(256, 0.25).stride == 192


# Rectangles (x0, y0, x1, y1) on a 700x1000 picture cut into 256 px tiles overlapping by 64 px (seams at
# x = 192, 256, 384, 448, 576, 640, 744, 832; y = 192, 256, 384, 444, 448, 640): inside one tile; whole in one
# tile with an 8 px sliver in the next; across a seam but inside the overlap; larger than the overlap across one
# seam; across four tiles at a corner; over three tiles in a row; on the last, shifted column.
SCENE = [(20, 20, 60, 50), (136, 40, 200, 80), (200, 100, 240, 130), (150, 300, 300, 360), (170, 170, 230, 230),
         (350, 520, 800, 560), (560, 180, 610, 400), (700, 420, 990, 470), (900, 40, 950, 90)]


def test_tiles_report_every_object_once_whole_including_those_larger_than_the_overlap(tmp_path):
    for channel in range(3):
        write_scene(str(tmp_path / f"scene{channel}.png"), (700, 1000), SCENE, channel)
    predictor = blob_predictor(tile=256, tile_overlap=0.25)
    results = list(predictor.stream(str(tmp_path), batch_size=4))
    assert len(results) == 3
    for channel, detections in enumerate(results):
        assert sorted(detections.boxes.round().astype(int).tolist()) == sorted(map(list, SCENE))
        assert set(detections.labels.tolist()) == {channel + 1}
    # The whole-image pass adds the same objects, seen whole: still once each.
    whole = blob_predictor(tile=256, tile_overlap=0.25, tile_whole_image=True)(str(tmp_path / "scene0.png"))
    assert sorted(whole.boxes.round().astype(int).tolist()) == sorted(map(list, SCENE))


def test_the_seam_merge_keeps_neighbours_apart_where_greedy_merging_joins_them():
    """Two objects of one class side by side, B inside A's box; both whole in tile 0, B whole in tile 1 too, A cut
    by tile 1's left edge."""
    tiles = torch.tensor([[0, 0, 256, 256], [192, 0, 448, 256]])
    boxes = torch.tensor([[150.0, 50, 250, 150], [200.0, 60, 240, 140], [200.0, 61, 240, 141], [192.0, 50, 250, 150]])
    scores, labels = torch.tensor([0.9, 0.8, 0.85, 0.7]), torch.tensor([1, 1, 1, 1])
    merged, _, _, _ = merge_seams(boxes, scores, labels, torch.tensor([0, 0, 1, 1]), tiles, (256, 448))
    assert sorted(merged.tolist()) == [[150, 50, 250, 150], [200, 60, 240, 140]]  # B as tile 0 sees it, 16 px in
    greedy, _, _, _ = greedy_nmm(boxes, scores, labels)
    assert len(greedy) == 1  # SAHI's merge: B disappears into A


def test_predict_many_gives_each_pictures_own_detections_in_batches(tmp_path):
    """Arrays and files mixed, three pictures at a time: as many results as pictures, in order, each what the
    picture alone gives; and only positive batch sizes."""
    boxes = [(10 + 20 * i, 30, 60 + 20 * i, 90) for i in range(5)]
    for i, box in enumerate(boxes):
        write_scene(str(tmp_path / f"{i}.png"), (128, 192), [box])
    pictures = [str(tmp_path / f"{i}.png") if i % 2 else cv2.imread(str(tmp_path / f"{i}.png")) for i in range(5)]
    predictor = blob_predictor()
    together = predictor.predict_many(pictures, batch_size=3)
    alone = [predictor(picture) for picture in pictures]
    assert [d.path for d in together] == ["", str(tmp_path / "1.png"), "", str(tmp_path / "3.png"), ""]
    for many, one, box in zip(together, alone, boxes):
        assert len(many) == 1 and many.boxes.tolist() == one.boxes.tolist()
        assert many.boxes[0].tolist() == pytest.approx(list(box), abs=2)
    with pytest.raises(ConfigError, match="batch size must be positive"):
        predictor.predict_many(pictures, batch_size=-1)


# ------------------------------------------------------------------------------------------ streams
def test_a_long_stream_holds_bounded_memory_with_its_decoding_workers(tmp_path):
    for i in range(300):
        write_scene(str(tmp_path / f"{i:04d}.jpg"), (256, 256), [(20 + i % 100, 30, 120, 90 + i % 50)])
    predictor = blob_predictor()
    rss = {}
    for count, detections in enumerate(predictor.stream(str(tmp_path), batch_size=8, with_images=True,
                                                        num_workers=1), 1):
        assert len(detections) == 1 and detections.image.shape == (256, 256, 3)
        if count in (100, 300):
            rss[count] = process_tree_rss()
    # Keeping each picture would add 200 x 192 KB = 38 MB (measured: +0.05 MB as it is, +37 MB keeping them).
    assert count == 300 and rss[300] - rss[100] < 15 * 2**20, {k: v / 2**20 for k, v in rss.items()}


def test_a_video_gives_every_nth_frame_and_an_mp4_of_them(tmp_path):
    path = str(tmp_path / "in" / "clip.mp4")
    os.makedirs(os.path.dirname(path))
    video = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), 10.0, (96, 64))
    for k in range(31):
        frame = np.zeros((64, 96, 3), np.uint8)
        frame[20:40, 2 * k:2 * k + 20] = 255
        video.write(frame)
    video.release()
    source = Source(str(tmp_path / "in"))
    assert source.num_pictures(vid_stride=4) == 8
    predictor = blob_predictor()
    out = tmp_path / "out"
    with PredictionWriter(str(out), ["json", "vis", "csv"], BLOB_CLASSES, source, vid_stride=4) as writer:
        for detections in predictor.stream(source, batch_size=3, vid_stride=4, with_images=True):
            writer.write(detections)
    assert sorted(os.listdir(out / "json")) == sorted(f"clip_{k}.json" for k in range(0, 31, 4))
    with open(out / "json" / "clip_8.json") as f:
        record = json.load(f)
    assert record["frame"] == 8 and record["detections"][0]["box"] == pytest.approx([16, 20, 36, 40], abs=2)
    capture = cv2.VideoCapture(str(out / "vis" / "clip.mp4"))
    decoded = 0
    while capture.read()[0]:
        decoded += 1
    assert decoded == math.ceil(31 / 4)
    with open(out / "predictions.csv") as f:
        assert f"{path}#28," in f.read()


def test_pictures_whose_names_differ_only_by_extension_keep_it_and_overwrite_nothing(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    write_scene(str(src / "a.jpg"), (64, 64), [(8, 8, 24, 24)])
    write_scene(str(src / "a.png"), (64, 64), [(30, 30, 50, 50)], channel=1)
    write_scene(str(src / "clip_1.png"), (64, 96), [(4, 4, 20, 20)], channel=2)
    write_scene(str(src / "solo.png"), (64, 64), [(8, 8, 24, 24)])
    for ext, fourcc in ((".mp4", "mp4v"), (".avi", "MJPG")):
        video = cv2.VideoWriter(str(src / f"clip{ext}"), cv2.VideoWriter_fourcc(*fourcc), 10.0, (96, 64))
        for _ in range(2):
            video.write(np.full((64, 96, 3), 255 if ext == ".avi" else 0, np.uint8))
        video.release()
    source = Source(str(src))
    out = tmp_path / "out"
    with PredictionWriter(str(out), ["json", "vis", "crops"], BLOB_CLASSES, source) as writer:
        for detections in blob_predictor().stream(source, batch_size=2, with_images=True, num_workers=0):
            writer.write(detections)
    names = {"a.jpg": "a.jpg", "a.png": "a.png", "clip_1.png": "clip_1.png", "solo.png": "solo",
             **{f"clip.{ext}#{k}": f"clip.{ext}_{k}" for ext in ("avi", "mp4") for k in (0, 1)}}
    assert sorted(os.listdir(out / "json")) == sorted(f"{name}.json" for name in names.values())
    for file, name in names.items():
        with open(out / "json" / f"{name}.json") as f:
            assert json.load(f)["image"] == str(src / file.split("#")[0])
    assert sorted(os.listdir(out / "vis")) == ["a.jpg", "a.png", "clip.avi.mp4", "clip.mp4.mp4", "clip_1.png",
                                               "solo.png"]
    crops = {str(p.relative_to(out / "crops")) for p in (out / "crops").rglob("*.*")}
    assert {"red/a.jpg_0.jpg", "green/a.png_0.png", "blue/clip_1.png_0.png", "red/solo_0.png"} <= crops


def test_crops_of_classes_named_like_paths_stay_one_folder_under_crops(tmp_path):
    """A class name is data: ``..`` must not write beside ``crops/`` and ``N/A`` (COCO-layout models) must not
    nest folders; each becomes one folder under ``crops/``, an ordinary name is kept."""
    space = LabelSpace((1, 2, 3), ("..", "N/A", "blue"))
    src = tmp_path / "in"
    src.mkdir()
    write_scene(str(src / "a.png"), (64, 64), [(8, 8, 24, 24)])
    write_scene(str(src / "b.png"), (64, 64), [(8, 8, 24, 24)], channel=1)
    write_scene(str(src / "c.png"), (64, 64), [(8, 8, 24, 24)], channel=2)
    source = Source(str(src))
    out = tmp_path / "out"
    with PredictionWriter(str(out), ["crops"], space, source) as writer:
        for detections in blob_predictor(label_space=space).stream(source, with_images=True, num_workers=0):
            writer.write(detections)
    assert sorted(os.listdir(out)) == ["crops"]
    crops = sorted(str(p.relative_to(out / "crops")) for p in (out / "crops").rglob("*") if p.is_file())
    assert crops == ["N_A/b_0.png", "__/a_0.png", "blue/c_0.png"]


def test_yolo_output_of_a_coco_layout_model_reads_back_with_the_same_boxes_and_names(tmp_path):
    """A COCO-layout label space (90 rows, the ten unused ones all named 'N/A') writes each name once in
    data.yaml, so Pet's YOLO reader (and Ultralytics) take it: the labels, their conf column dropped as a
    training set has none, read back as the detections' boxes and names."""
    space = LabelSpace.by_category_id({1: "person", 3: "car"}, 90)  # red: label 1 'person', blue: 3 'car'
    images = tmp_path / "set" / "images"
    images.mkdir(parents=True)
    write_scene(str(images / "a.png"), (100, 160), [(20, 10, 60, 40)])
    write_scene(str(images / "b.png"), (96, 64), [(5, 50, 45, 90)], channel=2)
    source = Source(str(images))
    out = tmp_path / "out"
    with PredictionWriter(str(out), ["yolo"], space, source) as writer:
        detections = list(blob_predictor(label_space=space).stream(source))
        for det in detections:
            writer.write(det)
    names = yaml.safe_load((out / "data.yaml").read_text())["names"]
    assert (names[0], names[2], names[11], names[25]) == ("person", "car", "N/A_12", "N/A_26")
    (tmp_path / "set" / "labels").mkdir()
    for name in ("a", "b"):
        lines = (out / "labels" / f"{name}.txt").read_text().splitlines()
        (tmp_path / "set" / "labels" / f"{name}.txt").write_text("".join(" ".join(line.split()[:5]) + "\n"
                                                                         for line in lines))
    (tmp_path / "set" / "data.yaml").write_text((out / "data.yaml").read_text() + "val: images\n")

    coco = read_yolo(str(tmp_path / "set" / "data.yaml"), "val").coco
    category = {c["id"]: c["name"] for c in coco["categories"]}
    assert [(a["image_id"], category[a["category_id"]]) for a in coco["annotations"]] == [(1, "person"), (2, "car")]
    assert [det.names for det in detections] == [["person"], ["car"]]
    for ann, det in zip(coco["annotations"], detections):  # the label files keep 6 significant digits
        x0, y0, x1, y1 = det.boxes[0].tolist()
        assert ann["bbox"] == pytest.approx([x0, y0, x1 - x0, y1 - y0], abs=1e-3)
    assert [det.boxes.tolist() for det in detections] == [[[20, 10, 60, 40]], [[5, 50, 45, 90]]]


def test_a_picture_over_opencvs_pixel_limit_is_skipped_and_counted_saying_what_to_set(tmp_path, caplog):
    write_scene(str(tmp_path / "a.png"), (64, 64), [(8, 8, 24, 24)])
    chunks = [(b"IHDR", struct.pack(">IIBBBBB", 70000, 70000, 8, 2, 0, 0, 0)), (b"IDAT", zlib.compress(b"\0")),
              (b"IEND", b"")]  # a valid PNG header of 70000 x 70000 pixels, over opencv's 2^30
    (tmp_path / "huge.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"".join(
        struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        for kind, data in chunks))
    predictor = blob_predictor("DATA.ON_BAD_IMAGE", "skip")
    assert len(list(predictor.stream(str(tmp_path), num_workers=0))) == 1
    assert predictor.stats.skipped == 1 and predictor.stats.skipped_examples == [str(tmp_path / "huge.png")]
    assert f"Skipped {tmp_path}/huge.png: Cannot decode image" in caplog.text
    assert "OPENCV_IO_MAX_IMAGE_PIXELS" in caplog.text


def test_a_file_name_that_is_not_utf8_is_written_back_as_its_bytes(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    name = os.fsdecode(b"caf\xe9.jpg")  # Latin-1, as an old camera or a Windows share names it
    write_scene(str(src / "a.jpg"), (64, 64), [(8, 8, 24, 24)])
    os.rename(src / "a.jpg", src / name)  # cv2.imwrite crashes on such a name
    source = Source(str(src))
    out = tmp_path / "out"
    with PredictionWriter(str(out), ["csv", "json"], BLOB_CLASSES, source) as writer:
        for detections in blob_predictor().stream(source, num_workers=0):
            writer.write(detections)
    with open(out / "predictions.csv", newline="", encoding="utf-8", errors="surrogateescape") as f:
        rows = list(csv.DictReader(f))
    assert [row["image"] for row in rows] == [str(src / name)]
    with open(out / "json" / f"{os.path.splitext(name)[0]}.json") as f:
        assert json.load(f)["image"] == str(src / name)


_KILLED_RUN = """
import os, signal, sys
from support.helpers import DEMO_CFG, BlobDetector
from pet.config import load_cfg
from pet.data.categories import LabelSpace
from pet.predict import Predictor, PredictionWriter, Source
cfg = load_cfg(DEMO_CFG, ["DEVICE", "cpu"])
predictor = Predictor(cfg, model=BlobDetector(), label_space=LabelSpace((1, 2, 3), ("r", "g", "b")))
source = Source({src!r})
with PredictionWriter({out!r}, ["csv", "coco", "json", "yolo", "vis"], predictor.label_space, source) as writer:
    for count, detections in enumerate(predictor.stream(source, batch_size=2, with_images=True, num_workers=0), 1):
        writer.write(detections)
        if count == 5:
            os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
def test_a_run_killed_half_way_leaves_only_complete_files(tmp_path):
    for i in range(10):
        write_scene(str(tmp_path / f"{i}.png"), (64, 64), [(10, 10, 30 + i, 40)])
    out = tmp_path / "out"
    script = tmp_path / "killed_run.py"  # a process of its own, forked from the session's fork server
    script.write_text(_KILLED_RUN.format(src=str(tmp_path), out=str(out)))
    proc = run_tool_forked(str(script), check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    files = [p for p in out.rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert {p.name for p in files} >= {"0.json", "4.json", "0.txt", "4.png", "data.yaml"}
    assert not (out / "predictions.csv").exists() and not (out / "predictions.json").exists()
    for p in files:
        if p.suffix == ".json":
            assert json.loads(p.read_text())["detections"]
        elif p.suffix == ".png":
            assert cv2.imread(str(p)).shape == (64, 64, 3)
        elif p.suffix == ".txt":
            assert len(p.read_text().split()) == 6


# ------------------------------------------------------------------------------------------ class names
def test_a_model_without_a_label_space_falls_back_to_its_test_set_then_to_numbers_with_one_warning(demo, caplog):
    cfg = load_cfg(DEMO_CFG, demo.opts)
    assert model_label_space(cfg, RENAMED.to_list(), "m.pth") == RENAMED and not caplog.records
    assert model_label_space(cfg, None, "m.pth") == SHAPES
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "TEST.DATASETS[0] 'predict_val'" in caplog.text
    caplog.clear()
    unregistered = load_cfg(DEMO_CFG, ["TEST.DATASETS", "('nowhere',)"])
    numbered = model_label_space(unregistered, None, "m.pth")
    assert numbered.names == ("class_1", "class_2", "class_3") and numbered.category_ids == (1, 2, 3)
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "class_1 .. class_3" in caplog.text


def test_a_predictor_reads_its_checkpoint_file_once_for_its_weights_and_its_class_names(demo, monkeypatch):
    """The weights and the label space come from one read of the file (a weights file can be hundreds of MB)."""
    reads, real_load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda f, *args, **kwargs: reads.append(f) or real_load(f, *args, **kwargs))
    predictor = Predictor(load_cfg(DEMO_CFG, [*demo.opts, "TEST.WEIGHTS", demo.renamed]))
    assert reads == [demo.renamed]
    assert predictor.label_space == RENAMED  # the names recorded in the file: read from that one load


def test_torchvisions_coco_weights_predict_with_cocos_names_and_ids(caplog):
    """A torchvision COCO state_dict records nothing; the shipped COCO config names its 90 rows by category id
    from COCO's list (known without any file), so label 1 is 'person' and label 90 'toothbrush'."""
    cfg = load_cfg(os.path.join(ROOT, "cfgs", "coco", "faster_rcnn_R-50-FPN_1x.yaml"), [])
    space = model_label_space(cfg, None, "tv.pth")
    assert space.num_classes == 90 and space.category_ids == tuple(range(1, 91))
    assert (space.name(1), space.name(13), space.name(90)) == ("person", "stop sign", "toothbrush")
    assert "naming its labels after the categories of TEST.DATASETS[0] 'coco_2017_val'" in caplog.text


def test_the_checkpoint_of_a_training_run_records_its_label_space(make_cfg):
    class Dataset:
        class_names = ["cat", "dog"]
        label_to_category_id = {1: 17, 2: 18}

    class Loader(list):
        dataset = Dataset()

    assert "label_space" not in toy_trainer(make_cfg()).checkpointer.state(0, 0)  # a toy loader has no classes
    trainer = toy_trainer(make_cfg(), loader=Loader())
    assert trainer.checkpointer.state(0, 0)["label_space"] == [{"label": 1, "id": 17, "name": "cat"},
                                                               {"label": 2, "id": 18, "name": "dog"}]
    assert dataset_label_space(Dataset()) == LabelSpace((17, 18), ("cat", "dog"))
