"""Keypoints in every output of tools/predict.py that can carry them, from synthetic detections (no model):
csv columns, coco results, json, Ultralytics' pose line with its data.yaml, and vis drawing points and skeleton."""
from __future__ import annotations

import csv
import json

import cv2
import numpy as np
import yaml

from pet.data.categories import LabelSpace
from pet.data.keypoints import KeypointMeta
from pet.predict import PredictionWriter, Source
from pet.predict.predictor import Detections

SPACE = LabelSpace((1, 2), ("box", "blob"))
META = KeypointMeta.build(["top_left", "top_right", "bottom_right"], skeleton=[[1, 2], [2, 3]])
# Two detections in a 100 x 100 picture; points (x, y, score), the score a heatmap logit.
BOXES = np.array([[10, 10, 60, 60], [65, 65, 95, 95]], np.float32)
POINTS = np.array([[[20, 40, 3.5], [50, 40, -1.0], [50, 55, 2.0]], [[70, 80, 1.0], [90, 80, 1.5], [90, 90, 0.5]]],
                  np.float32)


def _write(tmp_path, formats):
    picture = tmp_path / "in" / "a.png"
    picture.parent.mkdir()
    image = np.full((100, 100, 3), 255, np.uint8)
    cv2.imwrite(str(picture), image)
    det = Detections(boxes=BOXES, scores=np.array([0.9, 0.3], np.float32), labels=np.array([1, 2]),
                     names=["box", "blob"], path=str(picture), height=100, width=100, image=image,
                     keypoints=POINTS)
    out = tmp_path / "out"
    with PredictionWriter(str(out), formats, SPACE, Source(str(picture.parent)), keypoints=META) as writer:
        writer.write(det)
    return out


def test_csv_json_and_coco_carry_every_point_with_its_score(tmp_path):
    out = _write(tmp_path, ["csv", "json", "coco"])
    with open(out / "predictions.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0][8:] == ["top_left_x", "top_left_y", "top_left_score", "top_right_x", "top_right_y",
                           "top_right_score", "bottom_right_x", "bottom_right_y", "bottom_right_score"]
    assert [float(v) for v in rows[1][8:]] == POINTS[0].reshape(-1).tolist()
    record = json.loads((out / "json" / "a.json").read_text())
    assert record["keypoint_names"] == list(META.names)
    assert [d["keypoints"] for d in record["detections"]] == POINTS.tolist()
    results = json.loads((out / "predictions.json").read_text())
    assert [r["keypoints"] for r in results] == POINTS.reshape(2, -1).tolist()  # flat x, y, score


def test_yolo_writes_ultralytics_pose_lines_and_a_pose_data_yaml(tmp_path):
    out = _write(tmp_path, ["yolo"])
    lines = (out / "labels" / "a.txt").read_text().splitlines()
    values = [float(v) for v in lines[0].split()]
    assert len(values) == 1 + 4 + 9 + 1 and values[0] == 0 and values[-1] == np.float32(0.9)
    np.testing.assert_allclose(values[1:5], [0.35, 0.35, 0.5, 0.5], rtol=1e-5)
    np.testing.assert_allclose(values[5:14], (POINTS[0] / [100, 100, 1]).reshape(-1), rtol=1e-5)
    data = yaml.safe_load((out / "data.yaml").read_text())
    assert data["kpt_shape"] == [3, 3] and data["flip_idx"] == [1, 0, 2]
    assert data["kpt_names"] == list(META.names)


def test_vis_draws_the_points_and_the_skeleton(tmp_path):
    drawn = cv2.imread(str(_write(tmp_path, ["vis"]) / "vis" / "a.png"))
    for x, y, _ in POINTS[0]:  # the points of the shown detection are dots
        assert (drawn[int(y), int(x)] != 255).any()
    assert (drawn[40, 35] != 255).any() and (drawn[47, 50] != 255).any()  # on its two bones, inside the box
    assert (drawn[30, 35] == 255).all()  # elsewhere inside the box: nothing
    assert (drawn[80, 80] == 255).all()  # the second detection scores under --vis-thresh 0.5: not drawn
