"""Turns a dataset record and its decoded image into one model-ready sample."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pycocotools.mask as mask_util
import torch
from fvcore.common.config import CfgNode

from pet.data.transforms import (
    Augmentation,
    RandomColorJitter,
    RandomFlip,
    ResizeShortestEdge,
    Transform,
    apply_augmentations,
)
from pet.utils.errors import ConfigError

__all__ = ["DatasetMapper", "build_augmentations", "segmentations_to_masks"]


def build_augmentations(cfg: CfgNode, is_train: bool) -> list[Augmentation]:
    """Resize (multi-scale when INPUT.MIN_SIZE_TRAIN lists several sizes) and, in training, horizontal flip
    and colour jitter (when INPUT.BRIGHTNESS / CONTRAST / SATURATION are not all 0)."""
    if not is_train:
        return [ResizeShortestEdge(cfg.INPUT.MIN_SIZE_TEST, cfg.INPUT.MAX_SIZE_TEST)]
    augs: list[Augmentation] = [ResizeShortestEdge(cfg.INPUT.MIN_SIZE_TRAIN, cfg.INPUT.MAX_SIZE_TRAIN)]
    if cfg.INPUT.FLIP_PROB > 0:
        augs.append(RandomFlip(cfg.INPUT.FLIP_PROB))
    jitter = (cfg.INPUT.BRIGHTNESS, cfg.INPUT.CONTRAST, cfg.INPUT.SATURATION)
    for key, value in zip(("BRIGHTNESS", "CONTRAST", "SATURATION"), jitter):
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"INPUT.{key} must be in [0, 1] (a factor is drawn from [1 - x, 1 + x]), got {value}.")
    if any(jitter):  # after the resize: the jitter then touches fewer pixels when images shrink
        augs.append(RandomColorJitter(*jitter))
    return augs


class DatasetMapper:
    """Applies the augmentations to the image and its annotations and packs one sample of the batch contract.

    The sample is a dict:

    - ``image``: uint8 [3, h, w] RGB after the transforms, a channels-last view of the opencv pixels
      (not yet padded; the collator pads the batch);
    - ``image_id``: the COCO image id;
    - ``image_size``: (h, w) after the transforms; ``orig_size``: (h, w) as decoded;
    - ``boxes``: float32 [N, 4] XYXY in the pixels of ``image``, clipped to it; crowd and dropped
      annotations are not there;
    - ``labels``: int64 [N] the record's labels: in a loader, the model's (``MODEL.LABEL_SPACE``; the
      :class:`~pet.data.dataset.DetectionDataset` maps records into its ``label_space``, whose
      ``category_id(label)`` gives each one's category id);
    - ``masks`` (only with ``mask_on``): uint8 [N, h, w] of 0/1, mask i belongs to box i.

    Masks are decoded with pycocotools. Polygons go through the same coordinate transform as the
    boxes and are rasterised at the final size; RLE masks are decoded at the original size and
    resized / flipped like the image with nearest-neighbour interpolation.
    """

    def __init__(self, augmentations: Sequence[Augmentation], *, mask_on: bool = False) -> None:
        self.augmentations = list(augmentations)
        self.mask_on = mask_on

    @classmethod
    def from_config(cls, cfg: CfgNode, is_train: bool, *, mask_on: bool | None = None) -> DatasetMapper:
        """The mapper train/test loaders use. Masks default to MODEL.MASK_ON in training and to off in
        testing (COCO evaluation reads the ground truth from the annotation file)."""
        if mask_on is None:
            mask_on = bool(cfg.MODEL.MASK_ON) and is_train
        return cls(build_augmentations(cfg, is_train), mask_on=mask_on)

    def __call__(self, record: dict[str, Any], image: np.ndarray, rng: np.random.Generator) -> dict[str, Any]:
        orig_size = (int(image.shape[0]), int(image.shape[1]))
        image, transform = apply_augmentations(self.augmentations, image, rng)
        h, w = image.shape[:2]
        boxes = transform.apply_boxes(record["boxes"])
        np.clip(boxes, 0, [w, h, w, h], out=boxes)
        sample = {
            "image": torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1),  # a view: no transpose copy
            "image_id": int(record["image_id"]),
            "image_size": (int(h), int(w)),
            "orig_size": orig_size,
            "boxes": torch.from_numpy(boxes),
            "labels": torch.from_numpy(np.asarray(record["labels"], dtype=np.int64)),
        }
        if self.mask_on:
            masks = segmentations_to_masks(record["segmentations"], transform, orig_size, (h, w))
            sample["masks"] = torch.from_numpy(masks)
        return sample


def segmentations_to_masks(
    segmentations: Sequence[Any], transform: Transform, orig_size: tuple[int, int], size: tuple[int, int]
) -> np.ndarray:
    """uint8 [N, h, w] 0/1 masks of COCO segmentations (float polygons or RLE dicts) after ``transform``.

    ``orig_size`` is the (h, w) the annotations refer to, ``size`` the (h, w) after the transform.
    """
    h, w = size
    masks = np.zeros((len(segmentations), h, w), dtype=np.uint8)
    for i, segm in enumerate(segmentations):
        if isinstance(segm, dict):
            rle = segm if isinstance(segm["counts"], (str, bytes)) else mask_util.frPyObjects(segm, *orig_size)
            masks[i] = transform.apply_segmentation(mask_util.decode(rle))
        else:  # polygons: transform the vertices, rasterise once at the final size
            rles = mask_util.frPyObjects(transform.apply_polygons(segm), h, w)
            masks[i] = mask_util.decode(mask_util.merge(rles))
    return masks
