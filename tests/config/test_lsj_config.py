"""cfgs/coco/mask_rcnn_R-50-FPN_lsj_100ep.yaml: large-scale jitter makes every training sample 1024 x 1024.

Its INPUT.AUGMENTATIONS (v2's ScaleJitter and RandomCrop with padding, Pet's SanitizeBoundingBoxes and flip) go
through the training mapper a loader uses: a 640 x 480 picture comes out 1024 x 1024 whether it was scaled down
(padded) or up (cropped), with its boxes and masks inside the picture and still on their objects.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pet.config import load_cfg
from pet.data.mapper import AugmentedMapper, build_mapper
from support.helpers import CFGS

CFG = os.path.join(CFGS, "coco", "mask_rcnn_R-50-FPN_lsj_100ep.yaml")
HEIGHT, WIDTH = 480, 640
# Three objects that do not overlap, each painted in its own colour on a grey picture: (x0, y0, x1, y1), RGB.
OBJECTS = [((40, 60, 240, 300), (250, 30, 30)), ((300, 100, 420, 180), (30, 250, 30)),
           ((460, 250, 620, 470), (30, 30, 250))]


@pytest.fixture(scope="module")
def mapper() -> AugmentedMapper:
    cfg = load_cfg(CFG)
    assert cfg.MODEL.MASK_ON and cfg.SOLVER.IMS_PER_BATCH == 64 and cfg.SOLVER.MAX_ITER == 184_375
    mapper = build_mapper(cfg, is_train=True)
    assert isinstance(mapper, AugmentedMapper) and mapper.mask_on
    return mapper


def picture() -> tuple[dict, np.ndarray]:
    image = np.full((HEIGHT, WIDTH, 3), 128, dtype=np.uint8)
    boxes, segmentations = [], []
    for (x0, y0, x1, y1), colour in OBJECTS:
        image[y0:y1, x0:x1] = colour
        boxes.append([x0, y0, x1, y1])
        segmentations.append([[x0, y0, x1, y0, x1, y1, x0, y1]])
    record = {"image_id": 1, "boxes": np.asarray(boxes, dtype=np.float32), "labels": np.array([1, 2, 3]),
              "segmentations": segmentations}
    return record, image


def test_every_sample_is_1024_square_with_boxes_and_masks_on_their_objects(mapper):
    record, image = picture()
    padded = cropped = 0
    for seed in range(12):
        sample = mapper(record, image, np.random.default_rng(seed))
        pixels, boxes, labels, masks = sample["image"], sample["boxes"], sample["labels"], sample["masks"]
        assert sample["image_size"] == (1024, 1024) and pixels.shape == (3, 1024, 1024)
        assert sample["orig_size"] == (HEIGHT, WIDTH)
        assert masks.shape == (len(boxes), 1024, 1024) and len(labels) == len(boxes)
        assert (boxes >= 0).all() and (boxes <= 1024).all()
        assert (boxes[:, 2:] > boxes[:, :2]).all()
        for box, label, mask in zip(boxes, labels, masks):
            x0, y0, x1, y1 = box.tolist()
            ys, xs = mask.nonzero(as_tuple=True)
            assert len(xs) and xs.min() >= x0 - 1 and xs.max() <= x1 and ys.min() >= y0 - 1 and ys.max() <= y1
            if min(x1 - x0, y1 - y0) >= 4:  # the pixel at a box's centre is its object's colour
                centre = pixels[:, int((y0 + y1) / 2), int((x0 + x1) / 2)].int()
                colour = torch.tensor(OBJECTS[int(label) - 1][1])
                assert (centre - colour).abs().max() <= 3, (seed, int(label), centre.tolist())
        # The picture has no black pixel: black is padding (scaled below 1024 on a side), none means it was
        # scaled past 1024 x 1024 and cropped.
        black = bool((pixels == 0).all(dim=0).any())
        padded, cropped = padded + black, cropped + (not black)
    assert padded >= 2 and cropped >= 2, (padded, cropped)  # both sides of the jitter were drawn
