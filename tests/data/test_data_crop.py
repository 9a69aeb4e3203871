"""INPUT.CROP: a fixed-size training crop before the resize, placed at random or around an object; boxes clipped to
it and dropped below a visible fraction, masks cropped with them."""
from __future__ import annotations

import uuid

import numpy as np
import pycocotools.mask as mask_util
import pytest

from pet.data import build_train_loader, register_dataset
from pet.data.mapper import DatasetMapper, build_augmentations
from pet.data.transforms import Augmentation, CropTransform, NoOpTransform, RandomCrop, ResizeShortestEdge
from pet.utils.errors import ConfigError
from support.helpers import data_cfg


class FixedCrop(Augmentation):
    def __init__(self, x0: int, y0: int, width: int, height: int) -> None:
        self.transform = CropTransform(x0, y0, width, height)

    def get_transform(self, height, width, rng):
        return self.transform


def _record(boxes, segmentations=None, size=(100, 120)):
    boxes = np.asarray(boxes, np.float32).reshape(-1, 4)
    return {"image_id": 1, "file_name": "x.jpg", "height": size[0], "width": size[1], "boxes": boxes,
            "labels": np.arange(1, len(boxes) + 1, dtype=np.int64),
            "segmentations": segmentations if segmentations is not None else [None] * len(boxes)}


def test_a_crop_clips_boxes_and_drops_those_left_with_less_than_the_visible_fraction():
    image = np.random.default_rng(0).integers(0, 255, (100, 120, 3), dtype=np.uint8)
    boxes = [[10, 10, 30, 30],   # wholly inside the window [20, 60) x [20, 70): a quarter visible -> dropped
             [25, 25, 45, 45],   # inside: kept as is, shifted
             [50, 40, 70, 60],   # half inside (x 50..60 of 50..70): kept, clipped
             [55, 40, 75, 60],   # a quarter inside: dropped
             [90, 80, 110, 95]]  # outside: dropped
    mapper = DatasetMapper([FixedCrop(20, 20, 40, 50)], min_visible=0.5)
    sample = mapper(_record(boxes), image, np.random.default_rng(0))
    assert sample["image_size"] == (50, 40)
    np.testing.assert_array_equal(sample["image"].permute(1, 2, 0).numpy(), image[20:70, 20:60])
    assert sample["boxes"].tolist() == [[5, 5, 25, 25], [30, 20, 40, 40]]
    assert sample["labels"].tolist() == [2, 3]
    loose = DatasetMapper([FixedCrop(20, 20, 40, 50)], min_visible=0.0)(_record(boxes), image, None)
    assert loose["labels"].tolist() == [1, 2, 3, 4]  # any visible part is kept; the one outside never is


def test_masks_are_cropped_with_their_boxes_polygons_and_rle():
    image = np.zeros((100, 120, 3), np.uint8)
    polygon = [np.array([30, 30, 50, 30, 50, 60, 30, 60], np.float64)]  # box 30..50 x 30..60
    full = np.zeros((100, 120), np.uint8)
    full[10:40, 70:110] = 1
    rle = mask_util.encode(np.asfortranarray(full))
    rle["counts"] = rle["counts"].decode()
    cut_away = [np.array([0, 0, 10, 0, 10, 10, 0, 10], np.float64)]
    record = _record([[30, 30, 50, 60], [70, 10, 110, 40], [0, 0, 10, 10]], [polygon, rle, cut_away])
    mapper = DatasetMapper([FixedCrop(25, 5, 70, 50)], mask_on=True, min_visible=0.5)
    sample = mapper(record, image, np.random.default_rng(0))
    masks = sample["masks"].numpy()
    assert sample["labels"].tolist() == [1, 2] and masks.shape == (2, 50, 70)
    assert masks[0].sum() == 20 * 25 and masks[0][25:55 - 5, 5:25].all()  # rows 30..55 of 30..60 remain
    np.testing.assert_array_equal(masks[1], full[5:55, 25:95])
    boxes = sample["boxes"].numpy()
    for mask, box in zip(masks, boxes):  # each mask lies in its clipped box
        ys, xs = np.nonzero(mask)
        assert box[0] <= xs.min() and xs.max() < box[2] and box[1] <= ys.min() and ys.max() < box[3]


