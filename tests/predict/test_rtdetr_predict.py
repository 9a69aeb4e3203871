"""RT-DETR through tools/predict.py and pet.predict: every output format (pictures, CSV, COCO, per-picture JSON, YOLO,
crops, a video's mp4), exactly test_net's detections, ``--score-thresh`` below the model's threshold, and tiles.

Tiles: the predictor hands each tile's detections to the merge as the model made them (moved to the picture's
pixels); RT-DETR makes one prediction per (query, class) and has no NMS, so nothing suppresses anything inside a
tile before the seam merge, which treats RT-DETR's detections as any detector's.

D-FINE, of the same family, goes through the same tests.

One tiny model of each (``support.tiny_models.TINY_QUERY_DETECTORS``, random weights, seed 0), on the session's 6
generated validation images.
"""
from __future__ import annotations

import csv
import json
import math
import shutil
from dataclasses import dataclass

import cv2
import numpy as np
import pytest
import torch

from pet.config import load_cfg
from pet.data.categories import LabelSpace
from pet.modeling import build_model
from pet.predict import Predictor, predict_cfg
from pet.predict.tiling import TileSpec, merge_tiles
from support.helpers import custom_datasets, detections_of_test_net_and_predict, run_tool_in_process
from support.tiny_models import TINY_QUERY_DETECTORS

SHAPES = LabelSpace((1, 2, 3), ("circle", "rectangle", "triangle"))
# The tiny models' DETECTIONS_PER_IMAGE: the model keeps its 20 best (query, class) pairs, above threshold 0
PER_PICTURE = 20


@dataclass
class TinyRTDETRRun:
    cfg_file: str
    node: str  # the model's config node, MODEL.<node>
    opts: list[str]  # the tiny model's, the val set as TEST.DATASETS, CKPT, TEST.WEIGHTS
    val_json: str
    val_dir: str


@pytest.fixture(scope="module", params=list(TINY_QUERY_DETECTORS))
def tiny_run(request, tmp_path_factory, shapes_root) -> TinyRTDETRRun:
    tiny = TINY_QUERY_DETECTORS[request.param]
    root = tmp_path_factory.mktemp(f"{request.param}_predict")
    val_json, val_dir = f"{shapes_root}/annotations/val.json", f"{shapes_root}/val"
    weights = str(root / "tiny.pth")
    opts = [*tiny.opts, "DEVICE", "cpu", "CKPT", str(root / "ckpt"), "MODEL.FLOPS_INPUT_SIZE", "(64, 64)",
            "DATA.CUSTOM", custom_datasets(("rtdetr_val", val_json, val_dir)), "TEST.DATASETS", "('rtdetr_val',)",
            "TEST.DIAGNOSTICS.ENABLED", "False", "TEST.NUM_WARMUP", "1", "TEST.WEIGHTS", weights]
    torch.manual_seed(0)
    torch.save({"model": build_model(load_cfg(tiny.cfg_file, opts)).state_dict(), "label_space": SHAPES.to_list()},
               weights)
    return TinyRTDETRRun(tiny.cfg_file, tiny.node, opts, val_json, val_dir)


def write_clip(path: str, frames: int) -> None:
    video = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), 10.0, (96, 64))
    for k in range(frames):
        frame = np.zeros((64, 96, 3), np.uint8)
        frame[20:40, 4 * k:4 * k + 20] = 255
        video.write(frame)
    video.release()


