"""COCO-like ground truth without images, and detections a detector could have made of any ground truth.

For checking and timing evaluators: the tests of the COCO backends and the diagnostics
(tests/evaluation/test_coco_backends.py, tests/evaluation/test_diagnostics.py) on small sets, ``tools/benchmark.py
coco-eval`` on a COCO-sized one, which loads this file from tests/. No model, no pictures, only annotations, seeded so
that the same arguments give the same data.

Ground truth (:func:`synthetic_ground_truth`) follows COCO val2017's statistics roughly: 7.3
objects per image on average with a long tail, a long-tailed class frequency, object sizes spread
over small / medium / large about as COCO's (41 / 34 / 24 %), polygon masks, and ~1 % crowd regions
stored as uncompressed RLE, as COCO stores them.

Detections (:func:`synthetic_detections`) are made from ground truth the way a trained detector
errs: most objects found with a jittered box (more jitter for small ones) and a high score, some
with the wrong class, some twice, some missed, some detections on crowd regions, background boxes
with low scores, at most ``max_per_image`` per image. Masks follow the same jitter.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pycocotools.mask as mask_util

__all__ = ["synthetic_ground_truth", "synthetic_detections"]


def synthetic_ground_truth(
    num_images: int,
    num_classes: int = 80,
    seed: int = 0,
    *,
    mean_objects: float = 7.3,
    crowd_fraction: float = 0.01,
) -> dict[str, Any]:
    """A COCO ground-truth dict (``images``, ``annotations``, ``categories``) of ``num_images`` images.

    Images are 360-640 pixels a side; category ids are 1..``num_classes``; every annotation has a
    ``bbox``, a polygon ``segmentation`` (an uncompressed RLE for crowd regions) and its mask ``area``.
    """
    rng = np.random.default_rng(seed)
    frequency = 1.0 / np.arange(1, num_classes + 1) ** 0.9
    frequency /= frequency.sum()
    images, annotations = [], []
    for image_id in range(1, num_images + 1):
        height, width = (int(v) for v in rng.integers(360, 641, size=2))
        images.append({"id": image_id, "file_name": f"{image_id:012d}.jpg", "height": height, "width": width})
        for _ in range(rng.negative_binomial(1, 1 / (1 + mean_objects))):
            side = np.exp(rng.uniform(np.log(6), np.log(min(320, 0.9 * min(height, width)))))
            aspect = np.exp(rng.normal(0, 0.5))
            w, h = side * np.sqrt(aspect), side / np.sqrt(aspect)
            x, y = rng.uniform(0, width - min(w, width - 1)), rng.uniform(0, height - min(h, height - 1))
            polygon = _blob(rng, x, y, w, h)
            annotation = _annotation(len(annotations) + 1, image_id, int(rng.choice(num_classes, p=frequency)) + 1,
                                     [polygon], height, width)
            if rng.random() < crowd_fraction:
                annotation["iscrowd"] = 1
                annotation["segmentation"] = _uncompressed_rle([polygon], height, width)
            annotations.append(annotation)
    categories = [{"id": k, "name": f"class{k}", "supercategory": "thing"} for k in range(1, num_classes + 1)]
    return {"images": images, "annotations": annotations, "categories": categories}


def synthetic_detections(
    ground_truth: dict[str, Any],
    seed: int = 0,
    *,
    masks: bool = False,
    max_per_image: int = 100,
    background_per_image: float = 20.0,
    score_decimals: int | None = None,
) -> list[dict[str, Any]]:
    """COCO results (``image_id``, ``category_id``, ``bbox``, ``score``; with ``masks`` also an RLE
    ``segmentation``) for ``ground_truth``, a COCO dict such as :func:`synthetic_ground_truth`'s or a
    dataset's annotation file.

    ``score_decimals`` rounds the scores, which makes ties between detections (a case evaluators
    must order exactly as COCOeval does).
    """
    rng = np.random.default_rng(seed)
    category_ids = [c["id"] for c in ground_truth["categories"]]
    by_image: dict[int, list[dict[str, Any]]] = {}
    for annotation in ground_truth["annotations"]:
        by_image.setdefault(annotation["image_id"], []).append(annotation)
    results = []
    for image in ground_truth["images"]:
        size = (image["height"], image["width"])
        dets = [d for a in by_image.get(image["id"], []) for d in _detections_of(rng, a, category_ids, size)]
        dets += [_background(rng, category_ids, size) for _ in range(rng.poisson(background_per_image))]
        dets.sort(key=lambda d: -d[2])
        for polygons, category_id, score in dets[:max_per_image]:
            result = {"image_id": image["id"], "category_id": category_id, "bbox": _bbox(polygons, size),
                      "score": round(score, score_decimals) if score_decimals is not None else score}
            if masks:
                result["segmentation"] = _rle(polygons, *size)
            results.append(result)
    return results


def _detections_of(
    rng: np.random.Generator, annotation: dict[str, Any], category_ids: list[int], size: tuple[int, int]
) -> list[tuple[list[np.ndarray], int, float]]:
    """What a detector reports for one ground-truth object: (polygons, category id, score) each."""
    x, y, w, h = annotation["bbox"]
    polygons = _polygons_of(rng, annotation)
    if annotation.get("iscrowd", 0):  # a few detections of the crowd's members, inside its region
        return [(_jitter(rng, polygons, (x, y, w, h), 0.5, scale=0.3), annotation["category_id"], float(rng.beta(3, 2)))
                for _ in range(rng.integers(0, 4))]
    small = w * h < 32 ** 2
    if rng.random() > (0.55 if small else 0.9):
        return []  # missed
    noise = 0.07 if small else 0.035
    found = []
    for copy_index in range(1 + (rng.random() < 0.25)):  # sometimes twice
        right_class = rng.random() < 0.88
        category_id = annotation["category_id"] if right_class else int(rng.choice(category_ids))
        score = float(rng.beta(5, 1.5) if right_class else rng.beta(2, 3)) * (0.7 if copy_index else 1.0)
        found.append((_jitter(rng, polygons, (x, y, w, h), noise * (1 + 2 * copy_index)), category_id, score))
    return found


def _background(rng: np.random.Generator, category_ids: list[int], size: tuple[int, int]) -> tuple[list, int, float]:
    """A low-scoring detection of nothing: a blob anywhere, of any class."""
    height, width = size
    side = np.exp(rng.uniform(np.log(8), np.log(0.6 * min(size))))
    x, y = rng.uniform(0, width - side), rng.uniform(0, height - side)
    polygon = _blob(rng, x, y, side, side * np.exp(rng.normal(0, 0.4)))
    return [polygon], int(rng.choice(category_ids)), float(rng.beta(1, 5))


def _blob(rng: np.random.Generator, x: float, y: float, w: float, h: float) -> np.ndarray:
    """A star-shaped polygon (x0, y0, x1, y1, ...) filling most of the box (x, y, w, h)."""
    count = int(rng.integers(8, 21))
    angles = np.sort(rng.uniform(0, 2 * np.pi, count))
    radii = rng.uniform(0.75, 1.0, count)
    points = np.stack([x + w / 2 * (1 + radii * np.cos(angles)), y + h / 2 * (1 + radii * np.sin(angles))], axis=1)
    return points.reshape(-1)


def _polygons_of(rng: np.random.Generator, annotation: dict[str, Any]) -> list[np.ndarray]:
    segmentation = annotation.get("segmentation")
    if isinstance(segmentation, list) and segmentation:
        return [np.asarray(p, dtype=np.float64) for p in segmentation]
    return [_blob(rng, *annotation["bbox"])]  # an RLE (crowd) or no mask: a blob in its box


def _jitter(
    rng: np.random.Generator, polygons: list[np.ndarray], box: tuple[float, ...], noise: float, scale: float = 1.0
) -> list[np.ndarray]:
    """``polygons`` moved and resized as a detector's box would be (``noise`` relative to the box size)."""
    x, y, w, h = box
    sx, sy = scale * np.exp(rng.normal(0, noise, 2))
    dx, dy = rng.normal(0, noise, 2) * (w, h) + (1 - scale) * rng.uniform(0, 1, 2) * (w, h)
    moved = []
    for polygon in polygons:
        points = polygon.reshape(-1, 2)
        points = np.stack([x + dx + (points[:, 0] - x) * sx, y + dy + (points[:, 1] - y) * sy], axis=1)
        moved.append(points.reshape(-1))
    return moved


