"""The "shapes" demo set: a deterministic synthetic detection dataset in COCO format.

The set is meant to be a small but honest benchmark, not a toy: three classes (circle,
rectangle, triangle), one to six objects per image of 12 to 96 pixels, overlaps with
partial occlusion (at most a quarter of an object hidden), colours drawn at random, and
noisy, gradient or textured backgrounds with line clutter. Images are 192-256 pixels per
side (independently), so aspect-ratio grouping has something to group. Every image
comes from its own seeded random stream, so the same arguments always produce the same
files.

Boxes, areas and polygons describe the *visible* part of each object (as in COCO): a new
object is only placed where every earlier one keeps at least three quarters of its area.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np

from pet.utils.files import atomic_path, file_lock

__all__ = ["SHAPE_CLASSES", "DrawnObject", "generate_shapes", "is_complete", "render_picture", "render_objects",
           "render_scene", "mask_polygons"]

logger = logging.getLogger(__name__)

SHAPE_CLASSES = ("circle", "rectangle", "triangle")
# Bump when the drawing code changes, so existing generated sets are rebuilt.
_GENERATOR_VERSION = 2
_MARKER = ".complete.json"
# Fraction of an object that must stay visible after later objects are drawn: overlaps are
# common, but no object is hidden so far that its visible box stops saying what it is.
_MIN_VISIBLE = 0.75
_MIN_CONTRAST = 80.0  # minimum RGB distance between an object's colour and the background under it


def generate_shapes(
    root: str,
    num_train: int = 1500,
    num_val: int = 200,
    seed: int = 0,
    *,
    image_size: tuple[int, int] = (192, 256),
    object_size: tuple[int, int] = (12, 96),
    max_objects: int = 6,
) -> str:
    """Write the demo set under ``root`` unless a complete copy with the same arguments is there.

    Layout: ``root/{train,val}/<id>.jpg`` and ``root/annotations/{train,val}.json``. The
    set is built in a temporary sibling directory and renamed into place at the end, and
    a marker file records the arguments, so an interrupted run never leaves a partial set
    that looks complete. Concurrent callers (several ranks, test workers) are serialised
    with a file lock. Returns ``root``.
    """
    root = os.path.abspath(root)
    params = {
        "version": _GENERATOR_VERSION, "num_train": num_train, "num_val": num_val, "seed": seed,
        "image_size": list(image_size), "object_size": list(object_size), "max_objects": max_objects,
    }
    if is_complete(root, params):
        return root
    parent = os.path.dirname(root)
    os.makedirs(parent, exist_ok=True)
    with file_lock(os.path.join(parent, f".{os.path.basename(root)}.lock")):
        if is_complete(root, params):  # another process finished it while we waited
            return root
        start = time.perf_counter()
        logger.info(f"Generating the shapes demo set ({num_train} train + {num_val} val images) in {root} ...")
        for stale in glob.glob(f"{glob.escape(root)}.tmp*"):  # left by a killed run (also the older .tmp-<pid>)
            shutil.rmtree(stale, ignore_errors=True)
        with atomic_path(root) as tmp:  # replaces a partial or outdated set only once this one is complete
            for split, count, split_seed in (("train", num_train, 0), ("val", num_val, 1)):
                _write_split(tmp, split, count, (seed, split_seed), params)
            with open(os.path.join(tmp, _MARKER), "w") as f:
                json.dump(params, f)
        logger.info(f"Shapes demo set written in {time.perf_counter() - start:.1f} s")
    return root


def is_complete(root: str, params: dict[str, Any] | None = None) -> bool:
    """Whether ``root`` holds a fully written set (generated with ``params`` when given)."""
    marker = os.path.join(root, _MARKER)
    if not os.path.isfile(marker):
        return False
    if params is None:
        return True
    try:
        with open(marker) as f:
            return json.load(f) == params
    except (OSError, ValueError):
        return False


def _write_split(out_dir: str, split: str, count: int, seed: tuple[int, int], params: dict[str, Any]) -> None:
    image_dir = os.path.join(out_dir, split)
    os.makedirs(image_dir, exist_ok=True)
    os.makedirs(os.path.join(out_dir, "annotations"), exist_ok=True)
    images, annotations = [], []
    for image_id in range(1, count + 1):
        rng = np.random.default_rng([*seed, image_id])
        height, width = (int(v) for v in rng.integers(params["image_size"][0], params["image_size"][1] + 1, size=2))
        image, objects = render_picture(rng, height, width, params["object_size"], params["max_objects"])
        file_name = f"{image_id:06d}.jpg"
        cv2.imwrite(os.path.join(image_dir, file_name), image, [cv2.IMWRITE_JPEG_QUALITY, 92])
        images.append({"id": image_id, "file_name": file_name, "height": height, "width": width})
        for label, mask in objects:
            x, y, w, h = cv2.boundingRect(mask)
            annotations.append({
                "id": len(annotations) + 1, "image_id": image_id, "category_id": label + 1,
                "bbox": [x, y, w, h], "area": int(np.count_nonzero(mask)), "iscrowd": 0,
                "segmentation": mask_polygons(mask),
            })
    coco = {
        "info": {"description": f"Pet shapes demo set ({split})", "version": str(_GENERATOR_VERSION)},
        "images": images,
        "annotations": annotations,
        "categories": [{"id": i + 1, "name": n, "supercategory": "shape"} for i, n in enumerate(SHAPE_CLASSES)],
    }
    with open(os.path.join(out_dir, "annotations", f"{split}.json"), "w") as f:
        json.dump(coco, f)


def render_picture(
    rng: np.random.Generator, height: int, width: int, object_size: list[int], max_objects: int
) -> tuple[np.ndarray, list[tuple[int, np.ndarray]]]:
    """One BGR image and its objects as ``(class index, visible mask)``."""
    image, objects = render_objects(rng, height, width, object_size, max_objects)
    return image, [(o.label, o.visible) for o in objects]


@dataclass
class DrawnObject:
    """One object of a rendered picture: its class index, visible mask (uint8 0/1), the vertices it was drawn from
    (float64 [P, 2], x y in pixels) and the mask of the objects drawn over it (bool), which hides its vertices."""

    label: int
    visible: np.ndarray
    vertices: np.ndarray
    covered: np.ndarray


def render_objects(
    rng: np.random.Generator, height: int, width: int, object_size: list[int], max_objects: int
) -> tuple[np.ndarray, list[DrawnObject]]:
    """One BGR image and its objects with their vertices (:func:`render_picture` draws the same from the same
    ``rng``: the shapes set's keypoints come from here, for the images already written)."""
    image = _background(rng, height, width)
    full_masks: list[np.ndarray] = []
    visible: list[np.ndarray] = []
    labels: list[int] = []
    shapes: list[np.ndarray] = []
    for _ in range(int(rng.integers(1, max_objects + 1))):
        for _attempt in range(20):
            label = int(rng.integers(len(SHAPE_CLASSES)))
            mask = np.zeros((height, width), np.uint8)
            shape = _draw_shape(rng, mask, label, object_size, 1)
            covered = mask.astype(bool)
            after = [v & ~covered for v in visible]
            if all(a.sum() >= _MIN_VISIBLE * f.sum() for a, f in zip(after, full_masks)):
                break
        else:
            continue  # no place left where the new object hides too little of the others
        colour = _contrasting_colour(rng, image, covered)
        _draw_shape(rng, image, label, object_size, colour, shape)
        full_masks.append(covered)
        visible = [*after, covered]
        labels.append(label)
        shapes.append(shape)
    if rng.random() < 0.3:
        image = cv2.GaussianBlur(image, (3, 3), 0)
    noise = rng.normal(0.0, rng.uniform(2.0, 12.0), image.shape).astype(np.float32)
    image = np.clip(image + noise, 0, 255).astype(np.uint8)
    objects = []
    for i, (label, v, shape) in enumerate(zip(labels, visible, shapes)):
        if v.any():
            later = np.logical_or.reduce(full_masks[i + 1:]) if i + 1 < len(full_masks) else np.zeros_like(v)
            objects.append(DrawnObject(label, v.astype(np.uint8), shape.astype(np.float64) / 4, later))
    return image, objects


def _draw_shape(
    rng: np.random.Generator,
    canvas: np.ndarray,
    label: int,
    object_size: list[int],
    colour: Any,
    shape: np.ndarray | None = None,
) -> np.ndarray:
    """Fill one object on ``canvas``; ``shape`` (the polygon to draw) is drawn at random when None."""
    if shape is None:
        shape = _random_polygon(rng, label, canvas.shape[0], canvas.shape[1], object_size)
    line = cv2.LINE_AA if canvas.ndim == 3 else cv2.LINE_8
    cv2.fillPoly(canvas, [shape], colour, lineType=line, shift=2)
    return shape


def _random_polygon(
    rng: np.random.Generator, label: int, height: int, width: int, object_size: list[int],
    center: tuple[float, float] | None = None,
) -> np.ndarray:
    """Vertices (int32, 2 fractional bits for sub-pixel accuracy) of a shape fully inside the image, centred at
    ``center`` (x, y; moved in as far as needed to fit) or at random."""
    size = rng.uniform(object_size[0], object_size[1])
    if SHAPE_CLASSES[label] == "circle":
        angles = np.linspace(0, 2 * np.pi, 48, endpoint=False)
        points = np.stack([np.cos(angles), np.sin(angles)], axis=1) * size / 2
    elif SHAPE_CLASSES[label] == "rectangle":
        short = size * rng.uniform(0.45, 1.0)
        w, h = (size, short) if rng.random() < 0.5 else (short, size)
        points = np.array([[-w, -h], [w, -h], [w, h], [-w, h]]) / 2
    else:  # a triangle close enough to equilateral to stay recognisable, at any rotation
        angles = rng.uniform(0, 2 * np.pi) + np.arange(3) * 2 * np.pi / 3 + rng.uniform(-0.35, 0.35, size=3)
        points = np.stack([np.cos(angles), np.sin(angles)], axis=1) * size / 2
        extent = points.max(axis=0) - points.min(axis=0)
        points *= size / extent.max()
    points -= (points.max(axis=0) + points.min(axis=0)) / 2
    half = (points.max(axis=0) - points.min(axis=0)) / 2
    if center is None:
        centre = rng.uniform(half, np.array([width, height]) - half)
    else:
        centre = np.clip(np.asarray(center, dtype=np.float64), half, np.array([width, height]) - half)
    return np.round((points + centre) * 4).astype(np.int32)


def render_scene(
    height: int,
    width: int,
    num_objects: int,
    seed: int = 0,
    *,
    object_size: tuple[int, int] = (20, 100),
    centers: Sequence[tuple[float, float]] = (),
) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """A large picture in the style of the shapes set (for tiled prediction): the same backgrounds, shapes,
    colours and noise, with ``num_objects`` objects of ``object_size`` px that do not touch one another.

    ``centers`` (x, y) places the first objects (e.g. on tile seams); the others are placed at random. An
    object that finds no free place in 50 tries is left out. Returns the BGR image and the objects, each
    ``{"label": class index, "box": [x0, y0, x1, y1]}`` (pixel edges).
    """
    rng = np.random.default_rng([seed, 2])
    image = _background(rng, height, width)
    objects: list[dict[str, Any]] = []
    taken: list[tuple[int, int, int, int]] = []
    for i in range(num_objects):
        for _attempt in range(50):
            label = int(rng.integers(len(SHAPE_CLASSES)))
            center = centers[i] if i < len(centers) else None
            shape = _random_polygon(rng, label, height, width, list(object_size), center)
            x0, y0 = (int(v) for v in shape.min(axis=0) // 4)
            x1, y1 = (int(v) + 2 for v in shape.max(axis=0) // 4)
            x1, y1 = min(x1, width), min(y1, height)
            if all(x1 + 4 <= a0 or a1 + 4 <= x0 or y1 + 4 <= b0 or b1 + 4 <= y0 for a0, b0, a1, b1 in taken):
                break
        else:
            continue
        local = shape - np.array([x0, y0], dtype=np.int32) * 4
        mask = np.zeros((y1 - y0, x1 - x0), np.uint8)
        cv2.fillPoly(mask, [local], 1, lineType=cv2.LINE_8, shift=2)
        window = image[y0:y1, x0:x1]  # a view: drawn in place
        _draw_shape(rng, window, label, list(object_size), _contrasting_colour(rng, window, mask.astype(bool)), local)
        bx, by, bw, bh = cv2.boundingRect(mask)
        objects.append({"label": label, "box": [x0 + bx, y0 + by, x0 + bx + bw, y0 + by + bh]})
        taken.append((x0, y0, x1, y1))
    noise = rng.normal(0.0, rng.uniform(2.0, 12.0), image.shape).astype(np.float32)
    return np.clip(image + noise, 0, 255).astype(np.uint8), objects


def _background(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    kind = rng.choice(["noise", "gradient", "blotches", "tiles"], p=[0.3, 0.3, 0.2, 0.2])
    if kind == "noise":  # flat colour under strong noise
        base = rng.uniform(0, 255, size=3).astype(np.float32)
        image = base + rng.normal(0.0, rng.uniform(10.0, 35.0), (height, width, 3)).astype(np.float32)
    elif kind == "gradient":  # linear gradient between two colours in a random direction
        theta = rng.uniform(0, 2 * np.pi)
        ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
        t = xs * np.cos(theta) + ys * np.sin(theta)
        t = (t - t.min()) / max(float(t.max() - t.min()), 1.0)
        c0, c1 = rng.uniform(0, 255, size=(2, 3)).astype(np.float32)
        image = c0 + t[..., None] * (c1 - c0)
    elif kind == "blotches":  # smooth blotches of any colour
        grid = rng.uniform(0, 255, size=(*rng.integers(3, 10, size=2), 3)).astype(np.float32)
        image = cv2.resize(grid, (width, height), interpolation=cv2.INTER_CUBIC)
    else:  # tiles: low-contrast blocks around one colour
        base = rng.uniform(40, 215, size=3).astype(np.float32)
        grid = base + rng.uniform(-40, 40, size=(*rng.integers(3, 12, size=2), 3)).astype(np.float32)
        image = cv2.resize(grid, (width, height), interpolation=cv2.INTER_NEAREST)
    image = np.clip(image, 0, 255).astype(np.uint8)
    for _ in range(int(rng.integers(0, 7))):  # straight-edge clutter the detector must ignore
        p0 = (int(rng.integers(width)), int(rng.integers(height)))
        p1 = (int(rng.integers(width)), int(rng.integers(height)))
        colour = tuple(int(c) for c in rng.integers(0, 256, size=3))
        cv2.line(image, p0, p1, colour, int(rng.integers(1, 4)), lineType=cv2.LINE_AA)
    return image


def _contrasting_colour(rng: np.random.Generator, image: np.ndarray, mask: np.ndarray) -> tuple[int, int, int]:
    """A random colour that stands out from the mean background colour under ``mask``."""
    under = image[mask].reshape(-1, 3).mean(axis=0)
    colour = rng.integers(0, 256, size=3)
    for _ in range(20):
        if np.linalg.norm(colour - under) >= _MIN_CONTRAST:
            break
        colour = rng.integers(0, 256, size=3)
    return tuple(int(c) for c in colour)


def mask_polygons(mask: np.ndarray) -> list[list[float]]:
    contours, _ = cv2.findContours(mask, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE)
    return [c.reshape(-1).astype(float).tolist() for c in contours if len(c) >= 3]
