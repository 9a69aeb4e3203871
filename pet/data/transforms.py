"""Transforms on images and their annotations, with opencv.

An :class:`Augmentation` looks at an image size and draws a deterministic
:class:`Transform` from a random generator; the transform is then applied to the
image, the boxes, the masks (as polygons, or as bitmasks for RLE) and the keypoints, so
every annotation stays consistent with the pixels; a horizontal flip also swaps left and right
keypoints by the set's flip map. New annotation types only need an
``apply_*`` method built on ``apply_coords``. Photometric transforms (colour jitter)
change pixels only: their ``apply_coords`` and ``apply_segmentation`` are the identity.
An augmentation that places itself by the objects (:class:`RandomCrop` around an object) sets
``uses_boxes`` and gets the image's boxes, as transformed so far, in ``get_transform``.
"""
from __future__ import annotations

from collections.abc import Sequence

import cv2
import numpy as np
import torch
from torchvision.transforms.v2 import functional as F

__all__ = [
    "Transform", "NoOpTransform", "ResizeTransform", "HFlipTransform", "CropTransform", "ColorTransform",
    "TransformList", "Augmentation", "ResizeShortestEdge", "ResizeToSize", "RandomFlip", "RandomCrop",
    "RandomColorJitter", "AntialiasedResizeTransform",
    "apply_augmentations",
]


class Transform:
    """A fixed geometric transform. Subclasses define ``apply_image`` and ``apply_coords``."""

    def apply_image(self, image: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def apply_coords(self, coords: np.ndarray) -> np.ndarray:
        """Transform float points [N, 2] given as (x, y)."""
        raise NotImplementedError

    def apply_segmentation(self, mask: np.ndarray) -> np.ndarray:
        """Transform a uint8 [H, W] label mask like the image, without mixing labels (nearest neighbour)."""
        raise NotImplementedError

    def apply_boxes(self, boxes: np.ndarray) -> np.ndarray:
        """Transform XYXY boxes [N, 4]: the axis-aligned box around the four transformed corners."""
        if len(boxes) == 0:
            return boxes.astype(np.float32).reshape(0, 4)
        corners = boxes[:, [0, 1, 2, 1, 0, 3, 2, 3]].reshape(-1, 2)
        corners = self.apply_coords(corners).reshape(-1, 4, 2)
        return np.concatenate([corners.min(axis=1), corners.max(axis=1)], axis=1).astype(np.float32)

    def apply_polygons(self, polygons: list[np.ndarray]) -> list[np.ndarray]:
        """Transform polygons, each a flat array (x0, y0, x1, y1, ...) as in COCO."""
        return [self.apply_coords(np.asarray(p, dtype=np.float64).reshape(-1, 2)).reshape(-1) for p in polygons]

    def apply_keypoints(self, keypoints: np.ndarray, flip_map: Sequence[int] | None = None) -> np.ndarray:
        """Transform keypoints [N, K, 3] (x, y, visibility): the points move as ``apply_coords`` moves them, the
        visibility stays. A mirroring transform also renumbers the points by ``flip_map`` (the set's
        :class:`~pet.data.keypoints.KeypointMeta`), so a left wrist stays a left wrist."""
        points = np.array(keypoints, dtype=np.float32).reshape(len(keypoints), -1, 3)
        if points.size:
            xy = self.apply_coords(points[..., :2].reshape(-1, 2))
            points[..., :2] = np.asarray(xy, dtype=np.float32).reshape(*points.shape[:2], 2)
        return points


class NoOpTransform(Transform):
    def apply_image(self, image: np.ndarray) -> np.ndarray:
        return image

    def apply_coords(self, coords: np.ndarray) -> np.ndarray:
        return coords

    def apply_segmentation(self, mask: np.ndarray) -> np.ndarray:
        return mask


class ResizeTransform(Transform):
    """Resize from (h, w) to (new_h, new_w) with bilinear interpolation."""

    def __init__(self, h: int, w: int, new_h: int, new_w: int) -> None:
        self.h, self.w, self.new_h, self.new_w = h, w, new_h, new_w

    def apply_image(self, image: np.ndarray) -> np.ndarray:
        assert image.shape[:2] == (self.h, self.w), f"expected a {self.h}x{self.w} image, got {image.shape[:2]}"
        if (self.new_h, self.new_w) == (self.h, self.w):
            return image
        return cv2.resize(image, (self.new_w, self.new_h), interpolation=cv2.INTER_LINEAR)

    def apply_coords(self, coords: np.ndarray) -> np.ndarray:
        coords = np.array(coords, dtype=np.float64)
        coords[:, 0] *= self.new_w / self.w
        coords[:, 1] *= self.new_h / self.h
        return coords

    def apply_segmentation(self, mask: np.ndarray) -> np.ndarray:
        if (self.new_h, self.new_w) == (self.h, self.w):
            return mask
        return cv2.resize(mask, (self.new_w, self.new_h), interpolation=cv2.INTER_NEAREST)


class AntialiasedResizeTransform(ResizeTransform):
    """Resize with torchvision's antialiased bilinear resize (``v2.functional.resize``), not opencv's.

    It is what torchvision's ``v2.Resize`` does to a tensor image, so it gives the pixels of the pipelines that
    use it at test time (the RT-DETR authors', transformers' image processors): Pet's test input is then theirs.
    """

    def apply_image(self, image: np.ndarray) -> np.ndarray:
        assert image.shape[:2] == (self.h, self.w), f"expected a {self.h}x{self.w} image, got {image.shape[:2]}"
        if (self.new_h, self.new_w) == (self.h, self.w):
            return image
        pixels = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1)
        resized = F.resize(pixels, [self.new_h, self.new_w], antialias=True)
        return resized.permute(1, 2, 0).numpy()


