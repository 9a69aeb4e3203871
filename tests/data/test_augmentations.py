"""INPUT.AUGMENTATIONS: transforms move boxes, masks and keypoints together; samples depend on their seed alone;
scheduled transforms switch off at the same batch in a resumed run; bad entries get one clear line."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pet.config import load_cfg
from pet.data import build_train_loader
from pet.data.augmentations import build_pipeline
from pet.data.mapper import AugmentedMapper, DatasetMapper, build_mapper
from pet.utils.errors import ConfigError
from support.helpers import DEMO_CFG, data_cfg, register_split, run_tool_here, tiny_set_opts
from support.tiny_models import TINY_TWO_STAGE

HEIGHT, WIDTH = 60, 80
FLIP_MAP = [0, 2, 1]  # centre, left, right


def _record() -> dict:
    """Three objects with rectangle masks (as polygons) and three keypoints each: the centre, a left and a right
    point, all labelled; the third box is tiny (0.5 px wide)."""
    boxes = np.array([[10, 8, 40, 30], [45, 20, 75, 55], [5, 40, 5.5, 50]], dtype=np.float32)
    polygons = [[[x0, y0, x1, y0, x1, y1, x0, y1]] for x0, y0, x1, y1 in boxes.tolist()]
    keypoints = np.array([[[(x0 + x1) / 2, (y0 + y1) / 2, 2], [x0 + 0.25 * (x1 - x0), (y0 + y1) / 2, 2],
                           [x0 + 0.75 * (x1 - x0), (y0 + y1) / 2, 2]] for x0, y0, x1, y1 in boxes.tolist()],
                         dtype=np.float32)
    return {"image_id": 7, "boxes": boxes, "labels": np.array([1, 2, 3]), "segmentations": polygons,
            "keypoints": keypoints, "height": HEIGHT, "width": WIDTH}


def _image(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8)


def _mapped(specs: list[dict], seed: int) -> dict:
    mapper = AugmentedMapper(build_pipeline(specs, keypoint_flip_map=FLIP_MAP), mask_on=True)
    return mapper(_record(), _image(), np.random.default_rng(seed))


GEOMETRIC = {
    "hflip": [{"type": "RandomHorizontalFlip", "p": 1.0}],
    "vflip": [{"type": "RandomVerticalFlip", "p": 1.0}],
    "zoom_out": [{"type": "RandomZoomOut", "p": 1.0, "side_range": [1.5, 2.5]}],
    "iou_crop": [{"type": "RandomIoUCrop", "p": 1.0}, {"type": "SanitizeBoundingBoxes"}],
    "stretch": [{"type": "Resize", "size": [50, 120]}],
    "multi_scale": [{"type": "RandomShortestSize", "min_size": [40, 90], "max_size": 150}],
    "lsj": [{"type": "ScaleJitter", "target_size": [64, 64], "scale_range": [0.3, 2.0]},
            {"type": "RandomCrop", "size": [64, 64], "pad_if_needed": True}, {"type": "SanitizeBoundingBoxes"}],
    "rt_detr": [{"type": "RandomPhotometricDistort", "p": 0.5}, {"type": "RandomZoomOut", "fill": 0},
                {"type": "RandomIoUCrop", "p": 0.8}, {"type": "SanitizeBoundingBoxes", "min_size": 1},
                {"type": "RandomHorizontalFlip"}, {"type": "Resize", "size": [64, 64]},
                {"type": "SanitizeBoundingBoxes", "min_size": 1}],
}


@pytest.mark.parametrize("name", sorted(GEOMETRIC))
def test_boxes_masks_and_keypoints_move_together(name):
    """Over many seeds: each kept box is its mask's bounding box (the masks are the boxes' rectangles), each
    labelled point lies in its box, and the left point stays left of the right one (flips renumber)."""
    changed = 0
    for seed in range(25):
        sample = _mapped(GEOMETRIC[name], seed)
        h, w = sample["image_size"]
        assert sample["image"].shape == (3, h, w) and sample["image"].dtype == torch.uint8
        boxes, masks, points = sample["boxes"], sample["masks"], sample["keypoints"]
        assert len(boxes) == len(masks) == len(points) == len(sample["labels"])
        assert masks.shape[1:] == (h, w)
        for box, mask, pts, label in zip(boxes, masks, points, sample["labels"]):
            if label == 3:  # the tiny object: under a pixel wide, its mask may vanish; only a sanitize drops it
                continue
            ys, xs = torch.nonzero(mask, as_tuple=True)
            assert len(xs), f"seed {seed}: an empty mask kept with box {box.tolist()}"
            mask_box = torch.tensor([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], dtype=torch.float32)
            assert (mask_box - box).abs().max() <= 2.0, (seed, box.tolist(), mask_box.tolist())
            labelled = pts[pts[:, 2] > 0]
            assert ((labelled[:, 0] >= box[0] - 1) & (labelled[:, 0] <= box[2] + 1)
                    & (labelled[:, 1] >= box[1] - 1) & (labelled[:, 1] <= box[3] + 1)).all(), (seed, pts.tolist())
            if pts[1, 2] > 0 and pts[2, 2] > 0:
                assert pts[1, 0] < pts[2, 0], f"seed {seed}: left point right of the right one: {pts.tolist()}"
        changed += (h, w) != (HEIGHT, WIDTH) or not torch.equal(boxes, torch.from_numpy(_record()["boxes"][:2]))
    assert changed > 0


def test_a_horizontal_flip_mirrors_points_and_renumbers_them_by_the_flip_map():
    sample = _mapped([{"type": "RandomHorizontalFlip", "p": 1.0}], seed=0)
    centre, left, right = sample["keypoints"][0].tolist()
    # The first object spans x 10-40: mirrored in 80 px it spans 40-70; its left point (x 17.5) was on the right.
    assert sample["boxes"][0].tolist() == [40.0, 8.0, 70.0, 30.0]
    assert centre[:2] == [55.0, 19.0] and left[:2] == [47.5, 19.0] and right[:2] == [62.5, 19.0]
    assert sample["masks"][0, 19, 40:70].all() and not sample["masks"][0, 19, :40].any()


def test_a_flip_without_the_flip_map_says_what_is_missing():
    pipeline = build_pipeline([{"type": "RandomHorizontalFlip", "p": 1.0}])
    with pytest.raises(ConfigError, match="flip map"):
        AugmentedMapper(pipeline)(_record(), _image(), np.random.default_rng(0))


def test_sanitize_removes_a_box_with_its_label_mask_and_keypoints():
    sample = _mapped([{"type": "SanitizeBoundingBoxes", "min_size": 1}], seed=0)
    assert sample["labels"].tolist() == [1, 2]
    assert sample["boxes"].tolist() == _record()["boxes"][:2].tolist()
    assert len(sample["masks"]) == len(sample["keypoints"]) == 2
    assert sample["keypoints"][1, 0, :2].tolist() == [60.0, 37.5]  # the second object's centre, not the third's


def test_photometric_distortion_changes_pixels_not_geometry():
    spec = [{"type": "RandomPhotometricDistort", "p": 1.0, "hue": [-0.1, 0.1]}]
    plain = _mapped([], seed=3)
    distorted = _mapped(spec, seed=3)
    assert not torch.equal(distorted["image"], plain["image"])
    for key in ("boxes", "masks", "keypoints", "labels"):
        assert torch.equal(distorted[key], plain[key]), key


def test_a_sample_depends_on_its_seed_alone_and_leaves_the_process_stream_alone():
    spec = GEOMETRIC["rt_detr"]
    torch.manual_seed(11)
    untouched = torch.rand(1)
    torch.manual_seed(11)
    first = _mapped(spec, seed=5)
    assert torch.rand(1) == untouched  # the pipeline drew from its own forked stream
    torch.manual_seed(12)
    again = _mapped(spec, seed=5)
    for key in ("image", "boxes", "masks", "keypoints", "labels"):
        assert torch.equal(first[key], again[key]), key
    others = [_mapped(spec, seed=s) for s in range(6, 12)]
    assert any(o["image"].shape != first["image"].shape or not torch.equal(o["image"], first["image"])
               for o in others)


def test_a_transform_of_ones_own_by_dotted_path():
    sample = _mapped([{"type": "support.plugin_transforms.Invert"}], seed=0)
    assert torch.equal(sample["image"], torch.from_numpy(255 - _image()).permute(2, 0, 1))


@pytest.mark.parametrize("spec, message", [
    ({"type": "RandomZoomOutt"}, "Did you mean 'RandomZoomOut'"),
    ({"type": "RandomZoomOut", "fil": 0}, "no argument 'fil'. Did you mean 'fill'"),
    ({"type": "RandomZoomOut", "side_range": [0.5, 1.0]}, r"INPUT.AUGMENTATIONS\[0\] \(RandomZoomOut\)"),
    ({"type": "RandomIoUCrop", "until_epoch": -1}, r"until_epoch must be a whole number"),
    ({"type": "RandomIoUCrop", "from_iter": 5, "until_iter": 5}, "never on: from_iter 5 is not before until_iter 5"),
    ({"p": 0.5}, "has no 'type'"),
    ("RandomZoomOut", "must be a mapping"),
])
def test_a_bad_entry_is_one_clear_line(spec, message):
    with pytest.raises(ConfigError, match=message):
        build_pipeline([spec])


def test_without_augmentations_the_training_mapper_and_keys_are_todays(shapes_root):
    cfg = data_cfg("TRAIN.DATASETS", f"('{register_split(shapes_root, 'train')}',)")
    assert type(build_mapper(cfg, is_train=True)) is DatasetMapper
    loader = build_train_loader(cfg)
    keys = next(iter(loader.batch_sampler))
    assert all(len(key) == 2 for key in keys)  # (index, seed): no progress stamp


def _zoom_out_until(cfg, key: str, value: int):
    """RandomZoomOut doubling every side while ``key`` (until_iter / from_iter / until_epoch) allows it."""
    cfg.INPUT.AUGMENTATIONS = [{"type": "RandomZoomOut", "p": 1.0, "side_range": [2.0, 2.0], key: value}]
    return cfg


def _batches(cfg, start: int, count: int) -> list[tuple]:
    loader = build_train_loader(cfg)
    loader.set_start_iter(start)
    stream = iter(loader)
    return [next(stream) for _ in range(count)]


@pytest.mark.parametrize("key, workers", [("until_iter", 0), ("until_iter", 1), ("from_iter", 0)])
def test_a_scheduled_transform_switches_at_its_iteration_and_a_resumed_run_sees_the_same_batches(
        shapes_root, key, workers):
    cfg = _zoom_out_until(data_cfg("TRAIN.DATASETS", f"('{register_split(shapes_root, 'train')}',)",
                                   "SOLVER.IMS_PER_BATCH", 2, "DATA.NUM_WORKERS", workers), key, 3)
    uninterrupted = _batches(cfg, 0, 6)
    sizes = [max(t["image_size"][0] for t in targets) for _, targets in uninterrupted]
    # Shapes images are 128-256 px: doubled before iteration 3 (until_iter) or from it on (from_iter).
    doubled, plain = (sizes[:3], sizes[3:]) if key == "until_iter" else (sizes[3:], sizes[:3])
    assert min(doubled) >= 256 and max(plain) <= 256
    resumed = _batches(cfg, 2, 4)  # resumes before the switch and goes past it
    for (images, targets), (expected_images, expected_targets) in zip(resumed, uninterrupted[2:]):
        assert torch.equal(images, expected_images)
        for ours, theirs in zip(targets, expected_targets):
            assert ours["image_id"] == theirs["image_id"] and torch.equal(ours["boxes"], theirs["boxes"])


def test_an_epoch_schedule_counts_the_loaders_passes(shapes_root):
    cfg = _zoom_out_until(data_cfg("TRAIN.DATASETS", f"('{register_split(shapes_root, 'train')}',)",
                                   "SOLVER.IMS_PER_BATCH", 4, "SOLVER.MAX_ITER", 0, "SOLVER.MAX_EPOCHS", 2),
                          "until_epoch", 1)
    loader = build_train_loader(cfg)
    sizes = []
    for epoch in range(2):
        loader.batch_sampler.set_epoch(epoch)
        sizes.append([max(t["image_size"][0] for t in targets) for _, targets in loader])
    assert len(sizes[0]) == 3 and min(sizes[0]) >= 256 and max(sizes[1]) <= 256


def test_a_fixed_test_size_stretches_every_image(shapes_root):
    cfg = data_cfg("INPUT.FIXED_SIZE_TEST", (96, 160))
    mapper = build_mapper(cfg, is_train=False)
    sample = mapper(_record(), _image(), np.random.default_rng(0))
    assert sample["image_size"] == (96, 160) and sample["orig_size"] == (HEIGHT, WIDTH)
    assert sample["boxes"][0].tolist() == pytest.approx([20.0, 12.8, 80.0, 48.0])  # x by 2, y by 1.6


def test_the_list_on_the_command_line_in_yaml_or_python_form():
    for text in ("[{type: Resize, size: [50, 120]}, {type: RandomHorizontalFlip, p: 1.0}]",
                 "[{'type': 'Resize', 'size': [50, 120]}, {'type': 'RandomHorizontalFlip', 'p': 1.0}]"):
        cfg = load_cfg(None, ["INPUT.AUGMENTATIONS", text])
        assert cfg.INPUT.AUGMENTATIONS == [{"type": "Resize", "size": [50, 120]},
                                           {"type": "RandomHorizontalFlip", "p": 1.0}]
        assert [type(t).__name__ for t in build_pipeline(cfg.INPUT.AUGMENTATIONS).transforms] == [
            "Resize", "RandomHorizontalFlip"]


@pytest.mark.slow
def test_training_resumed_before_the_switch_ends_with_the_uninterrupted_weights(tiny_set, tmp_path, monkeypatch,
                                                                               capsys):
    """train_net for 4 iterations with mosaic and zoom-out switched off from iteration 3, and the same run resumed
    from its iteration-2 checkpoint: the same final weights (the resumed loader stamps iterations 2 and 3 as the
    straight one did, and draws the same extra images)."""
    ckpt = str(tmp_path / "run")
    pipeline = ("[{type: Mosaic, size: 128, until_iter: 3}, {type: RandomZoomOut, p: 1.0, until_iter: 3}, "
                "{type: RandomHorizontalFlip}]")
    opts = [*tiny_set_opts(tiny_set, ckpt, max_iter=4, checkpoint_period=2), *TINY_TWO_STAGE,
            "INPUT.AUGMENTATIONS", pipeline, "SOLVER.AMP.ENABLED", "False", "TRAIN.AUTO_RESUME", "True",
            "HOOKS.EVAL.PERIOD", "0"]
    assert run_tool_here(monkeypatch, capsys, "train_net.py", "--cfg", DEMO_CFG, *opts)[0] == 0
    straight = torch.load(os.path.join(ckpt, "model_final.pth"), weights_only=True)["model"]
    os.remove(os.path.join(ckpt, "model_final.pth"))
    with open(os.path.join(ckpt, "last_checkpoint"), "w") as f:
        f.write("model_iter2.pth")
    assert run_tool_here(monkeypatch, capsys, "train_net.py", "--cfg", DEMO_CFG, *opts)[0] == 0
    with open(os.path.join(ckpt, "log.txt")) as f:
        assert "Starting training from iteration 2 to 4" in f.read()
    resumed = torch.load(os.path.join(ckpt, "model_final.pth"), weights_only=True)["model"]
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