def test_random_crop_stays_in_the_image_and_keeps_a_side_smaller_than_the_crop():
    crop = RandomCrop(64, 80)
    rng = np.random.default_rng(0)
    starts = set()
    for _ in range(200):
        t = crop.get_transform(100, 90, rng)
        assert 0 <= t.x0 <= 10 and 0 <= t.y0 <= 36 and (t.width, t.height) == (80, 64)
        starts.add((t.x0, t.y0))
    assert len(starts) > 100  # spread over the image
    t = crop.get_transform(50, 200, rng)
    assert (t.height, t.y0) == (50, 0) and t.width == 80  # the 50 px side is kept whole
    assert isinstance(crop.get_transform(40, 60, rng), NoOpTransform)


def test_around_an_object_the_window_holds_the_object_or_lies_inside_it():
    crop = RandomCrop(50, 50, around_object_prob=1.0)
    rng = np.random.default_rng(1)
    small, large = np.array([[300.0, 200.0, 320.0, 230.0]]), np.array([[100.0, 100.0, 260.0, 180.0]])
    for _ in range(100):
        t = crop.get_transform(400, 500, rng, boxes=small)
        assert t.x0 <= 300 and t.x0 + 50 >= 320 and t.y0 <= 200 and t.y0 + 50 >= 230
        t = crop.get_transform(400, 500, rng, boxes=large)
        assert 100 <= t.x0 <= 210 and 100 <= t.y0 <= 130
    uniform = RandomCrop(50, 50, around_object_prob=0.0)
    windows = [uniform.get_transform(400, 500, rng, boxes=small) for _ in range(100)]
    assert sum(t.x0 <= 300 and t.x0 + 50 >= 320 for t in windows) < 20  # without it the object is mostly outside


def test_the_crop_comes_before_the_resize_in_training_only(tmp_path):
    import cv2

    cv2.imwrite(str(tmp_path / "big.png"), np.full((300, 400, 3), 60, np.uint8))
    (tmp_path / "boxes.csv").write_text("big.png,150,120,190,170,tree\n")
    name = f"big_{uuid.uuid4().hex[:8]}"
    register_dataset(name, str(tmp_path / "boxes.csv"), format="csv")
    cfg = data_cfg("TRAIN.DATASETS", (name,), "INPUT.CROP.ENABLED", True, "INPUT.CROP.SIZE", (100, 120),
                   "INPUT.CROP.AROUND_OBJECT_PROB", 1.0, "INPUT.MIN_SIZE_TRAIN", (50,), "INPUT.MAX_SIZE_TRAIN", 1000,
                   "SOLVER.IMS_PER_BATCH", 1, "DATA.SIZE_GROUPING", True, num_classes=1)
    augs = build_augmentations(cfg, is_train=True)
    assert isinstance(augs[0], RandomCrop) and isinstance(augs[1], ResizeShortestEdge)
    assert not any(isinstance(a, RandomCrop) for a in build_augmentations(cfg, is_train=False))
    images, targets = next(iter(build_train_loader(cfg)))
    assert targets[0]["image_size"] == (50, 60)  # 100x120 crop, then the shorter side to 50
    assert targets[0]["boxes"].shape == (1, 4)  # around the object: it is whole, at half scale
    x0, y0, x1, y1 = targets[0]["boxes"][0].tolist()
    assert (x1 - x0, y1 - y0) == pytest.approx((20, 25))
    cfg.INPUT.CROP.SIZE = (100,)
    with pytest.raises(ConfigError, match=r"INPUT.CROP.SIZE must be \(height, width\)"):
        build_train_loader(cfg)