class HFlipTransform(Transform):
    """Mirror an image of the given width left to right."""

    def __init__(self, width: int) -> None:
        self.width = width

    def apply_image(self, image: np.ndarray) -> np.ndarray:
        return cv2.flip(image, 1)

    def apply_coords(self, coords: np.ndarray) -> np.ndarray:
        coords = np.array(coords, dtype=np.float64)
        coords[:, 0] = self.width - coords[:, 0]
        return coords

    def apply_segmentation(self, mask: np.ndarray) -> np.ndarray:
        return cv2.flip(mask, 1)

    def apply_keypoints(self, keypoints: np.ndarray, flip_map: Sequence[int] | None = None) -> np.ndarray:
        """Mirror the points and swap left and right ones: point i of the mirrored object is point ``flip_map[i]``
        of the original (torchvision's and detectron2's rule for COCO's person)."""
        points = super().apply_keypoints(keypoints)
        if points.shape[1] == 0:
            return points
        if flip_map is None:
            raise ValueError("Flipping keypoints needs the set's flip map (KeypointMeta.flip_map); without it a left "
                             "point would turn into a left point on the right side. Pass keypoint_flip_map to the "
                             "mapper.")
        return points[:, list(flip_map)]


class CropTransform(Transform):
    """Cut the window of ``height`` x ``width`` pixels whose top-left corner is (x0, y0).

    Coordinates shift by (-x0, -y0); what falls outside the window is clipped (and boxes that
    lose too much are dropped) by the mapper, which knows the window's size from the image.
    """

    def __init__(self, x0: int, y0: int, width: int, height: int) -> None:
        self.x0, self.y0, self.width, self.height = x0, y0, width, height

    def apply_image(self, image: np.ndarray) -> np.ndarray:
        return image[self.y0:self.y0 + self.height, self.x0:self.x0 + self.width]

    def apply_coords(self, coords: np.ndarray) -> np.ndarray:
        coords = np.array(coords, dtype=np.float64)
        coords[:, 0] -= self.x0
        coords[:, 1] -= self.y0
        return coords

    def apply_segmentation(self, mask: np.ndarray) -> np.ndarray:
        return mask[self.y0:self.y0 + self.height, self.x0:self.x0 + self.width]


