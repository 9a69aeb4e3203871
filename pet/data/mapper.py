"""Turns a dataset record and its decoded image into one model-ready sample."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from fvcore.common.config import CfgNode

from pet.data.transforms import Augmentation, RandomFlip, ResizeShortestEdge, apply_augmentations

__all__ = ["DatasetMapper", "build_augmentations"]


def build_augmentations(cfg: CfgNode, is_train: bool) -> list[Augmentation]:
    """Resize (multi-scale when INPUT.MIN_SIZE_TRAIN lists several sizes) and, in training, horizontal flip."""
    if is_train:
        augs: list[Augmentation] = [ResizeShortestEdge(cfg.INPUT.MIN_SIZE_TRAIN, cfg.INPUT.MAX_SIZE_TRAIN)]
        if cfg.INPUT.FLIP_PROB > 0:
            augs.append(RandomFlip(cfg.INPUT.FLIP_PROB))
        return augs
    return [ResizeShortestEdge(cfg.INPUT.MIN_SIZE_TEST, cfg.INPUT.MAX_SIZE_TEST)]


class DatasetMapper:
    """Applies the augmentations to the image and its boxes and packs the sample of the batch contract.

    The sample is ``{"image": uint8 [3, H, W] RGB, "image_id", "image_size": (h, w) after resize,
    "orig_size": (h, w) decoded, "boxes": float32 [N, 4] XYXY in resized pixels, "labels": int64 [N]}``.
    """

    def __init__(self, augmentations: Sequence[Augmentation]) -> None:
        self.augmentations = list(augmentations)

    def __call__(self, record: dict[str, Any], image: np.ndarray, rng: np.random.Generator) -> dict[str, Any]:
        orig_size = (int(image.shape[0]), int(image.shape[1]))
        image, transform = apply_augmentations(self.augmentations, image, rng)
        h, w = image.shape[:2]
        boxes = transform.apply_boxes(record["boxes"])
        np.clip(boxes, 0, [w, h, w, h], out=boxes)
        return {
            "image": torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1))),
            "image_id": int(record["image_id"]),
            "image_size": (int(h), int(w)),
            "orig_size": orig_size,
            "boxes": torch.from_numpy(boxes),
            "labels": torch.from_numpy(np.asarray(record["labels"], dtype=np.int64)),
        }
