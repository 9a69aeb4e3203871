"""Data transforms: resize, flip and colour jitter on images, boxes and masks (polygons and RLE)."""
from __future__ import annotations

import itertools

import numpy as np
import pycocotools.mask as mask_util
import pytest
import torch

from pet.data import build_train_loader, load_coco_json
from pet.data.transforms import ColorTransform, HFlipTransform, RandomFlip, ResizeShortestEdge, apply_augmentations
from pet.utils.errors import ConfigError, DataError
from support.helpers import data_cfg, register_split, write_coco

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
    name = register_split(shapes_root, "train")

    def first_batch(*opts):
        return next(iter(build_train_loader(data_cfg("TRAIN.DATASETS", (name,), *opts))))

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
    name = register_split(shapes_root, "train")
    loader = build_train_loader(data_cfg("TRAIN.DATASETS", (name,), "MODEL.MASK_ON", True, "INPUT.FLIP_PROB", flip))
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
    name, *_ = write_coco(tmp_path, annotations=annotations,
                           categories=[{"id": 7, "name": "seven"}, {"id": 3, "name": "three"}])
    cfg = data_cfg("TRAIN.DATASETS", (name,), "SOLVER.IMS_PER_BATCH", 1, "MODEL.MASK_ON", True, "INPUT.MIN_SIZE_TRAIN",
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
    name, json_file, _ = write_coco(tmp_path)  # boxes only
    cfg = data_cfg("TRAIN.DATASETS", (name,), "MODEL.MASK_ON", True, num_classes=1)
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
    _, json_file, image_dir = write_coco(tmp_path, annotations=annotations)
    with pytest.raises(DataError, match=message):
        load_coco_json(json_file, image_dir)
