"""Transforms that mix several training images (mosaic, mixup, copy-paste), which torchvision's v2 lacks.

Each sets ``mixes_images = True`` and ``min_images`` (how many distinct images the dataset must hold), so the
pipeline calls it as ``transform(sample, extra)`` with an :class:`~pet.data.augmentations.ExtraSamples`, and the
training loader refuses a dataset too small for it. The samples follow :mod:`pet.data.augmentations`' format;
every random draw comes from torch's global generator, which the pipeline seeds per sample, so an output depends
on the sample's seed alone. Each transform first draws ``torch.rand(1) >= p`` and, when true, returns the sample
unchanged without drawing anything else.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as F

from pet.data.augmentations import AUGMENTATIONS, ExtraSamples
from pet.utils.errors import ConfigError

__all__ = ["Mosaic", "MixUp", "CopyPaste"]


@dataclass
class _Instances:
    """A sample's per-instance tensors as plain tensors, so a transform can select, move and join them.

    ``masks``, ``keypoints`` and ``visibility`` are None when the sample has none.
    """

    boxes: torch.Tensor  # [N, 4] XYXY float32
    labels: torch.Tensor  # [N] int64
    masks: torch.Tensor | None = None  # [N, H, W] uint8
    keypoints: torch.Tensor | None = None  # [N, K, 2] float32
    visibility: torch.Tensor | None = None  # [N, K] float32

    @classmethod
    def of(cls, sample: dict[str, Any]) -> _Instances:
        def plain(key: str) -> torch.Tensor | None:
            value = sample.get(key)
            return None if value is None else value.as_subclass(torch.Tensor)

        return cls(plain("boxes").to(torch.float32).reshape(-1, 4), plain("labels"), plain("masks"),
                   plain("keypoints"), plain("keypoint_visibility"))

    def __len__(self) -> int:
        return len(self.boxes)

    def __getitem__(self, keep: torch.Tensor) -> _Instances:
        return _Instances(*(None if t is None else t[keep] for t in self._fields()))

    def _fields(self) -> tuple[torch.Tensor | None, ...]:
        return self.boxes, self.labels, self.masks, self.keypoints, self.visibility

    @staticmethod
    def cat(parts: Sequence[_Instances]) -> _Instances:
        """The parts one after the other. Parts without instances are skipped, so an empty one may carry
        keypoints of another K (an image without annotations)."""
        nonempty = [p for p in parts if len(p)] or [parts[0]]
        columns = zip(*(p._fields() for p in nonempty))
        return _Instances(*(None if c[0] is None else torch.cat(c) for c in columns))

    def into(self, sample: dict[str, Any], image: torch.Tensor) -> dict[str, Any]:
        """``sample`` with ``image`` and these instances, as tv_tensors at the image's size."""
        size = (int(image.shape[-2]), int(image.shape[-1]))
        out = dict(sample)
        out["image"] = tv_tensors.Image(image)
        out["boxes"] = tv_tensors.BoundingBoxes(self.boxes, format="XYXY", canvas_size=size)
        out["labels"] = self.labels
        out.pop("masks", None)
        if self.masks is not None:
            out["masks"] = tv_tensors.Mask(self.masks)
        if self.keypoints is not None:
            out["keypoints"] = tv_tensors.KeyPoints(self.keypoints, canvas_size=size)
            out["keypoint_visibility"] = self.visibility
        return out


def _resized(sample: dict[str, Any], size: tuple[int, int]) -> dict[str, Any]:
    """``sample`` at (h, w): v2's resize on every tv_tensor, so boxes, masks (nearest) and keypoints follow."""
    if tuple(sample["image"].shape[-2:]) == size:
        return sample
    return {k: F.resize(v, list(size), antialias=True) if isinstance(v, tv_tensors.TVTensor) else v
            for k, v in sample.items()}


def _image(sample: dict[str, Any]) -> torch.Tensor:
    return sample["image"].as_subclass(torch.Tensor)


def _check_probability(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}.")


def _skip(p: float) -> bool:
    """The first draw of every transform here: True (skip the transform) with probability 1 - p."""
    return bool(torch.rand(1) >= p)