class ColorTransform(Transform):
    """Scale brightness, then contrast, then saturation by fixed factors (1 leaves a property as it is).

    The operations are torchvision's ``adjust_brightness/contrast/saturation`` (blend with
    black, with the mean gray level, with the gray image; clipped to [0, 255] after each),
    done in float32 with numpy and opencv. Geometry is unchanged.
    """

    def __init__(self, brightness: float = 1.0, contrast: float = 1.0, saturation: float = 1.0) -> None:
        self.brightness, self.contrast, self.saturation = brightness, contrast, saturation

    def apply_image(self, image: np.ndarray) -> np.ndarray:
        if self.brightness == self.contrast == self.saturation == 1.0:
            return image
        x = image.astype(np.float32)
        if self.brightness != 1.0:
            x *= self.brightness
            np.clip(x, 0, 255, out=x)
        if self.contrast != 1.0:
            mean = float(cv2.cvtColor(x, cv2.COLOR_RGB2GRAY).mean())
            x = _blend(x, mean, self.contrast)
        if self.saturation != 1.0:
            x = _blend(x, cv2.cvtColor(x, cv2.COLOR_RGB2GRAY)[..., None], self.saturation)
        x += 0.5  # round to nearest when truncating to uint8
        return x.astype(np.uint8)

    def apply_coords(self, coords: np.ndarray) -> np.ndarray:
        return coords

    def apply_segmentation(self, mask: np.ndarray) -> np.ndarray:
        return mask


class TransformList(Transform):
    """Several transforms applied in order."""

    def __init__(self, transforms: Sequence[Transform]) -> None:
        self.transforms = [t for t in transforms if not isinstance(t, NoOpTransform)]

    def apply_image(self, image: np.ndarray) -> np.ndarray:
        for t in self.transforms:
            image = t.apply_image(image)
        return image

    def apply_coords(self, coords: np.ndarray) -> np.ndarray:
        for t in self.transforms:
            coords = t.apply_coords(coords)
        return coords

    def apply_segmentation(self, mask: np.ndarray) -> np.ndarray:
        for t in self.transforms:
            mask = t.apply_segmentation(mask)
        return mask

    def apply_keypoints(self, keypoints: np.ndarray, flip_map: Sequence[int] | None = None) -> np.ndarray:
        for t in self.transforms:  # each flip swaps: two flips give back the original numbering
            keypoints = t.apply_keypoints(keypoints, flip_map)
        return np.asarray(keypoints, dtype=np.float32)


class Augmentation:
    """Draws a :class:`Transform` for an image of size (h, w).

    With ``uses_boxes`` True, ``get_transform`` also gets ``boxes=``: the image's XYXY boxes
    [N, 4] in its current pixels.
    """

    uses_boxes = False

    def get_transform(self, height: int, width: int, rng: np.random.Generator) -> Transform:
        raise NotImplementedError


class ResizeShortestEdge(Augmentation):
    """Scale so the shorter side is one of ``short_edge_lengths`` (drawn per image) and the longer at most ``max_size``.

    A shorter side of 0 leaves the image as it is.
    """

    def __init__(self, short_edge_lengths: Sequence[int] | int, max_size: int) -> None:
        lengths = [short_edge_lengths] if isinstance(short_edge_lengths, int) else list(short_edge_lengths)
        if not lengths:
            raise ValueError("ResizeShortestEdge needs at least one shorter-side length")
        self.short_edge_lengths = lengths
        self.max_size = max_size

    def get_transform(self, height: int, width: int, rng: np.random.Generator) -> Transform:
        short = self.short_edge_lengths[0] if len(self.short_edge_lengths) == 1 else int(
            rng.choice(self.short_edge_lengths)
        )
        if short <= 0:
            return NoOpTransform()
        new_h, new_w = resized_shape(height, width, short, self.max_size)
        return ResizeTransform(height, width, new_h, new_w)


class ResizeToSize(Augmentation):
    """Stretch every image to ``height`` x ``width`` (RT-DETR's and YOLO's test input), with
    :class:`AntialiasedResizeTransform`."""

    def __init__(self, height: int, width: int) -> None:
        self.height, self.width = height, width

    def get_transform(self, height: int, width: int, rng: np.random.Generator) -> Transform:
        return AntialiasedResizeTransform(height, width, self.height, self.width)


class RandomFlip(Augmentation):
    """Horizontal flip with probability ``prob``."""

    def __init__(self, prob: float = 0.5) -> None:
        self.prob = prob

    def get_transform(self, height: int, width: int, rng: np.random.Generator) -> Transform:
        if self.prob > 0 and rng.random() < self.prob:
            return HFlipTransform(width)
        return NoOpTransform()


