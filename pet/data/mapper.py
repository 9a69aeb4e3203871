"""Turns a dataset record and its decoded image into one model-ready sample."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pycocotools.mask as mask_util
import torch
from fvcore.common.config import CfgNode
from torchvision import tv_tensors

from pet.data.augmentations import AugmentationPipeline, ExtraSamples, Progress, build_pipeline
from pet.data.transforms import (
    Augmentation,
    NoOpTransform,
    RandomColorJitter,
    RandomCrop,
    RandomFlip,
    ResizeShortestEdge,
    ResizeToSize,
    Transform,
    apply_augmentations,
)
from pet.utils.errors import ConfigError

__all__ = ["DatasetMapper", "AugmentedMapper", "build_mapper", "build_augmentations", "crop_size",
           "segmentations_to_masks"]


def build_augmentations(cfg: CfgNode, is_train: bool) -> list[Augmentation]:
    """Resize (multi-scale when INPUT.MIN_SIZE_TRAIN lists several sizes) and, in training, a crop before it
    (INPUT.CROP), horizontal flip and colour jitter (when INPUT.BRIGHTNESS / CONTRAST / SATURATION are not all 0)."""
    if not is_train:
        if cfg.TEST.AUG.ENABLED:  # test-time augmentation resizes each pass down from its largest scale
            largest = max(cfg.TEST.AUG.MIN_SIZES, default=0)
            if largest <= 0:
                raise ConfigError(f"TEST.AUG.MIN_SIZES must list sizes in pixels, got {cfg.TEST.AUG.MIN_SIZES!r}.")
            if cfg.INPUT.FIXED_SIZE_TEST:
                return [ResizeToSize(largest, largest)]
            return [ResizeShortestEdge(largest, cfg.TEST.AUG.MAX_SIZE)]
        if cfg.INPUT.FIXED_SIZE_TEST:
            return [ResizeToSize(*fixed_size_test(cfg))]
        return [ResizeShortestEdge(cfg.INPUT.MIN_SIZE_TEST, cfg.INPUT.MAX_SIZE_TEST)]
    augs: list[Augmentation] = []
    if cfg.INPUT.CROP.ENABLED:
        augs.append(RandomCrop(*crop_size(cfg), around_object_prob=cfg.INPUT.CROP.AROUND_OBJECT_PROB))
    augs.append(ResizeShortestEdge(cfg.INPUT.MIN_SIZE_TRAIN, cfg.INPUT.MAX_SIZE_TRAIN))
    if cfg.INPUT.FLIP_PROB > 0:
        augs.append(RandomFlip(cfg.INPUT.FLIP_PROB))
    jitter = (cfg.INPUT.BRIGHTNESS, cfg.INPUT.CONTRAST, cfg.INPUT.SATURATION)
    for key, value in zip(("BRIGHTNESS", "CONTRAST", "SATURATION"), jitter):
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"INPUT.{key} must be in [0, 1] (a factor is drawn from [1 - x, 1 + x]), got {value}.")
    if any(jitter):  # after the resize: the jitter then touches fewer pixels when images shrink
        augs.append(RandomColorJitter(*jitter))
    return augs


def fixed_size_test(cfg: CfgNode) -> tuple[int, int]:
    """INPUT.FIXED_SIZE_TEST as (height, width), checked."""
    size = tuple(cfg.INPUT.FIXED_SIZE_TEST)
    if len(size) != 2 or not all(isinstance(v, int) and v > 0 for v in size):
        raise ConfigError(f"INPUT.FIXED_SIZE_TEST must be (height, width) in pixels or empty, got {size!r}.")
    return size  # type: ignore[return-value]


def build_mapper(cfg: CfgNode, is_train: bool, *, mask_on: bool | None = None,
                 keypoint_flip_map: Sequence[int] | None = None) -> DatasetMapper | AugmentedMapper:
    """The mapper a loader uses: :class:`AugmentedMapper` in training with ``INPUT.AUGMENTATIONS``, else
    :class:`DatasetMapper` (the keys INPUT.MIN_SIZE_*, FLIP_PROB, BRIGHTNESS..., CROP)."""
    if is_train and cfg.INPUT.AUGMENTATIONS:
        return AugmentedMapper.from_config(cfg, mask_on=mask_on, keypoint_flip_map=keypoint_flip_map)
    return DatasetMapper.from_config(cfg, is_train, mask_on=mask_on, keypoint_flip_map=keypoint_flip_map)


def crop_size(cfg: CfgNode) -> tuple[int, int]:
    """INPUT.CROP.SIZE as (height, width), checked along with the other INPUT.CROP values."""
    crop = cfg.INPUT.CROP
    size = tuple(crop.SIZE)
    if len(size) != 2 or not all(isinstance(v, int) and v > 0 for v in size):
        raise ConfigError(f"INPUT.CROP.SIZE must be (height, width) in pixels, got {crop.SIZE!r}.")
    if not 0.0 <= crop.AROUND_OBJECT_PROB <= 1.0:
        raise ConfigError(f"INPUT.CROP.AROUND_OBJECT_PROB must be in [0, 1], got {crop.AROUND_OBJECT_PROB}.")
    if not 0.0 <= crop.MIN_VISIBLE <= 1.0:
        raise ConfigError(f"INPUT.CROP.MIN_VISIBLE must be in [0, 1], got {crop.MIN_VISIBLE}.")
    return size  # type: ignore[return-value]


class DatasetMapper:
    """Applies the augmentations to the image and its annotations and packs one sample of the batch contract.

    The sample is a dict:

    - ``image``: uint8 [3, h, w] RGB after the transforms, a channels-last view of the opencv pixels
      (not yet padded; the collator pads the batch);
    - ``image_id``: the COCO image id;
    - ``image_size``: (h, w) after the transforms; ``orig_size``: (h, w) as decoded;
    - ``boxes``: float32 [N, 4] XYXY in the pixels of ``image``, clipped to it; crowd and dropped
      annotations are not there, nor boxes a crop left with less than ``min_visible`` of their area
      (their label and mask go with them);
    - ``labels``: int64 [N] the record's labels: in a loader, the model's (``MODEL.LABEL_SPACE``; the
      :class:`~pet.data.dataset.DetectionDataset` maps records into its ``label_space``, whose
      ``category_id(label)`` gives each one's category id);
    - ``masks`` (only with ``mask_on``): uint8 [N, h, w] of 0/1, mask i belongs to box i;
    - ``keypoints`` (when the record has them: a keypoint set): float32 [N, K, 3] (x, y, visibility) in the
      pixels of ``image`` (torchvision's target); a flip renumbers them by ``keypoint_flip_map``, and a point
      the transforms put outside the image (a crop) becomes unlabelled (visibility 0), as in detectron2.

    Masks are decoded with pycocotools. Polygons go through the same coordinate transform as the
    boxes and are rasterised at the final size; RLE masks are decoded at the original size and
    resized / flipped like the image with nearest-neighbour interpolation.
    """

    def __init__(self, augmentations: Sequence[Augmentation], *, mask_on: bool = False,
                 min_visible: float = 0.0, keypoint_flip_map: Sequence[int] | None = None) -> None:
        self.augmentations = list(augmentations)
        self.mask_on = mask_on
        self.min_visible = min_visible
        self.keypoint_flip_map = list(keypoint_flip_map) if keypoint_flip_map is not None else None

    @classmethod
    def from_config(cls, cfg: CfgNode, is_train: bool, *, mask_on: bool | None = None,
                    keypoint_flip_map: Sequence[int] | None = None) -> DatasetMapper:
        """The mapper train/test loaders use. Masks default to MODEL.MASK_ON in training and to off in
        testing (COCO evaluation reads the ground truth from the annotation file). ``keypoint_flip_map``: the
        training set's (:class:`~pet.data.keypoints.KeypointMeta`), for flipping its keypoints."""
        if mask_on is None:
            mask_on = bool(cfg.MODEL.MASK_ON) and is_train
        min_visible = cfg.INPUT.CROP.MIN_VISIBLE if is_train and cfg.INPUT.CROP.ENABLED else 0.0
        return cls(build_augmentations(cfg, is_train), mask_on=mask_on, min_visible=min_visible,
                   keypoint_flip_map=keypoint_flip_map)

    def __call__(self, record: dict[str, Any], image: np.ndarray, rng: np.random.Generator) -> dict[str, Any]:
        orig_size = (int(image.shape[0]), int(image.shape[1]))
        image, transform = apply_augmentations(self.augmentations, image, rng, boxes=record["boxes"])
        h, w = image.shape[:2]
        boxes = transform.apply_boxes(record["boxes"])
        whole = _area(boxes)
        np.clip(boxes, 0, [w, h, w, h], out=boxes)
        visible = _area(boxes)
        keep = (visible > 0) & (visible >= self.min_visible * whole)
        labels = np.asarray(record["labels"], dtype=np.int64)
        segmentations = record["segmentations"] if self.mask_on else []
        keypoints = _keypoints(record, transform, self.keypoint_flip_map, (h, w))
        if not keep.all():  # a crop cut them: what is left of them is too little to be labelled
            boxes, labels = boxes[keep], labels[keep]
            segmentations = [s for s, k in zip(segmentations, keep) if k] if self.mask_on else []
            keypoints = keypoints[keep] if keypoints is not None else None
        sample = {
            "image": torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1),  # a view: no transpose copy
            "image_id": int(record["image_id"]),
            "image_size": (int(h), int(w)),
            "orig_size": orig_size,
            "boxes": torch.from_numpy(boxes),
            "labels": torch.from_numpy(labels),
        }
        if self.mask_on:
            masks = segmentations_to_masks(segmentations, transform, orig_size, (h, w))
            sample["masks"] = torch.from_numpy(masks)
        if keypoints is not None:
            sample["keypoints"] = torch.from_numpy(keypoints)
        return sample


def _keypoints(record: dict[str, Any], transform: Transform, flip_map: Sequence[int] | None,
               size: tuple[int, int]) -> np.ndarray | None:
    """The record's keypoints [N, K, 3] after ``transform``; points outside the (h, w) image become unlabelled."""
    if "keypoints" not in record:
        return None
    points = transform.apply_keypoints(record["keypoints"], flip_map)
    h, w = size
    x, y = points[..., 0], points[..., 1]
    points[..., 2][(x < 0) | (y < 0) | (x > w) | (y > h)] = 0
    return points


def _area(boxes: np.ndarray) -> np.ndarray:
    return np.clip(boxes[:, 2] - boxes[:, 0], 0, None) * np.clip(boxes[:, 3] - boxes[:, 1], 0, None)


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


class AugmentedMapper:
    """The training sample of :class:`DatasetMapper`'s contract, made by an ``INPUT.AUGMENTATIONS`` pipeline.

    The record becomes a sample of torchvision tv_tensors (:mod:`pet.data.augmentations`): masks decoded at the
    image's size, keypoints split into points and visibility. After the pipeline, boxes are clipped to the image
    and those left without area dropped with their labels, masks and keypoints; keypoints outside the image become
    unlabelled, as :class:`DatasetMapper` does. Transforms that mix images draw them from the dataset, which
    :class:`~pet.data.dataset.DetectionDataset` hands over with the sample's training progress
    (``needs_dataset``).
    """

    needs_dataset = True

    def __init__(self, pipeline: AugmentationPipeline, *, mask_on: bool = False) -> None:
        self.pipeline = pipeline
        self.mask_on = mask_on

    @classmethod
    def from_config(cls, cfg: CfgNode, *, mask_on: bool | None = None,
                    keypoint_flip_map: Sequence[int] | None = None) -> AugmentedMapper:
        pipeline = build_pipeline(cfg.INPUT.AUGMENTATIONS, keypoint_flip_map=keypoint_flip_map)
        return cls(pipeline, mask_on=bool(cfg.MODEL.MASK_ON) if mask_on is None else mask_on)

    def to_sample(self, record: dict[str, Any], image: np.ndarray) -> dict[str, Any]:
        """The record and its decoded HWC image as a pipeline sample (the image is a view, not a copy)."""
        size = (int(image.shape[0]), int(image.shape[1]))
        boxes = torch.as_tensor(np.asarray(record["boxes"], dtype=np.float32).reshape(-1, 4))
        sample: dict[str, Any] = {
            "image": tv_tensors.Image(torch.from_numpy(image).permute(2, 0, 1)),
            "boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=size),
            "labels": torch.as_tensor(np.asarray(record["labels"], dtype=np.int64)),
        }
        if self.mask_on:
            masks = segmentations_to_masks(record["segmentations"], NoOpTransform(), size, size)
            sample["masks"] = tv_tensors.Mask(torch.from_numpy(masks))
        if "keypoints" in record:
            points = torch.as_tensor(np.asarray(record["keypoints"], dtype=np.float32)).reshape(len(boxes), -1, 3)
            sample["keypoints"] = tv_tensors.KeyPoints(points[..., :2].contiguous(), canvas_size=size)
            sample["keypoint_visibility"] = points[..., 2].contiguous()
        return sample

    def __call__(self, record: dict[str, Any], image: np.ndarray, rng: np.random.Generator, *,
                 progress: Progress | None = None, dataset: Any = None) -> dict[str, Any]:
        orig_size = (int(image.shape[0]), int(image.shape[1]))
        extra = None
        if dataset is not None:
            extra = ExtraSamples(len(dataset), lambda index: self.to_sample(*dataset.load(index)))
        seed = int(rng.integers(2**63 - 1))
        sample = self.pipeline(self.to_sample(record, image), seed, progress or Progress(), extra)
        return self._packed(sample, int(record["image_id"]), orig_size)

    def _packed(self, sample: dict[str, Any], image_id: int, orig_size: tuple[int, int]) -> dict[str, Any]:
        image = sample["image"].as_subclass(torch.Tensor)
        if image.dtype != torch.uint8:
            raise TypeError(f"The augmentation pipeline must leave a uint8 image, got {image.dtype}.")
        h, w = (int(v) for v in image.shape[-2:])
        boxes = sample["boxes"].as_subclass(torch.Tensor).to(torch.float32).clone().reshape(-1, 4)
        boxes[:, 0::2] = boxes[:, 0::2].clamp(0, w)
        boxes[:, 1::2] = boxes[:, 1::2].clamp(0, h)
        keep = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
        packed = {
            # HWC in memory, as DatasetMapper's opencv views: the collator then copies rows, not a transpose.
            "image": image.permute(1, 2, 0).contiguous().permute(2, 0, 1),
            "image_id": image_id,
            "image_size": (h, w),
            "orig_size": orig_size,
            "boxes": boxes[keep],
            "labels": sample["labels"].as_subclass(torch.Tensor)[keep].to(torch.int64),
        }
        if self.mask_on:
            packed["masks"] = sample["masks"].as_subclass(torch.Tensor)[keep].to(torch.uint8).contiguous()
        if "keypoints" in sample:
            xy = sample["keypoints"].as_subclass(torch.Tensor).to(torch.float32)
            visibility = sample["keypoint_visibility"].to(torch.float32).clone()
            outside = (xy[..., 0] < 0) | (xy[..., 1] < 0) | (xy[..., 0] > w) | (xy[..., 1] > h)
            visibility[outside] = 0
            packed["keypoints"] = torch.cat([xy, visibility[..., None]], dim=-1)[keep].contiguous()
        return packed