@AUGMENTATIONS.register()
class Mosaic:
    """The YOLOX / Ultralytics 4-image mosaic: the sample and 3 drawn ones around a random centre.

    Each image is resized, keeping its aspect ratio, so that its longer side is ``size``, and placed on a
    ``2 size`` x ``2 size`` canvas filled with ``fill`` around a centre (xc, yc) drawn uniformly in
    [center_range[0] size, center_range[1] size]: the sample's bottom-right corner at the centre, then the drawn
    ones top-right, bottom-left and bottom-right of it, as YOLOX places them. The output is the central
    ``size`` x ``size`` window [size/2, 3 size/2) of that canvas: what Ultralytics' mosaic followed by its
    perspective step with an identity affine gives. Without the window the canvas would be mostly fill, and the
    objects half the size the rest of training sees.

    Boxes are shifted and clipped to the part of their image inside the output; those left without area are
    dropped with their labels, masks and keypoints. Keypoints move with their image and lose their visibility
    (0) outside its visible part.
    """

    mixes_images = True
    min_images = 4

    def __init__(self, size: int = 640, center_range: Sequence[float] = (0.5, 1.5), fill: int = 114,
                 p: float = 1.0) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"size must be a whole number of pixels > 0, got {size!r}.")
        center_range = tuple(center_range)
        if len(center_range) != 2 or not 0.0 <= center_range[0] <= center_range[1] <= 2.0:
            raise ValueError(f"center_range must be (low, high) with 0 <= low <= high <= 2 (fractions of size; "
                             f"the canvas is 2 size wide), got {center_range!r}.")
        if isinstance(fill, bool) or not isinstance(fill, int) or not 0 <= fill <= 255:
            raise ValueError(f"fill must be a pixel value in [0, 255], got {fill!r}.")
        _check_probability("p", p)
        self.size, self.center_range, self.fill, self.p = size, center_range, fill, p

    def __repr__(self) -> str:
        return f"Mosaic(size={self.size}, center_range={self.center_range}, fill={self.fill}, p={self.p})"

    def sample_center(self) -> tuple[int, int]:
        """(xc, yc) on the 2 size canvas, whole pixels as YOLOX's ``int(uniform(...))``."""
        low, high = (v * self.size for v in self.center_range)
        xc, yc = (low + (high - low) * torch.rand(2)).tolist()
        return int(xc), int(yc)

    def __call__(self, sample: dict[str, Any], extra: ExtraSamples) -> dict[str, Any]:
        if _skip(self.p):
            return sample
        xc, yc = self.sample_center()
        pieces = [sample] + [extra.draw() for _ in range(3)]
        s, half = self.size, self.size // 2
        canvas = torch.full((3, s, s), self.fill, dtype=torch.uint8)
        parts = []
        for quadrant, piece in enumerate(pieces):
            piece = _resized(piece, self._fitted(piece))
            h, w = _image(piece).shape[-2:]
            # The image's top-left corner on the output (the canvas shifted by the window's corner).
            left = (xc - w if quadrant in (0, 2) else xc) - half
            top = (yc - h if quadrant in (0, 1) else yc) - half
            region = (max(left, 0), max(top, 0), min(left + w, s), min(top + h, s))
            x0, y0, x1, y1 = region
            if x1 > x0 and y1 > y0:
                canvas[:, y0:y1, x0:x1] = _image(piece)[:, y0 - top:y1 - top, x0 - left:x1 - left]
            parts.append(self._placed(_Instances.of(piece), left, top, region))
        return _Instances.cat(parts).into(sample, canvas)

    def _fitted(self, sample: dict[str, Any]) -> tuple[int, int]:
        """(h, w) with the longer side ``size`` and the aspect ratio kept."""
        h, w = _image(sample).shape[-2:]
        scale = self.size / max(h, w)
        return max(1, round(h * scale)), max(1, round(w * scale))

    def _placed(self, instances: _Instances, left: int, top: int, region: tuple[int, int, int, int]) -> _Instances:
        """The instances of an image whose top-left corner is at (left, top) on the output, of which ``region``
        (x0, y0, x1, y1) shows; those without area in it are dropped."""
        x0, y0, x1, y1 = region
        boxes = instances.boxes + torch.tensor([left, top, left, top], dtype=torch.float32)
        boxes[:, 0::2] = boxes[:, 0::2].clamp(x0, max(x0, x1))
        boxes[:, 1::2] = boxes[:, 1::2].clamp(y0, max(y0, y1))
        keep = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
        placed = replace(instances, boxes=boxes)
        if instances.masks is not None:
            masks = torch.zeros((len(instances), self.size, self.size), dtype=torch.uint8)
            if x1 > x0 and y1 > y0:
                masks[:, y0:y1, x0:x1] = instances.masks[:, y0 - top:y1 - top, x0 - left:x1 - left]
            placed.masks = masks
        if instances.keypoints is not None:
            points = instances.keypoints + torch.tensor([left, top], dtype=instances.keypoints.dtype)
            x, y = points[..., 0], points[..., 1]
            outside = (x < x0) | (x > x1) | (y < y0) | (y > y1)
            placed.keypoints = points
            placed.visibility = instances.visibility.masked_fill(outside, 0)
        return placed[keep]