def test_every_output_format_of_a_folder_with_a_video(tiny_run, tmp_path, monkeypatch, capsys):
    images = tmp_path / "in"
    images.mkdir()
    for name in ("000001.jpg", "000002.jpg"):
        shutil.copy(f"{tiny_run.val_dir}/{name}", images / name)
    write_clip(str(images / "clip.mp4"), 5)
    out = tmp_path / "out"
    run = run_tool_in_process(monkeypatch, capsys, "predict.py", "--cfg", tiny_run.cfg_file, "--input", images,
                              "--output", out, "--save", "csv,coco,json,yolo,vis,crops", "--vid-stride", "2",
                              "--vis-thresh", "0", *tiny_run.opts)
    assert run.returncode == 0, run.stderr
    names = ["000001", "000002", "clip_0", "clip_2", "clip_4"]
    with open(out / "predictions.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == PER_PICTURE * len(names)
    assert {(int(r["label"]), r["name"]) for r in rows} <= set(zip(SHAPES.category_ids, SHAPES.names))
    assert {r["image"] for r in rows} == {f"{images}/000001.jpg", f"{images}/000002.jpg",
                                          *(f"{images}/clip.mp4#{k}" for k in (0, 2, 4))}
    with open(out / "predictions.json") as f:
        results = json.load(f)
    assert len(results) == len(rows) and all(len(r["bbox"]) == 4 for r in results)
    for name in names:
        with open(out / "json" / f"{name}.json") as f:
            assert len(json.load(f)["detections"]) == PER_PICTURE
        lines = (out / "labels" / f"{name}.txt").read_text().splitlines()
        assert len(lines) == PER_PICTURE and all(0 <= float(v) <= 1 for line in lines for v in line.split()[1:5])
    for name in names[:2]:
        assert cv2.imread(str(out / "vis" / f"{name}.jpg")).shape == cv2.imread(str(images / f"{name}.jpg")).shape
    capture = cv2.VideoCapture(str(out / "vis" / "clip.mp4"))
    decoded = 0
    while capture.read()[0]:
        decoded += 1
    assert decoded == math.ceil(5 / 2)
    # A crop per detection, but for boxes of no pixel (a random model's box can lie flat on the border).
    flat = sum(math.ceil(float(r["xmax"])) <= math.floor(float(r["xmin"]))
               or math.ceil(float(r["ymax"])) <= math.floor(float(r["ymin"])) for r in rows)
    assert len(list((out / "crops").rglob("*.jpg"))) == len(rows) - flat


@pytest.mark.numeric
def test_a_folder_gives_exactly_test_nets_detections(tiny_run, tmp_path):
    cfg = load_cfg(tiny_run.cfg_file, [*tiny_run.opts, "TEST.IMS_PER_BATCH", "4"])
    expected, predicted, _ = detections_of_test_net_and_predict(cfg, tiny_run.val_dir, tiny_run.val_json, tmp_path)
    assert predicted == expected and len(expected) == 6 * PER_PICTURE


def test_a_score_threshold_below_the_models_lowers_its_score_thresh_test(tiny_run):
    """RT-DETR drops detections at MODEL.RTDETR.SCORE_THRESH_TEST inside the model: a lower --score-thresh must
    lower it, or the detections between the two are lost."""
    picture = f"{tiny_run.val_dir}/000001.jpg"
    scores = np.sort(Predictor(predict_cfg(tiny_run.cfg_file, tiny_run.opts))(picture).scores)[::-1]
    high, low = float(scores[4]), float(scores[-5])  # 5th best and 5th worst of the model's 20
    assert high > low
    cfg = predict_cfg(tiny_run.cfg_file, [*tiny_run.opts, f"MODEL.{tiny_run.node}.SCORE_THRESH_TEST", str(high)])
    assert len(Predictor(cfg)(picture)) <= 4  # the model's own threshold (strict) keeps at most the 4 best
    detections = Predictor(cfg, score_thresh=low)(picture)
    assert len(detections) > 4 and low <= detections.scores.min() < high
    assert cfg.MODEL[tiny_run.node].SCORE_THRESH_TEST == high  # the caller's config is left as it is


def test_tiles_hand_the_models_own_detections_of_each_tile_to_the_seam_merge(tiny_run):
    """A 224x288 picture in 128 px tiles (2 x 3). The last class head scores every query 0.88 as a circle and as a
    rectangle: each tile's 20 detections are 10 boxes, each given both classes, as RT-DETR's top (query, class)
    pairs may be. The tiled result keeps both classes of most boxes (the merge joins or drops some pieces of cut
    ones whatever their class), and equals each tile's crop predicted alone,
    moved to the picture's pixels and merged: nothing between the model and the merge suppresses anything.

    An NMS inside a tile that ignores the class (as SAHI's default merge does) drops one class of each box, and
    this test fails. A class-wise NMS at IoU 0.5 inside a tile would change nothing: the seam merge already ends
    with one over every tile's detections (tests/predict/test_tiling.py)."""
    mosaic = np.concatenate([np.concatenate([cv2.imread(f"{tiny_run.val_dir}/00000{r * 2 + c + 1}.jpg")[:112, :144]
                                             for c in range(2)], axis=1) for r in range(2)], axis=0)
    cfg = predict_cfg(tiny_run.cfg_file, [*tiny_run.opts, "TEST.IMS_PER_BATCH", "1"])
    model = Predictor(cfg).model
    with torch.no_grad():
        model.decoder.class_heads[-1].weight.zero_()
        model.decoder.class_heads[-1].bias.copy_(torch.tensor([2.0, 2.0, -5.0]))
    tiled = Predictor(cfg, model=model, label_space=SHAPES, tile=128, tile_overlap=0.25)(mosaic)
    spec = TileSpec(128, 0.25)
    tiles = spec.grid(*mosaic.shape[:2])
    assert len(tiles) == 6
    whole = Predictor(cfg, model=model, label_space=SHAPES)
    per_tile = [whole(mosaic[y0:y1, x0:x1]) for x0, y0, x1, y1 in tiles]
    assert all(len(d) == PER_PICTURE for d in per_tile)
    offsets = torch.from_numpy(tiles[:, [0, 1, 0, 1]]).float()
    boxes = torch.cat([torch.from_numpy(d.boxes) + offset for d, offset in zip(per_tile, offsets)])
    expected = merge_tiles(spec, boxes, torch.cat([torch.from_numpy(d.scores) for d in per_tile]),
                           torch.cat([torch.from_numpy(d.labels) for d in per_tile]),
                           torch.cat([torch.full((PER_PICTURE,), i) for i in range(len(tiles))]), tiles,
                           mosaic.shape[:2])
    # Compared in order: every score is exactly sigmoid(2) whatever the arithmetic (the last class head's weights
    # are zero), so the top-k and the merge take the same (tied) detections in the same order in both runs.
    assert len(tiled) == len(expected[0])
    np.testing.assert_allclose(tiled.boxes, expected[0].numpy(), atol=1e-4)
    np.testing.assert_allclose(tiled.scores, expected[1].numpy(), atol=1e-6)
    assert sorted(tiled.labels.tolist()) == sorted(expected[2].tolist())
    classes_per_box: dict[tuple, set] = {}
    for box, label in zip(tiled.boxes.round(2).tolist(), tiled.labels.tolist()):
        classes_per_box.setdefault(tuple(box), set()).add(label)
    both = sum(found == {1, 2} for found in classes_per_box.values())
    assert both >= len(classes_per_box) / 2, (both, len(classes_per_box))
