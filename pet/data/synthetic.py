"""A batch of generated pictures shaped as the config's loader shapes a batch, without reading any dataset.

For timing a model before (or without) its data: :mod:`pet.engine.speed_probe` times one step on it to
decide the precision. Pictures in the style of the shapes set (:func:`pet.data.shapes.render_picture`),
of the config's typical size (:func:`pet.utils.model_summary.flops_input_size`: ``MODEL.FLOPS_INPUT_SIZE``,
else 4:3 at the test size), through the config's resize and collator, with boxes, labels (and masks for
a mask model in training, keypoints for a keypoint model) as the loader gives them. Seeded: the same
config gives the same batch.
"""
from __future__ import annotations

import cv2
import numpy as np
import torch
from fvcore.common.config import CfgNode

from pet.data.build import collate_batch, per_process_batch_size
from pet.data.mapper import DatasetMapper, build_augmentations
from pet.data.shapes import mask_polygons, render_picture
from pet.utils.model_summary import flops_input_size

__all__ = ["synthetic_batch"]

# At most this many pixels per batch (the demo's 8 pictures of 256 x 256): a COCO-sized config times one
# 800 x 1067 picture instead of SOLVER.IMS_PER_BATCH of them, which is what makes a probe cost seconds.
PIXEL_BUDGET = 8 * 256 * 256
# When the config gives no size (no resize and no MODEL.FLOPS_INPUT_SIZE): the shapes set's largest pictures.
DEFAULT_SIZE = (256, 256)


def synthetic_batch(cfg: CfgNode, *, training: bool, num_keypoints: int = 0) -> tuple[torch.Tensor, list[dict]]:
    """``(images, targets)`` as the training (``training``) or test loader of ``cfg`` would give them, for one
    process: ``SOLVER.IMS_PER_BATCH`` or ``TEST.IMS_PER_BATCH`` over the processes, capped by
    :data:`PIXEL_BUDGET`; resized by the test transform (no random augmentation). ``num_keypoints`` points per
    object for a model that learns keypoints (the model's ``keypoint_count``)."""
    height, width = flops_input_size(cfg) or DEFAULT_SIZE
    key = "SOLVER.IMS_PER_BATCH" if training else "TEST.IMS_PER_BATCH"
    total = cfg.SOLVER.IMS_PER_BATCH if training else cfg.TEST.IMS_PER_BATCH
    count = max(1, min(per_process_batch_size(total, key), PIXEL_BUDGET // (height * width)))
    mapper = DatasetMapper(build_augmentations(cfg, is_train=False), mask_on=training and bool(cfg.MODEL.MASK_ON))
    num_classes = max(1, int(cfg.MODEL.NUM_CLASSES))
    object_size = [max(4, min(height, width) // 20), max(8, min(height, width) // 3)]
    samples = []
    for index in range(count):
        rng = np.random.default_rng([7, index])
        image, objects = render_picture(rng, height, width, object_size, max_objects=6)
        boxes = [cv2.boundingRect(mask) for _, mask in objects]
        record = {
            "image_id": index + 1,
            "boxes": np.array([[x, y, x + w, y + h] for x, y, w, h in boxes], dtype=np.float32).reshape(-1, 4),
            "labels": [1 + label % num_classes for label, _ in objects],
            "segmentations": [mask_polygons(mask) for _, mask in objects],
        }
        if num_keypoints:
            record["keypoints"] = _keypoints(record["boxes"], num_keypoints)
        samples.append(mapper(record, cv2.cvtColor(image, cv2.COLOR_BGR2RGB), rng))
    return collate_batch(samples, cfg.INPUT.SIZE_DIVISIBILITY)


def _keypoints(boxes: np.ndarray, num_keypoints: int) -> np.ndarray:
    """K visible points per box [N, K, 3], spread over its inside (what a keypoint loss is computed on)."""
    steps = (np.arange(num_keypoints) + 1) / (num_keypoints + 1)
    x0, y0, x1, y1 = (boxes[:, i:i + 1] for i in range(4))
    xs, ys = x0 + (x1 - x0) * steps, y0 + (y1 - y0) * steps[::-1]
    return np.stack([xs, ys, np.full_like(xs, 2.0)], axis=-1).astype(np.float32)