@AUGMENTATIONS.register()
class MixUp:
    """Detection mixup (YOLOX / Ultralytics): the sample blended with a drawn one, both label sets kept.

    The drawn sample is stretched to the sample's size with its annotations; the pixels become
    ``r * sample + (1 - r) * drawn``, rounded back to uint8, with r ~ Beta(alpha, beta) (the default 32, 32
    keeps r near 0.5, as Ultralytics does). Boxes, labels, masks and keypoints of both are kept, the sample's
    first: each object stays visible at its place, at roughly half contrast.
    """

    mixes_images = True
    keeps_size = True
    min_images = 2

    def __init__(self, alpha: float = 32.0, beta: float = 32.0, p: float = 1.0) -> None:
        for name, value in (("alpha", alpha), ("beta", beta)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} (of the Beta distribution of the mixing ratio) must be > 0, got {value!r}.")
        _check_probability("p", p)
        self.alpha, self.beta, self.p = float(alpha), float(beta), p

    def __repr__(self) -> str:
        return f"MixUp(alpha={self.alpha}, beta={self.beta}, p={self.p})"

    def sample_ratio(self) -> float:
        """r, the sample's share of each pixel, drawn from Beta(alpha, beta) with torch's generator."""
        return float(torch.distributions.Beta(torch.tensor(self.alpha), torch.tensor(self.beta)).sample())

    def __call__(self, sample: dict[str, Any], extra: ExtraSamples) -> dict[str, Any]:
        if _skip(self.p):
            return sample
        size = tuple(_image(sample).shape[-2:])
        other = _resized(extra.draw(), size)
        r = self.sample_ratio()
        mixed = _image(sample).to(torch.float32) * r + _image(other).to(torch.float32) * (1.0 - r)
        image = mixed.round_().clamp_(0, 255).to(torch.uint8)
        return _Instances.cat([_Instances.of(sample), _Instances.of(other)]).into(sample, image)