class RandomCrop(Augmentation):
    """A window of fixed size (a side larger than the image keeps the image's), placed at random.

    With probability ``around_object_prob`` (and when the image has boxes) the window is placed
    around one box drawn at random: uniformly among the positions that hold the whole box when it
    fits in the window, else among those lying inside the box. Otherwise uniformly over the image.
    """

    uses_boxes = True

    def __init__(self, height: int, width: int, around_object_prob: float = 0.0) -> None:
        if height <= 0 or width <= 0:
            raise ValueError(f"RandomCrop needs a positive size, got {height}x{width}")
        self.height, self.width = height, width
        self.around_object_prob = around_object_prob

    def get_transform(self, height: int, width: int, rng: np.random.Generator,
                      boxes: np.ndarray | None = None) -> Transform:
        crop_h, crop_w = min(self.height, height), min(self.width, width)
        if (crop_h, crop_w) == (height, width):
            return NoOpTransform()
        if boxes is not None and len(boxes) and self.around_object_prob > 0 and rng.random() < self.around_object_prob:
            x1, y1, x2, y2 = (float(v) for v in boxes[int(rng.integers(len(boxes)))])
            x0 = _start_around(x1, x2, crop_w, width, rng)
            y0 = _start_around(y1, y2, crop_h, height, rng)
        else:
            x0 = int(rng.integers(width - crop_w + 1))
            y0 = int(rng.integers(height - crop_h + 1))
        return CropTransform(x0, y0, crop_w, crop_h)


def _start_around(lo: float, hi: float, size: int, limit: int, rng: np.random.Generator) -> int:
    """A window start in [0, limit - size] whose window [start, start + size) holds [lo, hi] when it fits,
    else lies inside it."""
    first, last = (hi - size, lo) if hi - lo <= size else (lo, hi - size)
    first = min(max(int(np.ceil(first)), 0), limit - size)
    last = min(max(int(np.floor(last)), first), limit - size)
    return int(rng.integers(first, last + 1))


class RandomColorJitter(Augmentation):
    """Brightness, contrast and saturation factors drawn uniformly from [1 - x, 1 + x] (x = 0: unchanged)."""

    def __init__(self, brightness: float = 0.0, contrast: float = 0.0, saturation: float = 0.0) -> None:
        self.ranges = (brightness, contrast, saturation)

    def get_transform(self, height: int, width: int, rng: np.random.Generator) -> Transform:
        return ColorTransform(*(float(rng.uniform(1 - x, 1 + x)) if x > 0 else 1.0 for x in self.ranges))


def _blend(image: np.ndarray, other: np.ndarray | float, factor: float) -> np.ndarray:
    """``factor * image + (1 - factor) * other`` clipped to [0, 255] (torchvision's ``_blend``), in place."""
    image *= factor
    image += (1.0 - factor) * other
    return np.clip(image, 0, 255, out=image)


def resized_shape(height: int, width: int, short: int, max_size: int) -> tuple[int, int]:
    """(new_h, new_w) with the shorter side ``short``, scaled down if the longer one exceeds ``max_size``."""
    scale = short / min(height, width)
    if max_size > 0 and max(height, width) * scale > max_size:
        scale = max_size / max(height, width)
    return max(1, int(round(height * scale))), max(1, int(round(width * scale)))


def apply_augmentations(
    augmentations: Sequence[Augmentation], image: np.ndarray, rng: np.random.Generator,
    boxes: np.ndarray | None = None,
) -> tuple[np.ndarray, TransformList]:
    """Apply each augmentation to the image in turn; return the image and the combined transform.

    ``boxes`` (XYXY in the image's pixels) are shown, transformed so far, to augmentations with ``uses_boxes``.
    """
    transforms: list[Transform] = []
    for aug in augmentations:
        if aug.uses_boxes:
            current = TransformList(transforms).apply_boxes(boxes) if boxes is not None else None
            t = aug.get_transform(image.shape[0], image.shape[1], rng, boxes=current)
        else:
            t = aug.get_transform(image.shape[0], image.shape[1], rng)
        image = t.apply_image(image)
        transforms.append(t)
    return image, TransformList(transforms)