def _bbox(polygons: list[np.ndarray], size: tuple[int, int]) -> list[float]:
    points = np.concatenate(polygons).reshape(-1, 2)
    x0, y0 = np.clip(points.min(axis=0), 0, (size[1], size[0]))
    x1, y1 = np.clip(points.max(axis=0), 0, (size[1], size[0]))
    return [round(float(v), 2) for v in (x0, y0, x1 - x0, y1 - y0)]


def _rle(polygons: list[np.ndarray], height: int, width: int) -> dict[str, Any]:
    rle = mask_util.merge(mask_util.frPyObjects([p.tolist() for p in polygons], height, width))
    return {"size": [int(v) for v in rle["size"]], "counts": rle["counts"].decode("ascii")}


def _uncompressed_rle(polygons: list[np.ndarray], height: int, width: int) -> dict[str, Any]:
    """COCO's crowd format: run lengths of the column-major mask, starting with a run of zeros."""
    mask = mask_util.decode(mask_util.merge(mask_util.frPyObjects([p.tolist() for p in polygons], height, width)))
    flat = mask.reshape(-1, order="F")
    changes = np.flatnonzero(np.diff(flat)) + 1
    runs = np.diff(np.concatenate([[0], changes, [flat.size]]))
    counts = ([0] if flat[0] else []) + runs.tolist()
    return {"size": [height, width], "counts": [int(c) for c in counts]}


def _annotation(
    annotation_id: int, image_id: int, category_id: int, polygons: list[np.ndarray], height: int, width: int
) -> dict[str, Any]:
    segmentation = [[round(float(v), 2) for v in p] for p in polygons]
    rle = mask_util.merge(mask_util.frPyObjects(segmentation, height, width))
    return {"id": annotation_id, "image_id": image_id, "category_id": category_id,
            "bbox": [float(v) for v in mask_util.toBbox(rle)], "area": float(mask_util.area(rle)), "iscrowd": 0,
            "segmentation": segmentation}