@AUGMENTATIONS.register()
class CopyPaste:
    """Simple copy-paste (Ghiasi et al. 2021): objects of a drawn image pasted onto the sample.

    The drawn sample is stretched to the sample's size. Each of its instances is chosen with probability
    ``paste_prob``, at most ``max_fraction`` of them but at least one; their mask pixels overwrite the image.
    The sample's own instances lose the pasted pixels from their masks; their boxes shrink to what is left of
    the mask, and those left with less than ``min_visible`` of their mask's area are dropped with their labels
    and keypoints (an instance with an empty mask is kept as it was). Their keypoints under a pasted pixel become
    labelled but not visible (visibility at most 1). Pasted instances keep their boxes, labels, masks and
    keypoints.

    The pasted shape is the instance mask, so the sample needs masks (``MODEL.MASK_ON`` on a set with
    segmentations). For box-only labels, ``rectangles=True`` takes each box (of both images) as a filled
    rectangle, pastes those, and leaves masks out of the output; with masks present it changes nothing.
    """

    mixes_images = True
    keeps_size = True
    min_images = 2

    def __init__(self, p: float = 1.0, max_fraction: float = 1.0, min_visible: float = 0.1,
                 rectangles: bool = False, paste_prob: float = 0.5) -> None:
        _check_probability("p", p)
        if not 0.0 < max_fraction <= 1.0:
            raise ValueError(f"max_fraction (the largest share of the drawn image's objects pasted) must be in "
                             f"(0, 1], got {max_fraction!r}.")
        _check_probability("min_visible", min_visible)
        _check_probability("paste_prob", paste_prob)
        if not isinstance(rectangles, bool):
            raise ValueError(f"rectangles must be true or false, got {rectangles!r}.")
        self.p, self.max_fraction, self.min_visible = p, max_fraction, min_visible
        self.rectangles, self.paste_prob = rectangles, paste_prob

    def __repr__(self) -> str:
        return (f"CopyPaste(p={self.p}, max_fraction={self.max_fraction}, min_visible={self.min_visible}, "
                f"rectangles={self.rectangles}, paste_prob={self.paste_prob})")

    def __call__(self, sample: dict[str, Any], extra: ExtraSamples) -> dict[str, Any]:
        with_masks = "masks" in sample
        if not with_masks and not self.rectangles:
            raise ConfigError("CopyPaste pastes instance masks and these samples have none: turn MODEL.MASK_ON True "
                              "on a set with segmentations, or set 'rectangles: true' in its INPUT.AUGMENTATIONS "
                              "entry to paste box rectangles.")
        if _skip(self.p):
            return sample
        size = tuple(_image(sample).shape[-2:])
        other = _resized(extra.draw(), size)
        source = _with_masks(_Instances.of(other), size)
        if not len(source):
            return sample
        pasted = source[self.chosen(len(source))]
        union = pasted.masks.bool().any(dim=0)
        image = torch.where(union, _image(other), _image(sample))
        kept = self._occluded(_with_masks(_Instances.of(sample), size), union)
        joined = _Instances.cat([kept, pasted])
        if not with_masks:
            joined.masks = None
        return joined.into(sample, image)

    def chosen(self, n: int) -> torch.Tensor:
        """Ascending indices of the pasted instances among ``n``: each with probability ``paste_prob``, then as
        many as ``max_fraction`` allows, at least one."""
        draws = torch.rand(n)
        limit = max(1, int(self.max_fraction * n))
        count = min(max(1, int((draws < self.paste_prob).sum())), limit)
        return draws.argsort()[:count].sort().values

    def _occluded(self, instances: _Instances, union: torch.Tensor) -> _Instances:
        """The sample's instances under the pasted pixels ``union`` [H, W]: masks cut, boxes shrunk to the rest,
        the mostly hidden ones dropped, keypoints under pasted pixels made not visible."""
        masks = instances.masks.bool()
        visible = masks & ~union
        area, left = masks.flatten(1).sum(1), visible.flatten(1).sum(1)
        keep = (area == 0) | ((left > 0) & (left >= self.min_visible * area))
        cut = (left < area) & (left > 0)
        boxes = instances.boxes.clone()
        boxes[cut] = _mask_boxes(visible[cut])
        occluded = replace(instances, boxes=boxes, masks=visible.to(torch.uint8))
        if instances.keypoints is not None:
            occluded.visibility = _hidden(instances.keypoints, instances.visibility, union)
        return occluded[keep]


def _with_masks(instances: _Instances, size: tuple[int, int]) -> _Instances:
    """``instances``, with each box as a filled rectangle mask when they have no masks: the pixels whose centre
    lies in the box."""
    if instances.masks is not None:
        return instances
    h, w = size
    xs, ys = torch.arange(w) + 0.5, torch.arange(h) + 0.5
    b = instances.boxes
    cols = (xs >= b[:, 0:1]) & (xs < b[:, 2:3])  # [N, W]
    rows = (ys >= b[:, 1:2]) & (ys < b[:, 3:4])  # [N, H]
    return replace(instances, masks=(rows[:, :, None] & cols[:, None, :]).to(torch.uint8))


def _mask_boxes(masks: torch.Tensor) -> torch.Tensor:
    """XYXY boxes [N, 4] around non-empty masks [N, H, W]: pixel edges, so a pixel column x spans [x, x + 1)."""
    h, w = masks.shape[-2:]
    rows, cols = masks.any(dim=2), masks.any(dim=1)
    x0 = cols.to(torch.uint8).argmax(dim=1)
    x1 = w - cols.flip(1).to(torch.uint8).argmax(dim=1)
    y0 = rows.to(torch.uint8).argmax(dim=1)
    y1 = h - rows.flip(1).to(torch.uint8).argmax(dim=1)
    return torch.stack([x0, y0, x1, y1], dim=1).to(torch.float32)


def _hidden(points: torch.Tensor, visibility: torch.Tensor, union: torch.Tensor) -> torch.Tensor:
    """``visibility`` with the points on a pixel of ``union`` at most 1 (labelled, not visible)."""
    h, w = union.shape
    x, y = points[..., 0], points[..., 1]
    inside = (x >= 0) & (x < w) & (y >= 0) & (y < h)
    covered = union[y.long().clamp(0, h - 1), x.long().clamp(0, w - 1)] & inside
    return torch.where(covered, visibility.clamp(max=1), visibility)
