"""tools/visualize_data.py --grid on the shapes demo configs with an INPUT.AUGMENTATIONS pipeline from the command
line: one picture of the samples tiled to a known size, and a keypoint set's points drawn where the loader put them.

(The per-image pictures of boxes and masks are tested with the loaders, in tests/data/test_data_loaders.py.)
"""
from __future__ import annotations

import os

import cv2
import numpy as np
import pytest

from pet.data.shapes_keypoints import SHAPE_SKELETON, generate_shapes_keypoints
from pet.utils.visualization import CAPTION_HEIGHT, TILE_GAP, _class_color, keypoint_colors
from support.helpers import CFGS, run_tool_in_process, single_dataset_opts
from tools.visualize_data import samples, tool_cfg

MASK_CFG = os.path.join(CFGS, "shapes", "mask_rcnn_R-18-FPN.yaml")
KEYPOINT_CFG = os.path.join(CFGS, "shapes", "keypoint_rcnn_R-10-FPN.yaml")
# A colour drawn at a point matches within this much per channel (the dot's centre is drawn solid).
TOLERANCE = 10


def _rgb(path) -> np.ndarray:
    picture = cv2.imread(str(path))
    assert picture is not None, f"{path} is not a readable picture"
    return cv2.cvtColor(picture, cv2.COLOR_BGR2RGB)


def _near(pixel: np.ndarray, color, tolerance: int = TOLERANCE) -> bool:
    return bool(np.all(np.abs(pixel.astype(int) - np.array(color)) <= tolerance))


def test_grid_tiles_the_augmented_samples_letterboxed_with_captions(shapes_root, tmp_path, monkeypatch, capsys):
    """5 samples at 3 columns: 2 rows of 200 px tiles under their captions; the pipeline's 320x240 (h x w)
    pictures are letterboxed into the square tiles (grey side bars), the sixth cell stays empty."""
    out = tmp_path / "vis"
    pipeline = "[{'type': 'RandomIoUCrop'}, {'type': 'RandomHorizontalFlip'}, {'type': 'Resize', 'size': [320, 240]}]"
    proc = run_tool_in_process(
        monkeypatch, capsys, "visualize_data.py", "--cfg", MASK_CFG, "--num", 5, "--out", out, "--grid",
        "--tile-size", 200, "--cols", 3, *single_dataset_opts(f"{shapes_root}/annotations/train.json",
                                                              f"{shapes_root}/train"),
        "INPUT.AUGMENTATIONS", pipeline)
    assert proc.returncode == 0, proc.stderr
    singles = sorted(f for f in os.listdir(out) if f.startswith("train_"))
    assert len(singles) == 5
    assert all(_rgb(out / f).shape == (320, 240, 3) for f in singles)  # the command line's pipeline ran
    grid = _rgb(out / "grid_train.png")
    assert grid.shape == (2 * (200 + CAPTION_HEIGHT) + TILE_GAP, 3 * 200 + 2 * TILE_GAP, 3)
    for cell in range(6):
        top, left = (cell // 3) * (200 + CAPTION_HEIGHT + TILE_GAP), (cell % 3) * (200 + TILE_GAP)
        caption, tile = grid[top:top + CAPTION_HEIGHT, left:left + 200], grid[top + CAPTION_HEIGHT:top + 218,
                                                                              left:left + 200]
        if cell == 5:
            assert not caption.any() and not tile.any()
            continue
        assert (caption > 200).all(axis=-1).sum() > 50  # white caption text on the black strip
        # 320x240 scaled to 200x150, centred: 25 grey columns each side, the picture between them.
        assert (tile[:, :25] == 96).all() and (tile[:, -25:] == 96).all()
        assert not (tile[:, 26:-26] == 96).all()
        picture = cv2.resize(_rgb(out / singles[cell]), (150, 200), interpolation=cv2.INTER_AREA)
        assert np.abs(tile[:, 25:-25].astype(int) - picture).mean() < 1  # the cell holds its sample, in order


@pytest.fixture
def keypoint_opts(shapes_root, tmp_path) -> list[str]:
    """The keypoint demo's corner annotations of the small set, a flip (always) and a resize to 256x256."""
    kp_root = generate_shapes_keypoints(str(tmp_path / "shapes_kp"), shapes_root)
    pipeline = "[{'type': 'RandomHorizontalFlip', 'p': 1.0}, {'type': 'Resize', 'size': [256, 256]}]"
    return [*single_dataset_opts(f"{kp_root}/annotations/train.json", f"{shapes_root}/train", name="kp_vis"),
            "INPUT.AUGMENTATIONS", pipeline]


def test_keypoints_are_drawn_in_their_point_colours_where_the_loader_put_them(keypoint_opts, tmp_path, monkeypatch,
                                                                               capsys):
    """Each labelled point's centre has its index's colour, in the sample's picture and in the grid (tiles of the
    pictures' own size: pixel for pixel); an unlabelled point (visibility 0) leaves no dot; a triangle's skeleton
    edges (its outline) are drawn in the box's colour."""
    out = tmp_path / "vis"
    proc = run_tool_in_process(monkeypatch, capsys, "visualize_data.py", "--cfg", KEYPOINT_CFG, "--num", 4,
                               "--out", out, "--grid", "--tile-size", 256, "--cols", 2, *keypoint_opts)
    assert proc.returncode == 0, proc.stderr
    drawn = [s for s, _ in zip(samples(tool_cfg(KEYPOINT_CFG, keypoint_opts), "train"), range(4))]
    grid = _rgb(out / "grid_train.png")
    colors = keypoint_colors(7)
    triangle = _class_color("triangle")
    hits = misses = unlabelled = edges = edges_drawn = 0
    for i, (sample, _dataset) in enumerate(drawn):
        picture = _rgb(out / f"train_{i:03d}_id{sample['image_id']}.png")
        top, left = (i // 2) * (256 + CAPTION_HEIGHT + TILE_GAP) + CAPTION_HEIGHT, (i % 2) * (256 + TILE_GAP)
        tile = grid[top:top + 256, left:left + 256]
        np.testing.assert_array_equal(tile, picture)
        points = sample["keypoints"].numpy()
        labelled_xy = points[points[..., 2] > 0][:, :2]
        for instance, label in zip(points, sample["labels"].tolist()):
            for k, (x, y, v) in enumerate(instance):
                col, row = min(int(round(x)), 255), min(int(round(y)), 255)
                if v > 0:
                    hit = _near(picture[row, col], colors[k])
                    hits, misses = hits + hit, misses + (not hit)
                elif len(labelled_xy) == 0 or np.hypot(*(labelled_xy - (x, y)).T).min() > 6:
                    unlabelled += 1  # no labelled point's dot nearby: nothing may have been drawn here
                    assert not any(_near(picture[row, col], c) for c in colors), (i, k, x, y)
            if label == 3:  # triangle: its skeleton pairs are its outline, diagonal to the box's edges
                for a, b in SHAPE_SKELETON[4:]:
                    if instance[a - 1, 2] > 0 and instance[b - 1, 2] > 0:
                        mx, my = (int(round(c)) for c in (instance[a - 1, :2] + instance[b - 1, :2]) / 2)
                        around = picture[max(my - 1, 0):my + 2, max(mx - 1, 0):mx + 2].reshape(-1, 3)
                        edges += 1
                        edges_drawn += any(_near(p, triangle, 40) for p in around)
    assert hits + misses >= 10 and unlabelled >= 10 and edges >= 3
    assert hits >= 0.8 * (hits + misses)  # a later object's dot may cover an earlier one's
    assert edges_drawn >= 0.8 * edges
